"""Context parallelism trains like one device on gloo ranks (tier 2): meshtrain's Llama and tiny
``transformers`` Llama, Qwen2 and Mistral (sliding window 12 < sequence 32), built locally, under
cp 2 and 4, alone, with FSDP over dp, with tensor + sequence parallelism (cp 2 x tp 2) and with
pipelines (pp 2 x cp 2), fp32 within the contract
(:func:`meshtrain.testing.contract.context_reordering`) and bf16; against a plain one-process
PyTorch loop; planted faults (a chunk's positions off by one, the mask on the chunks in the wrong
order) are caught; a DCP checkpoint saved under dp 2 x cp 2 loads under dp 4. All on the 4-rank
pool the other tier-2 tests share."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from context_models import MODELS, SEQ, batches, rules, tp_rules

import meshtrain as mt
from meshtrain.lower import full_tensor
from meshtrain.lower.context.layout import chunk_positions
from meshtrain.testing import assert_equivalent
from meshtrain.testing.contract import contract_for
from meshtrain.testing.runner import get_pool
from meshtrain.train.batch import Batch
from meshtrain.train.checkpoint.dcp import CheckpointConfig, Checkpointer, load_checkpoint
from meshtrain.train.evaluate import evaluate
from meshtrain.train.loss import data_parallel_rank, summed_cross_entropy
from meshtrain.train.state import TrainState
from meshtrain.train.step import make_train_step

pytestmark = pytest.mark.spmd

DP2_CP2 = {"dp": 2, "cp": 2}
LR = 0.1


def _equivalent(name: str, mesh: dict[str, int], optimizer: str = "adamw", **options: Any) -> None:
    fsdp = ("dp",) if "dp" in mesh else ()
    report = assert_equivalent(
        MODELS[name],
        mesh,
        {"rules": rules(fsdp), "seq_len": SEQ, **options},
        batches=batches,
        steps=2,
        optimizer=optimizer,
    )
    assert report.passed
    assert report.contract.level == (
        "reduction-order" if "precision" not in options else "approximate"
    )


def test_llama_moe_and_mistral_train_like_one_device_on_dp2_cp2() -> None:
    """meshtrain's Llama and MoE (their attention_fn and positions; the MoE's balance loss from
    the whole batch's counts) and Mistral's sliding window (transformers' attention interface)."""
    for name in ("llama", "moe", "mistral"):
        _equivalent(name, DP2_CP2)


# ----------------------------------------------------------------------------- a plain loop


def _plain_loop(name: str, steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, the ordinary way: the mean token loss, backward, SGD."""
    torch.manual_seed(0)
    model = MODELS[name]()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses, bound = [], {fqn: 0.0 for fqn, _ in model.named_parameters()}
    for step in range(steps):
        inputs, targets = batches(step)
        logits = model(inputs)
        logits = logits if isinstance(logits, torch.Tensor) else logits.logits
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss.backward()
        for fqn, param in model.named_parameters():  # |Δparam| ≤ lr · tolerance · max |grad|
            bound[fqn] += LR * float(param.grad.abs().max())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    with torch.no_grad():  # the validation loss on the next batch
        inputs, targets = batches(steps)
        losses.append(float(F.cross_entropy(model(inputs).logits.flatten(0, 1), targets.flatten())))
    return losses, {fqn: p.detach() for fqn, p in model.named_parameters()} | {
        f"bound.{fqn}": torch.tensor(b) for fqn, b in bound.items()
    }


def _context_run(name: str, steps: int) -> tuple[list[float], dict[str, torch.Tensor], float]:
    """On each of 4 ranks: dp 2 x cp 2, meshtrain's own train step, this rank's rows."""
    torch.manual_seed(0)
    model = MODELS[name]()
    plan = mt.plan(model, mt.make_mesh(DP2_CP2), rules(), seq_len=SEQ)
    applied = mt.apply(plan, model)
    optimizer = torch.optim.SGD(applied.parameters(), lr=LR)
    train_step = make_train_step(plan, summed_cross_entropy, optimizer, max_norm=None)
    state = TrainState.create(applied, optimizer)
    index, ranks = data_parallel_rank(plan)
    losses = []
    for step in range(steps):
        inputs, targets = batches(step)
        rows = slice(index * len(inputs) // ranks, (index + 1) * len(inputs) // ranks)
        state, metrics = train_step(state, Batch(inputs[rows], targets[rows]))
        losses.append(metrics["loss"])
    inputs, targets = batches(steps)
    rows = slice(index * len(inputs) // ranks, (index + 1) * len(inputs) // ranks)
    losses.append(evaluate(plan, applied, [Batch(inputs[rows], targets[rows])]).loss)
    params = {fqn: full_tensor(p.detach()) for fqn, p in applied.named_parameters()}
    return losses, params, contract_for(plan).tolerance


def test_context_parallel_matches_a_plain_pytorch_loop() -> None:
    """Losses and parameters after 3 SGD steps on dp 2 x cp 2, and the validation loss after
    them (``mt.train.evaluate``), against one process's ordinary loop, within the plan's
    contract (losses relatively; each parameter within lr · tolerance · max |grad| per step)."""
    ref_losses, ref = _plain_loop("hf_llama", 3)
    for losses, params, tolerance in get_pool(4).run(_context_run, "hf_llama", 3):
        for loss, ref_loss in zip(losses, ref_losses, strict=True):
            assert abs(loss - ref_loss) <= tolerance * abs(ref_loss), (loss, ref_loss)
        for fqn, value in params.items():
            error = float((value - ref[fqn]).abs().max())
            assert error <= tolerance * float(ref[f"bound.{fqn}"]) + 1e-7, (fqn, error)


def _own_loop(name: str, steps: int) -> tuple[list[float], dict[str, torch.Tensor], float]:
    """On each of 4 ranks: dp 2 x cp 2, the one-device loop as it is, with ``mt.shard_batch``
    before the forward: the mean token loss of this rank's chunks, backward, SGD. Every rank
    holds as many tokens, so the mean over dp x cp of their mean gradients is one device's."""
    torch.manual_seed(0)
    model = MODELS[name]()
    plan = mt.plan(model, mt.make_mesh(DP2_CP2), rules(), seq_len=SEQ)
    applied = mt.apply(plan, model)
    optimizer = torch.optim.SGD(applied.parameters(), lr=LR)
    index, ranks = data_parallel_rank(plan)
    losses = []
    for step in range(steps):
        inputs, targets = batches(step)
        rows = slice(index * len(inputs) // ranks, (index + 1) * len(inputs) // ranks)
        inputs, targets = mt.shard_batch(plan, inputs[rows], targets[rows])
        loss = F.cross_entropy(applied(inputs).logits.flatten(0, 1), targets.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach() / torch.distributed.get_world_size()  # every rank's share alike
        torch.distributed.all_reduce(mean)
        losses.append(float(mean))
    params = {fqn: full_tensor(p.detach()) for fqn, p in applied.named_parameters()}
    return losses, params, contract_for(plan).tolerance


def test_a_users_own_loop_with_shard_batch_matches_a_plain_pytorch_loop() -> None:
    """The same plain loop on dp 2 x cp 2 (``mt.shard_batch`` its one addition): losses and
    parameters after 2 SGD steps within the plan's contract, as above."""
    ref_losses, ref = _plain_loop("hf_llama", 2)
    for losses, params, tolerance in get_pool(4).run(_own_loop, "hf_llama", 2):
        for loss, ref_loss in zip(losses, ref_losses[:2], strict=True):
            assert abs(loss - ref_loss) <= tolerance * abs(ref_loss), (loss, ref_loss)
        for fqn, value in params.items():
            error = float((value - ref[fqn]).abs().max())
            assert error <= tolerance * float(ref[f"bound.{fqn}"]) + 1e-7, (fqn, error)


# ----------------------------------------------------------------------------- second tier


@pytest.mark.extended
@pytest.mark.parametrize("name", ["llama", "hf_llama", "qwen2", "mistral", "moe"])
def test_every_family_trains_like_one_device_on_cp4(name: str) -> None:
    _equivalent(name, {"cp": 4})


@pytest.mark.extended
@pytest.mark.parametrize("name", ["llama", "hf_llama", "qwen2", "mistral"])
def test_bf16_trains_like_one_device_on_dp2_cp2(name: str) -> None:
    _equivalent(name, DP2_CP2, optimizer="sgd", precision="bf16")


@pytest.mark.extended
@pytest.mark.parametrize(
    ("name", "options"),
    [
        ("llama", {"activation_checkpointing": "full"}),
        ("mistral", {"activation_checkpointing": "full", "context_method": "allgather"}),
        ("qwen2", {"zero": 0}),
        ("llama", {"zero": 1, "context_balance": "contiguous"}),
        ("hf_llama", {"zero": 2}),
    ],
)
def test_compositions_train_like_one_device(name: str, options: dict[str, Any]) -> None:
    _equivalent(name, DP2_CP2, **options)


@pytest.mark.extended
@pytest.mark.parametrize("name", ["llama", "mistral"])
def test_tensor_and_sequence_parallel_compose_on_cp2_tp2(name: str) -> None:
    report = assert_equivalent(
        MODELS[name],
        {"cp": 2, "tp": 2},
        {"rules": tp_rules(name), "seq_len": SEQ},
        batches=batches,
        steps=2,
        optimizer="adamw",
    )
    assert report.passed and "sequence-parallel" in report.contract.describe()


@pytest.mark.extended
@pytest.mark.parametrize(("name", "schedule"), [("llama", "1F1B"), ("hf_llama", "GPipe")])
def test_pipelines_compose_on_pp2_cp2(name: str, schedule: str) -> None:
    pipeline = mt.Pipeline(axis="pp", schedule=schedule, microbatches=2)
    _equivalent(name, {"pp": 2, "cp": 2}, pipeline=pipeline)


def _tail_off_by_one(seq_len: int, cp: int, rank: int, balance: str) -> torch.Tensor:
    positions = chunk_positions(seq_len, cp, rank, balance)  # type: ignore[arg-type]
    half = len(positions) // 2
    return torch.cat([positions[:half], positions[half:] + 1])


@contextlib.contextmanager
def tail_chunk_positions_off_by_one() -> Iterator[None]:
    """Each rank's second (tail) chunk believes its tokens one position later."""
    with mock.patch("meshtrain.lower.context.parallel._positions", _tail_off_by_one):
        yield


def _tail_first(seq_len: int, cp: int, rank: int, balance: str) -> torch.Tensor:
    positions = chunk_positions(seq_len, cp, rank, balance)  # type: ignore[arg-type]
    half = len(positions) // 2
    return torch.cat([positions[half:], positions[:half]])


@contextlib.contextmanager
def chunks_in_the_wrong_order() -> Iterator[None]:
    """The causal mask and rotary tables take each rank's two chunks tail first, while its
    tokens are head first."""
    with mock.patch("meshtrain.lower.context.parallel._positions", _tail_first):
        yield


@pytest.mark.extended
@pytest.mark.parametrize("fault", [tail_chunk_positions_off_by_one, chunks_in_the_wrong_order])
def test_planted_position_faults_are_caught(fault: Any) -> None:
    with pytest.raises(mt.EquivalenceError):
        assert_equivalent(
            MODELS["llama"],
            DP2_CP2,
            {"rules": rules(), "seq_len": SEQ},
            batches=batches,
            steps=1,
            optimizer="adamw",
            rank_context=fault,
        )


# ----------------------------------------------------------------------------- resume


def _trained_and_saved(directory: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = MODELS["hf_llama"]()
    plan = mt.plan(model, mt.make_mesh(DP2_CP2), rules(), seq_len=SEQ)
    applied = mt.apply(plan, model)
    params = dict(applied.named_parameters())
    optimizer = torch.optim.AdamW(list(params.values()), lr=1e-3)
    train_step = make_train_step(plan, summed_cross_entropy, optimizer)
    index, ranks = data_parallel_rank(plan)
    inputs, targets = batches(0)
    rows = slice(index * len(inputs) // ranks, (index + 1) * len(inputs) // ranks)
    train_step(TrainState.create(applied, optimizer), Batch(inputs[rows], targets[rows]))
    Checkpointer(CheckpointConfig(directory)).save(1, params, optimizer, {"step": 1})
    return _full(params, optimizer)


def _loaded_under_dp4(path: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(7)  # other weights: everything must come from the checkpoint
    model = MODELS["hf_llama"]()
    plan = mt.plan(model, mt.make_mesh(dp=4), mt.Rules({".*": mt.P()}, fsdp="dp"))
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
def test_a_checkpoint_saved_under_cp2_resumes_under_dp4(tmp_path: Path) -> None:
    saved = get_pool(4).run(_trained_and_saved, str(tmp_path))[0]
    loaded = get_pool(4).run(_loaded_under_dp4, str(tmp_path / "step_00000001"))[0]
    assert sorted(loaded) == sorted(saved) and any(k.endswith("exp_avg_sq") for k in saved)
    for key, value in saved.items():
        assert torch.equal(loaded[key], value), key
