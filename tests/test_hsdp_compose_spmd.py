"""HSDP composes with expert and with context parallelism and trains like one device (tier 2,
8 gloo ranks). On {rep: 2, dp: 2, ep: 2} with ``fsdp=("rep", "dp")`` the parameters outside the
experts are replicated over ``rep`` and sharded over ``dp+ep`` (one flattened dim, torchtitan's
``dp_replicate`` × ``dp_shard_cp``), the experts sharded over ``ep`` and FSDP-sharded over
``dp``, replicated over ``rep``: meshtrain's MoE and transformers' Qwen3-MoE. On
{rep: 2, dp: 2, cp: 2} the parameters are replicated over ``rep`` and sharded over ``dp+cp``:
meshtrain's Llama and transformers' Llama. fp32, AdamW, 2 steps each, gradients averaged (and
summed under ``grad_reduction="sum"`` for meshtrain's models), also with the replicate axis
after the expert or context axis in the mesh; the run's worst error over its bound and its wall
time are printed. Plain HSDP on {dp: 2, rep: 2} (the replicate axis last; 4 ranks, first tier)
under ZeRO 3 and ZeRO 0. Last, a sharded checkpoint saved under HSDP × ep loads
with the same values on a plain ep mesh."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from context_models import MODELS, SEQ, batches, rules
from moe_models import ep_rules, meshtrain_moe, qwen3_moe, token_batches

import meshtrain as mt
from meshtrain.lower import full_tensor
from meshtrain.models.moe import default_rules as moe_rules
from meshtrain.testing import assert_equivalent
from meshtrain.testing.harness import EquivalenceReport
from meshtrain.testing.runner import get_pool
from meshtrain.train.batch import Batch
from meshtrain.train.checkpoint.dcp import CheckpointConfig, Checkpointer, load_checkpoint
from meshtrain.train.loss import data_parallel_rank, summed_cross_entropy
from meshtrain.train.state import TrainState
from meshtrain.train.step import make_train_step

pytestmark = pytest.mark.spmd

HSDP = ("rep", "dp")
HSDP_EP = {"rep": 2, "dp": 2, "ep": 2}
HSDP_CP = {"rep": 2, "dp": 2, "cp": 2}


def _worst_ratio(report: EquivalenceReport) -> float:
    """The largest error over its bound of every comparison the run made (1 would fail)."""
    return max(comparison.ratio for comparison in report.comparisons)


def _equivalent(
    name: str,
    model_fn: Callable[[], torch.nn.Module],
    mesh: dict[str, int],
    options: dict[str, Any],
    batches_fn: Callable[[int], Any],
) -> dict[str, Any]:
    """2 AdamW steps in fp32 against one device; the plan the ranks ran, after printing the
    worst error over its bound and the wall time."""
    start = time.perf_counter()
    report = assert_equivalent(
        model_fn, mesh, options, batches=batches_fn, steps=2, optimizer="adamw"
    )
    print(
        f"{name} on {mesh}: {time.perf_counter() - start:.1f} s, worst "
        f"{_worst_ratio(report):.3f} of the bound"
    )
    assert report.passed and report.contract.level == "reduction-order"
    plan: dict[str, Any] = json.loads(report.plan_json)
    assert plan["data_axes"] == list(HSDP)
    return plan


def _moe_rules() -> mt.Rules:
    return moe_rules(tp=None, fsdp=HSDP, ep="ep")


@pytest.mark.extended
@pytest.mark.parametrize(
    ("name", "model_fn", "rules_fn", "mesh", "options"),
    [
        ("meshtrain-moe", meshtrain_moe, _moe_rules, HSDP_EP, {}),
        ("meshtrain-moe-summed", meshtrain_moe, _moe_rules, HSDP_EP, {"grad_reduction": "sum"}),
        ("meshtrain-moe-ep-first", meshtrain_moe, _moe_rules, {"ep": 2, "rep": 2, "dp": 2}, {}),
        ("qwen3-moe", qwen3_moe, lambda: ep_rules(fsdp=HSDP), HSDP_EP, {}),
    ],
)
def test_moe_trains_like_one_device_on_rep2_dp2_ep2(
    name: str,
    model_fn: Callable[[], torch.nn.Module],
    rules_fn: Callable[[], mt.Rules],
    mesh: dict[str, int],
    options: dict[str, Any],
) -> None:
    plan = _equivalent(name, model_fn, mesh, {"rules": rules_fn(), **options}, token_batches)
    assert plan["expert_axis"] == "ep"


@pytest.mark.extended
@pytest.mark.parametrize(
    ("name", "mesh", "options"),
    [
        ("llama", HSDP_CP, {}),
        ("llama-summed", HSDP_CP, {"grad_reduction": "sum"}),
        ("llama-cp-first", {"cp": 2, "rep": 2, "dp": 2}, {}),
        ("llama-zero0", HSDP_CP, {"zero": 0}),
        ("hf_llama", HSDP_CP, {}),
    ],
)
def test_context_parallel_trains_like_one_device_on_rep2_dp2_cp2(
    name: str, mesh: dict[str, int], options: dict[str, Any]
) -> None:
    model_fn = MODELS[name.split("-")[0]]
    plan = _equivalent(
        name, model_fn, mesh, {"rules": rules(HSDP), "seq_len": SEQ, **options}, batches
    )
    assert plan["context_axis"] == "cp"


@pytest.mark.parametrize("zero", [3, 0])
def test_plain_hsdp_trains_like_one_device_with_the_replicate_axis_last(zero: int) -> None:
    """{dp: 2, rep: 2} (4 ranks): FSDP2's mesh [rep, dp] is not a slice of this mesh in its
    order; it is put together dim by dim."""
    rules_hsdp = mt.Rules({".*": mt.P()}, fsdp=HSDP)
    _equivalent(
        "llama", MODELS["llama"], {"dp": 2, "rep": 2}, {"rules": rules_hsdp, "zero": zero}, batches
    )


# ----------------------------------------------------------------------------- checkpoint


def _trained_and_saved(directory: str) -> dict[str, torch.Tensor]:
    """One AdamW step of meshtrain's MoE under HSDP × ep, saved; the full values."""
    torch.manual_seed(0)
    model = meshtrain_moe()
    plan = mt.plan(model, mt.make_mesh(HSDP_EP), _moe_rules())
    applied = mt.apply(plan, model)
    params = dict(applied.named_parameters())
    optimizer = torch.optim.AdamW(list(params.values()), lr=1e-3)
    train_step = make_train_step(plan, summed_cross_entropy, optimizer)
    index, ranks = data_parallel_rank(plan)
    inputs, targets = token_batches(0)
    rows = slice(index * len(inputs) // ranks, (index + 1) * len(inputs) // ranks)
    train_step(TrainState.create(applied, optimizer), Batch(inputs[rows], targets[rows]))
    Checkpointer(CheckpointConfig(directory)).save(1, params, optimizer, {"step": 1})
    return _full(params, optimizer)


def _loaded_under_ep8(path: str) -> dict[str, torch.Tensor]:
    """meshtrain's MoE on a plain ep mesh of 8 ranks (no data axis), loaded from ``path``."""
    torch.manual_seed(7)  # other weights: everything must come from the checkpoint
    model = meshtrain_moe()
    plan = mt.plan(model, mt.make_mesh(ep=8), moe_rules(tp=None, fsdp=(), ep="ep"))
    applied = mt.apply(plan, model)
    params = dict(applied.named_parameters())
    optimizer = torch.optim.AdamW(list(params.values()), lr=1e-3)
    load_checkpoint(path, params, optimizer)
    return _full(params, optimizer)


def _full(params: dict[str, torch.Tensor], optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    values = {}
    for fqn, param in params.items():
        values[fqn] = full_tensor(param.detach()).clone()
        for key, state in optimizer.state[param].items():
            values[f"{fqn}.{key}"] = full_tensor(state).clone()
    return values


@pytest.mark.extended
def test_a_checkpoint_saved_under_hsdp_and_ep_loads_under_ep8(tmp_path: Path) -> None:
    start = time.perf_counter()
    saved = get_pool(8).run(_trained_and_saved, str(tmp_path))[0]
    loaded = get_pool(8).run(_loaded_under_ep8, str(tmp_path / "step_00000001"))[0]
    print(f"checkpoint HSDP x ep -> ep 8: {time.perf_counter() - start:.1f} s")
    assert sorted(loaded) == sorted(saved) and any(k.endswith("exp_avg_sq") for k in saved)
    for key, value in saved.items():
        assert torch.equal(loaded[key], value), key
