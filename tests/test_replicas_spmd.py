"""Replicas cannot drift silently (tier 2: gloo ranks): ``verify_replicas`` passes on a clean
run, and one rank's replica perturbed by one ulp — a parameter or an optimizer state — is a
``ReplicaDriftError`` on every rank naming the tensor and the ranks that disagree; the recipe
loop runs it every ``[train] verify_every`` steps.

The drift is planted here only (in the test's task, or by wrapping the train step), never in the
library.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from helpers import mesh_for
from torch.distributed.tensor import DTensor, Replicate

import meshtrain as mt
from meshtrain.errors import ReplicaDriftError
from meshtrain.models import LlamaConfig, build_llama, default_rules
from meshtrain.testing.runner import get_pool
from meshtrain.train import Batch, forward_backward
from meshtrain.train.replicas import verify_replicas

pytestmark = pytest.mark.spmd

Axes = tuple[tuple[str, int], ...]


def _perturb(tensor: torch.Tensor) -> None:
    """One ulp up in the first element of this rank's copy."""
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    flat = local.detach().view(-1)
    flat[0] = torch.nextafter(flat[0], torch.tensor(float("inf"), dtype=flat.dtype))


def check_after_one_step(axes: Axes, zero: int, plant: str) -> dict[str, Any]:
    """Runs on every rank: one AdamW step of the debug Llama, then (on rank 1 only) ``plant``
    ('' none, 'param' or 'state') perturbs the first replicated tensor, then the check."""
    shape = dict(axes)
    rules = default_rules(tp="tp" if "tp" in shape else None, fsdp="dp" if "dp" in shape else None)
    model = build_llama(LlamaConfig.preset("debug", n_layers=2), seed=0)
    plan = mt.plan(model, mesh_for(axes), rules, zero=zero)
    applied = mt.apply(plan, model)
    optimizer = torch.optim.AdamW(applied.parameters(), lr=1e-3)
    tokens = torch.randint(0, 256, (4, 17), generator=torch.Generator().manual_seed(0))
    forward_backward(plan, applied, Batch(tokens[:, :-1], tokens[:, 1:]))
    optimizer.step()
    params = dict(applied.named_parameters())
    replicated = [
        fqn
        for fqn, p in params.items()
        if isinstance(p, DTensor) and any(isinstance(x, Replicate) for x in p.placements)
    ]
    target = replicated[1]
    if plant and dist.get_rank() == 1:
        param = params[target]
        _perturb(param if plant == "param" else optimizer.state[param]["exp_avg"])
    try:
        checked = verify_replicas(plan, params, optimizer, step=1)
    except ReplicaDriftError as err:
        return {"error": err.message, "fqn": err.fqn, "target": target}
    return {"checked": checked, "target": target}


def test_no_drift_passes_and_counts_the_replicated_tensors() -> None:
    results = get_pool(2).run(check_after_one_step, (("dp", 2),), 0, "", _timeout_s=120)
    # ZeRO 0: every parameter replicated over dp, with its exp_avg, exp_avg_sq and step
    assert all("error" not in r for r in results), results
    assert results[0]["checked"] == results[1]["checked"] > 0
    assert results[0]["checked"] % 4 == 0, results


@pytest.mark.parametrize("plant", ["param", "state"])
def test_one_ulp_on_one_rank_is_named_on_every_rank(plant: str) -> None:
    results = get_pool(2).run(check_after_one_step, (("tp", 2),), 0, plant, _timeout_s=120)
    target = results[0]["target"]
    for result in results:
        assert "error" in result, result
        assert result["fqn"] == target, result
        text = result["error"]
        assert f"'{target}" in text and "after step 1" in text, text
        assert "ranks [0] hold one value; ranks [1] hold another" in text, text
        if plant == "state":
            assert "(optimizer state exp_avg)" in text, text


def train_debug_recipe(root: str, drift_at: int) -> dict[str, Any]:
    """Runs on every rank: the debug recipe for 3 steps with ``verify_every = 2``; from step
    ``drift_at`` on (0: never) rank 1's first tp-replicated parameter moves one ulp after the step."""
    from meshtrain.recipes import load_recipe
    from meshtrain.recipes.run import train
    from meshtrain.train.step import TrainStep

    original = TrainStep.__call__

    def drifting(self: TrainStep, state: Any, batch: Any) -> Any:
        state, metrics = original(self, state, batch)
        if drift_at and state.step >= drift_at and dist.get_rank() == 1:
            _perturb(state.params["norm.weight"])
        return state, metrics

    recipe = load_recipe(
        "debug",
        [
            "train.steps=3",
            "train.warmup_steps=1",
            "train.seq_len=16",
            "train.verify_every=2",
            "data.source=synthetic",
            f"logging.run_dir={root}",
            "logging.console=false",
            "logging.wandb=disabled",
            "checkpoint.interval=0",
            "checkpoint.resume=false",
        ],
    )
    with mock.patch.object(TrainStep, "__call__", drifting):
        try:
            result = train(recipe)
        except ReplicaDriftError as err:
            return {"error": err.message}
    return {"steps": sorted(result.losses)}


@pytest.mark.slow
def test_recipe_loop_checks_every_n_steps(tmp_path: Path) -> None:
    pool = get_pool(2)
    clean = pool.run(train_debug_recipe, str(tmp_path / "clean"), 0, _timeout_s=300)
    assert all(r == {"steps": [1, 2, 3]} for r in clean), clean
    # a drift after step 1 is found at the first check, step 2 (before its checkpoint)
    drifted = pool.run(train_debug_recipe, str(tmp_path / "drift"), 1, _timeout_s=300)
    for result in drifted:
        assert "replicas drifted apart after step 2: 'norm.weight'" in result["error"], result
