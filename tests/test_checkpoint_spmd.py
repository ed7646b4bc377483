"""Distributed checkpoints on real gloo ranks: exact restoration under another mesh (dp, tp and
pp changed), atomic saves when a rank fails mid-write, async saves, and planning errors raised
identically on every rank (tier 2).

Every comparison is bit for bit: a checkpoint moves bytes, it does no arithmetic.
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import full, mesh_for, world_size
from torch.distributed.checkpoint import FileSystemWriter

import meshtrain as mt
from meshtrain import CheckpointError
from meshtrain.models import LlamaConfig, build_llama, default_rules
from meshtrain.testing.runner import SPMDTaskError, get_pool
from meshtrain.train import Batch, forward_backward
from meshtrain.train.checkpoint import (
    CheckpointConfig,
    Checkpointer,
    find_resume_point,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
)

pytestmark = pytest.mark.spmd

Axes = tuple[tuple[str, int], ...]
LR = 1e-3
WEIGHT_DECAY = 0.1
FSDP_TP: Axes = (("dp", 2), ("tp", 2))
PP_DP: Axes = (("pp", 2), ("dp", 2))


def _build(axes: Axes, *, seed: int, n_layers: int = 2) -> tuple[mt.Plan, Any]:
    """The debug Llama planned on ``axes`` (zero 3 over dp, TP over tp, 1F1B over pp)."""
    shape = dict(axes)
    rules = default_rules(tp="tp" if "tp" in shape else None, fsdp="dp" if "dp" in shape else None)
    model = build_llama(LlamaConfig.preset("debug", n_layers=n_layers), seed=seed)
    pipeline = mt.Pipeline(schedule="1F1B", microbatches=2) if "pp" in shape else None
    plan = mt.plan(model, mesh_for(axes), rules, zero=3, pipeline=pipeline)
    return plan, mt.apply(plan, model)


def _train_step(plan: mt.Plan, applied: Any, optimizer: torch.optim.Optimizer, seed: int) -> None:
    """One AdamW step on this data-parallel rank's slice of a seeded batch."""
    coords = plan.mesh.coordinates(dist.get_rank())
    dp_size, dp_index = plan.mesh.shape.get("dp", 1), coords.get("dp", 0)
    tokens = torch.randint(0, 256, (2 * dp_size, 17), generator=torch.Generator().manual_seed(seed))
    mine = tokens[2 * dp_index : 2 * dp_index + 2]
    if plan.pipeline is not None:
        forward_backward(plan, applied, Batch(mine[:, :-1], mine[:, 1:]))
    else:
        with mt.micro_batch(plan, applied, last=True), mt.loss_parallel(plan):
            logits = applied(mine[:, :-1])
            F.cross_entropy(logits.flatten(0, 1), mine[:, 1:].flatten()).backward()
    optimizer.step()
    optimizer.zero_grad()


def _snapshot(params: dict[str, torch.Tensor], optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Full (global) copies of every parameter and optimizer state this rank holds."""
    values: dict[str, Any] = {}
    for fqn, param in params.items():
        values[f"model.{fqn}"] = full(param.detach()).clone()
        for key, state in optimizer.state[param].items():
            values[f"optim.{fqn}.{key}"] = full(state).clone()
    return values


def _adamw(params: dict[str, torch.Tensor], lr: float = LR) -> torch.optim.AdamW:
    return torch.optim.AdamW(list(params.values()), lr=lr, weight_decay=WEIGHT_DECAY)


def save_trained(axes: Axes, directory: str) -> dict[str, Any]:
    plan, applied = _build(axes, seed=0)
    params = dict(applied.named_parameters())
    optimizer = _adamw(params)
    _train_step(plan, applied, optimizer, seed=1)
    Checkpointer(CheckpointConfig(directory)).save(1, params, optimizer, {"step": 1, "note": "x"})
    return _snapshot(params, optimizer)


def load_fresh(axes: Axes, path: str) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """A differently initialised model and a fresh optimizer with other hyper-parameters, loaded."""
    _, applied = _build(axes, seed=7)
    params = dict(applied.named_parameters())
    optimizer = torch.optim.AdamW(list(params.values()), lr=0.5, weight_decay=0.0)
    extra = load_checkpoint(path, params, optimizer)
    group = {key: optimizer.param_groups[0][key] for key in ("lr", "weight_decay", "betas")}
    return _snapshot(params, optimizer), extra, group


def _union(snapshots: list[dict[str, Any]]) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for snapshot in snapshots:
        for key, value in snapshot.items():
            if key in merged:  # replicated across ranks: every copy must agree
                assert torch.equal(merged[key], value), key
            merged[key] = value
    return merged


def _assert_identical(loaded: dict[str, Any], saved: dict[str, Any]) -> None:
    assert sorted(loaded) == sorted(saved)
    assert any(key.endswith(".exp_avg_sq") for key in saved)
    for key, value in saved.items():
        assert loaded[key].dtype == value.dtype, key
        assert torch.equal(loaded[key], value), key


@pytest.fixture(scope="module")
def fsdp_tp_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    directory = tmp_path_factory.mktemp("fsdp_tp")
    saved = _union(get_pool(4).run(save_trained, FSDP_TP, str(directory), _timeout_s=120))
    path = latest_checkpoint(directory)
    assert path is not None and path.name == "step_00000001"
    return path, saved


@pytest.mark.parametrize(
    "axes",
    [(("tp", 2),), (("dp", 2),), (("pp", 2),), PP_DP, FSDP_TP],
    ids=["tp2", "dp2", "pp2", "pp2xdp2", "same-mesh"],
)
def test_fsdp_tp_checkpoint_restores_exactly_under_another_mesh(
    fsdp_tp_checkpoint: tuple[Path, dict[str, Any]], axes: Axes
) -> None:
    path, saved = fsdp_tp_checkpoint
    results = get_pool(world_size(axes)).run(load_fresh, axes, str(path), _timeout_s=120)
    _assert_identical(_union([snapshot for snapshot, _, _ in results]), saved)
    for _, extra, group in results:
        assert extra == {"step": 1, "note": "x"}
        assert group == {"lr": LR, "weight_decay": WEIGHT_DECAY, "betas": (0.9, 0.999)}


def test_pipelined_checkpoint_restores_exactly_without_a_pipeline(tmp_path: Path) -> None:
    """Saved with pp 2 × dp 2 (each rank holds one stage's FQNs), loaded under tp 2 alone."""
    saved = _union(get_pool(4).run(save_trained, PP_DP, str(tmp_path), _timeout_s=120))
    path = latest_checkpoint(tmp_path)
    assert path is not None
    results = get_pool(2).run(load_fresh, (("tp", 2),), str(path), _timeout_s=120)
    _assert_identical(_union([snapshot for snapshot, _, _ in results]), saved)


def save_with_a_failing_rank(directory: str) -> dict[str, Any]:
    """Step 1 saves; in step 2 rank 1's writer raises after writing its data; step 3 saves."""
    plan, applied = _build((("dp", 2),), seed=0)
    params = dict(applied.named_parameters())
    optimizer = _adamw(params)
    _train_step(plan, applied, optimizer, seed=1)
    checkpointer = Checkpointer(CheckpointConfig(directory, keep_last=0))
    checkpointer.save(1, params, optimizer, {"step": 1})
    original = FileSystemWriter.write_data

    def write_then_fail(self: FileSystemWriter, *args: Any, **kwargs: Any) -> Any:
        original(self, *args, **kwargs).wait()
        raise OSError("disk full (injected after writing)")

    error = None
    if dist.get_rank() == 1:
        FileSystemWriter.write_data = write_then_fail  # type: ignore[method-assign]
    try:
        checkpointer.save(2, params, optimizer, {"step": 2})
    except CheckpointError as err:
        error = str(err)
    finally:
        FileSystemWriter.write_data = original  # type: ignore[method-assign]
    latest = latest_checkpoint(directory)
    after_failure = sorted(path.name for path in Path(directory).iterdir())
    dist.barrier()
    checkpointer.save(3, params, optimizer, {"step": 3})
    return {
        "error": error,
        "latest": latest.name if latest else None,
        "after_failure": after_failure,
        "after_next": [path.name for path in list_checkpoints(directory)],
        "extra": load_checkpoint(Path(directory) / "step_00000003", params, optimizer),
    }


def test_a_rank_failing_mid_save_publishes_nothing(tmp_path: Path) -> None:
    results = get_pool(2).run(save_with_a_failing_rank, str(tmp_path), _timeout_s=60)
    for result in results:
        assert result["error"] is not None, "every rank must learn that the save failed"
        assert "checkpoint step 2 was not saved" in result["error"]
        assert "step_00000001" in result["error"]
        assert "disk full" in result["error"]
        assert result["latest"] == "step_00000001"
        assert result["after_failure"] == ["step_00000001"]  # no step 2, no leftover
        assert result["after_next"] == ["step_00000001", "step_00000003"]
        assert result["extra"] == {"step": 3}


def save_then_die_mid_write(directory: str, async_save: bool) -> None:
    """Step 1 saves; during step 2's save rank 1 is SIGKILLed after writing part of its data."""
    plan, applied = _build((("dp", 2),), seed=0)
    params = dict(applied.named_parameters())
    optimizer = _adamw(params)
    _train_step(plan, applied, optimizer, seed=1)
    checkpointer = Checkpointer(CheckpointConfig(directory, keep_last=0, async_save=async_save))
    checkpointer.save(1, params, optimizer, {"step": 1})
    checkpointer.wait()
    original = FileSystemWriter.write_data

    def write_then_die(self: FileSystemWriter, plan: Any, planner: Any) -> Any:
        future = original(self, plan, planner)
        future.wait()
        (payload,) = Path(self.path).glob("__1_*.distcp")
        with open(payload, "r+b") as file:  # a torn write: the file cut in the middle
            file.truncate(payload.stat().st_size // 2)
        os.kill(os.getpid(), signal.SIGKILL)
        return future

    if dist.get_rank() == 1:
        FileSystemWriter.write_data = write_then_die  # type: ignore[method-assign]
    checkpointer.save(2, params, optimizer, {"step": 2})
    checkpointer.wait()


def resume_after_the_kill(directory: str) -> dict[str, Any]:
    _, applied = _build((("dp", 2),), seed=7)
    params = dict(applied.named_parameters())
    optimizer = _adamw(params)
    point = find_resume_point(directory)
    extra = load_checkpoint(point.checkpoint, params, optimizer) if point.checkpoint else None
    leftovers = sorted(path.name for path in Path(directory).iterdir())
    Checkpointer(CheckpointConfig(directory, keep_last=0)).save(2, params, optimizer, {"step": 2})
    return {
        "resumed": point.checkpoint.name if point.checkpoint else None,
        "passed_over": [(s.path.name.split(".tmp-")[0], s.status) for s in point.passed_over],
        "extra": extra,
        "leftovers": leftovers,
        "after_next_save": sorted(path.name for path in Path(directory).iterdir()),
    }


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_rank_killed_mid_save_leaves_no_torn_checkpoint(tmp_path: Path, async_save: bool) -> None:
    """A real SIGKILL of one rank while its shard is half written: the other rank stops with the
    lost peer, the half-written step is never listed, the resume takes step 1 (saying it passed
    over an unfinished save), and the next save of step 2 clears the leftover."""
    pool = get_pool(2)
    with pytest.raises(SPMDTaskError) as died:
        pool.run(save_then_die_mid_write, str(tmp_path), async_save, _timeout_s=120)
    assert 1 in died.value.failures
    assert [path.name for path in list_checkpoints(tmp_path)] == ["step_00000001"]
    (result, _) = pool.run(resume_after_the_kill, str(tmp_path), _timeout_s=120)
    assert result["resumed"] == "step_00000001" and result["extra"] == {"step": 1}
    assert result["passed_over"] == [("step_00000002", "incomplete")]
    assert [name for name in result["leftovers"] if name.startswith("step_00000002")]
    assert result["after_next_save"] == ["step_00000001", "step_00000002"]


def resume_from_a_local_disk(root: str) -> str:
    """Each rank looks in a directory of its own, as ranks on nodes without a shared disk would."""
    directory = Path(root) / f"node{dist.get_rank()}"
    try:
        find_resume_point(directory)
    except CheckpointError as err:
        return err.message
    return "agreed"


def test_ranks_that_see_different_checkpoints_refuse_alike_instead_of_hanging(
    tmp_path: Path,
) -> None:
    Checkpointer(CheckpointConfig(tmp_path / "node0")).save(3, {"w": torch.ones(2)}, None, {})
    messages = get_pool(2).run(resume_from_a_local_disk, str(tmp_path), _timeout_s=60)
    views = [message.partition("' (")[2] for message in messages]  # past each rank's own path
    assert views[0] == views[1] and views[0].startswith("rank 0: step_00000003; rank 1: none")
    assert "on a filesystem every rank shares" in messages[0]


def save_asynchronously(directory: str) -> dict[str, Any]:
    """Two async saves; step 1's writes are held back until training has changed every
    parameter in place, so step 1 can only hold the right values if save() copied them."""
    plan, applied = _build((("dp", 2),), seed=0)
    params = dict(applied.named_parameters())
    optimizer = _adamw(params)
    checkpointer = Checkpointer(CheckpointConfig(directory, keep_last=0, async_save=True))
    gate, original = threading.Event(), FileSystemWriter.write_data

    def write_when_allowed(self: FileSystemWriter, *args: Any, **kwargs: Any) -> Any:
        assert gate.wait(timeout=30), "the training thread never let the write start"
        return original(self, *args, **kwargs)

    FileSystemWriter.write_data = write_when_allowed  # type: ignore[method-assign]
    snapshots, listed = [], []
    try:
        for step in (1, 2):
            _train_step(plan, applied, optimizer, seed=step)
            if step == 2:  # parameters have now changed since step 1 was staged
                gate.set()
            snapshots.append(_snapshot(params, optimizer))
            checkpointer.save(step, params, optimizer, {"step": step})
            listed.append([path.name for path in list_checkpoints(directory)])
        checkpointer.wait()
    finally:
        FileSystemWriter.write_data = original  # type: ignore[method-assign]
    listed.append([path.name for path in list_checkpoints(directory)])
    loaded = []
    for step in (1, 2):
        _, fresh = _build((("dp", 2),), seed=7)
        fresh_params = dict(fresh.named_parameters())
        fresh_optimizer = _adamw(fresh_params)
        load_checkpoint(Path(directory) / f"step_{step:08d}", fresh_params, fresh_optimizer)
        loaded.append(_snapshot(fresh_params, fresh_optimizer))
    return {"snapshots": snapshots, "loaded": loaded, "listed": listed}


def test_async_saves_publish_in_order_and_restore_exactly(tmp_path: Path) -> None:
    results = get_pool(2).run(save_asynchronously, str(tmp_path), _timeout_s=90)
    for result in results:
        # A save is published by the next save() or wait(), never before.
        assert result["listed"] == [[], ["step_00000001"], ["step_00000001", "step_00000002"]]
    for step in (0, 1):
        saved = _union([result["snapshots"][step] for result in results])
        _assert_identical(_union([result["loaded"][step] for result in results]), saved)
    assert not torch.equal(
        results[0]["snapshots"][0]["model.output.weight"],
        results[0]["snapshots"][1]["model.output.weight"],
    ), "training between the saves must change what the second one holds"


def load_into_deeper_pipeline(path: str) -> str:
    _, applied = _build((("pp", 2),), seed=0, n_layers=4)
    try:
        load_checkpoint(path, dict(applied.named_parameters()), None)
    except CheckpointError as err:
        return str(err)
    return "loaded"


def test_a_mismatch_on_one_stage_raises_the_same_error_on_every_rank(tmp_path: Path) -> None:
    """The checkpoint has 2 layers; under pp 2 only the second stage lacks layers 2 and 3, yet
    both ranks raise the same error (and neither waits in a collective for the other)."""
    model = build_llama(LlamaConfig.preset("debug", n_layers=2), seed=0)
    Checkpointer(CheckpointConfig(tmp_path)).save(5, dict(model.named_parameters()), None, {})
    messages = get_pool(2).run(
        load_into_deeper_pipeline, str(tmp_path / "step_00000005"), _timeout_s=60
    )
    assert messages[0] == messages[1] != "loaded"
    assert "parameters missing from the checkpoint" in messages[0]
    assert "'model.layers.2.attention.wq.weight'" in messages[0]
    assert "(rank 1)" in messages[0]
