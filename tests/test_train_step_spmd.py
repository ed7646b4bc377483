"""``make_train_step`` on real gloo ranks: the same numbers as a hand-written one-device loop,
gradients synchronised once per step under accumulation, a non-finite loss handled alike on every
rank, and the startup fingerprint check."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from helpers import full, mesh_for

import meshtrain as mt
from meshtrain.models import default_rules
from meshtrain.testing.comms import CollectiveCounter
from meshtrain.testing.contract import contract_for
from meshtrain.testing.runner import SPMDTaskError, get_pool
from meshtrain.testing.strategies import DebugLlama
from meshtrain.train import make_train_step, summed_cross_entropy
from meshtrain.train.batch import Batch, DataPosition
from meshtrain.train.clip import clip_grad_norm_
from meshtrain.train.fingerprint import check_same_plan
from meshtrain.train.loss import data_parallel_rank
from meshtrain.train.schedule import WarmupCosine
from meshtrain.train.state import TrainState

pytestmark = pytest.mark.spmd

SCHEDULE = WarmupCosine(peak_lr=3e-3, warmup_steps=2, total_steps=6, min_lr=3e-4)
GLOBAL_BATCH, SEQ = 8, 8


def _tokens(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    data = torch.randint(
        0, 256, (GLOBAL_BATCH, SEQ + 1), generator=torch.Generator().manual_seed(step)
    )
    return data[:, :-1], data[:, 1:]


def _reference_steps(
    model: torch.nn.Module, steps: int, max_norm: float
) -> list[tuple[float, float]]:
    """The hand-written one-device loop: mean loss over the global batch, clip, AdamW, schedule."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=SCHEDULE(0), weight_decay=0.1)
    out = []
    for step in range(steps):
        inputs, targets = _tokens(step)
        for group in optimizer.param_groups:
            group["lr"] = SCHEDULE(step)
        loss = summed_cross_entropy(model(inputs), targets) / targets.numel()
        loss.backward()
        norm = clip_grad_norm_(list(model.parameters()), max_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        out.append((float(loss.detach()), float(norm)))
    return out


def train_and_compare(
    axes: tuple[tuple[str, int], ...], options: dict, steps: int, max_norm: float
) -> dict:
    """Runs on every rank: ``steps`` train steps of the plan next to the one-device loop."""
    torch.manual_seed(0)
    model = DebugLlama(2)()
    reference = copy.deepcopy(model)
    plan = mt.plan(model, mesh_for(axes), default_rules(), **options)
    applied = mt.apply(plan, model)
    optimizer = torch.optim.AdamW(applied.parameters(), lr=1.0, weight_decay=0.1)
    train_step = make_train_step(plan, summed_cross_entropy, optimizer, SCHEDULE, max_norm=max_norm)
    state = TrainState.create(applied, optimizer)
    index, size = data_parallel_rank(plan)
    metrics = []
    for step in range(steps):
        inputs, targets = _tokens(step)
        mine = slice(index * GLOBAL_BATCH // size, (index + 1) * GLOBAL_BATCH // size)
        batch = Batch(inputs[mine], targets[mine], DataPosition(0, step + 1))
        state, step_metrics = train_step(state, batch)
        metrics.append(step_metrics)
    params = {fqn: full(p).detach() for fqn, p in state.params.items()}
    ref_params = dict(reference.named_parameters())
    expected = _reference_steps(reference, steps, max_norm)
    return {
        "metrics": metrics,
        "expected": expected,
        "step": state.step,
        "position": state.data,
        "max_param_diff": max(
            float((params[f] - ref_params[f].detach()).abs().max()) for f in params
        ),
        "contract": contract_for(plan),
    }


def test_one_rank_train_step_is_bitwise_the_hand_written_loop() -> None:
    """Nothing is reordered on one rank, so schedule, clipping (active: max_norm 0.05) and AdamW
    give exactly the hand-written loop's numbers."""
    (result,) = get_pool(1).run(train_and_compare, (("dp", 1), ("tp", 1)), {}, 4, 0.05)
    assert result["contract"].level == "bitwise"
    got = [(m["loss"], m["grad_norm"]) for m in result["metrics"]]
    assert got == result["expected"]
    assert result["max_param_diff"] == 0.0
    assert [m["lr"] for m in result["metrics"]] == [SCHEDULE(s) for s in range(4)]
    assert all(m["grad_norm"] > 0.05 for m in result["metrics"])  # clipping was active
    assert result["step"] == 4 and result["position"] == DataPosition(0, 4)


@pytest.mark.parametrize(
    ("axes", "options"),
    [
        ((("dp", 2), ("tp", 2)), {"zero": 1, "microbatches": 2}),
        (
            (("pp", 2), ("dp", 1), ("tp", 1)),
            {"pipeline": mt.Pipeline(schedule="1F1B", microbatches=2)},
        ),
    ],
    ids=["fsdp-tp-accumulation", "pipeline-1f1b"],
)
def test_distributed_train_step_matches_one_device(axes: tuple, options: dict) -> None:
    """The first step's loss and global gradient norm are within the plan's contract of the
    hand-written loop on one device (later steps depend on AdamW's amplification of rounding
    noise, which the equivalence harness bounds step by step); every rank reports the same
    global metrics and the global token count."""
    world = 1
    for _, size in axes:
        world *= size
    results = get_pool(world).run(train_and_compare, axes, options, 2, 1.0)
    tolerance = results[0]["contract"].tolerance
    (loss, norm), _ = results[0]["expected"]
    first = results[0]["metrics"][0]
    assert abs(first["loss"] - loss) <= tolerance * abs(loss)
    assert abs(first["grad_norm"] - norm) <= tolerance * abs(norm)
    assert first["tokens"] == GLOBAL_BATCH * SEQ
    assert all(r["metrics"] == results[0]["metrics"] for r in results)


def count_gradient_syncs(microbatches: int) -> dict:
    """Runs on every rank (dp 2, ZeRO 0): collectives of one step after a warm-up step."""
    torch.manual_seed(0)
    model = DebugLlama(2)()
    mesh = mesh_for((("dp", 2), ("tp", 1)))
    plan = mt.plan(model, mesh, default_rules(), zero=0, microbatches=microbatches)
    applied = mt.apply(plan, model)
    optimizer = torch.optim.SGD(applied.parameters(), lr=0.01)
    train_step = make_train_step(plan, summed_cross_entropy, optimizer)
    state = TrainState.create(applied, optimizer)
    inputs, targets = _tokens(0)
    batch = Batch(inputs[:4], targets[:4])
    state, _ = train_step(state, batch)
    counter = CollectiveCounter(mesh)
    with counter:
        train_step(state, batch)
    return dict(counter.counts)


def test_accumulation_synchronises_gradients_once_per_step() -> None:
    """ZeRO 0 with 4 micro-batches issues exactly the collectives of one micro-batch: gradients
    are reduced on the last micro-batch only."""
    pool = get_pool(2)
    one, four = pool.run(count_gradient_syncs, 1)[0], pool.run(count_gradient_syncs, 4)[0]
    assert one == four
    assert one[("all_reduce", "dp")] >= 1


def _poisoned_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    loss = summed_cross_entropy(logits, targets)
    return loss * float("inf") if bool((targets == 255).all()) else loss


def nonfinite_step(policy: str) -> dict:
    """Runs on every rank (dp 2): data-parallel rank 1's batch makes its loss infinite."""
    torch.manual_seed(0)
    model = DebugLlama(2)()
    plan = mt.plan(model, mesh_for((("dp", 2), ("tp", 1))), default_rules(), zero=3)
    applied = mt.apply(plan, model)
    optimizer = torch.optim.SGD(applied.parameters(), lr=0.1)
    train_step = make_train_step(plan, _poisoned_loss, optimizer, on_nonfinite=policy)  # type: ignore[arg-type]
    state = TrainState.create(applied, optimizer)
    before = {f: p.detach().clone() for f, p in state.params.items()}
    inputs, targets = _tokens(0)
    if dist.get_rank() == 1:
        targets = torch.full_like(targets, 255)
    state, metrics = train_step(state, Batch(inputs[:4], targets[:4], DataPosition(0, 1)))
    unchanged = all(torch.equal(before[f], p.detach()) for f, p in state.params.items())
    return {"metrics": metrics, "unchanged": unchanged, "step": state.step}


def test_nonfinite_loss_on_one_rank_skips_the_update_on_every_rank() -> None:
    results = get_pool(2).run(nonfinite_step, "skip")
    for result in results:
        assert result["metrics"]["skipped"] == 1.0
        assert result["unchanged"] and result["step"] == 1


def test_nonfinite_loss_stops_every_rank_with_a_training_error() -> None:
    with pytest.raises(SPMDTaskError) as info:
        get_pool(2).run(nonfinite_step, "stop", _timeout_s=60)
    assert set(info.value.failures) == {0, 1}
    assert all(
        "TrainingError" in text and "not finite" in text for text in info.value.failures.values()
    )


def fingerprint_with(lr_by_rank: dict[int, float]) -> str:
    recipe = {"train": {"lr": lr_by_rank.get(dist.get_rank(), 1e-3)}}
    return check_same_plan('{"plan": "same"}', recipe)


def test_ranks_with_different_recipes_stop_naming_the_difference() -> None:
    pool = get_pool(2)
    same = pool.run(fingerprint_with, {})
    assert same[0] == same[1]
    with pytest.raises(SPMDTaskError) as info:
        pool.run(fingerprint_with, {1: 3e-4}, _timeout_s=60)
    assert set(info.value.failures) == {0, 1}
    for text in info.value.failures.values():
        assert "ranks [1]" in text and "train.lr = 0.001 vs 0.0003" in text
