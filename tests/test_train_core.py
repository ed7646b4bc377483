"""In-process properties of the train step's pure parts: the schedule, the linear scaling rule,
``TrainState`` as a pytree, and the train step's argument checks."""

from __future__ import annotations

import itertools
import math

import optree
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import meshtrain as mt
from meshtrain import TrainingError
from meshtrain.errors import ConfigError
from meshtrain.train import make_train_step, summed_cross_entropy
from meshtrain.train.batch import DataPosition
from meshtrain.train.schedule import WarmupCosine, linear_scaling
from meshtrain.train.state import NAMESPACE, TrainState


@st.composite
def schedules(draw: st.DrawFn) -> WarmupCosine:
    total = draw(st.integers(1, 10_000))
    peak = draw(st.floats(1e-6, 1.0))
    return WarmupCosine(
        peak_lr=peak,
        warmup_steps=draw(st.integers(0, total)),
        total_steps=total,
        min_lr=draw(st.floats(0.0, 1.0)) * peak,
    )


@given(schedules(), st.integers(0, 20_000))
def test_schedule_stays_between_min_and_peak(schedule: WarmupCosine, step: int) -> None:
    lr = schedule(step)
    low = min(schedule.min_lr, schedule.peak_lr / max(schedule.warmup_steps, 1))
    assert low * (1 - 1e-12) <= lr <= schedule.peak_lr * (1 + 1e-12)


@given(schedules())
def test_schedule_rises_through_warmup_then_never_rises(schedule: WarmupCosine) -> None:
    lrs = [schedule(step) for step in range(schedule.total_steps + 2)]
    warm = schedule.warmup_steps
    assert all(a < b for a, b in itertools.pairwise(lrs[:warm]))
    if warm:
        assert math.isclose(lrs[warm - 1], schedule.peak_lr)
    assert all(b <= a * (1 + 1e-12) for a, b in itertools.pairwise(lrs[warm:]))
    if schedule.total_steps > warm:
        assert math.isclose(lrs[warm], schedule.peak_lr)
        assert lrs[schedule.total_steps] == schedule.min_lr


def test_a_run_shorter_than_its_warmup_ramps_the_whole_way() -> None:
    """A smoke test of a recipe (``--set train.steps=5`` under a warmup of 10) was refused."""
    schedule = WarmupCosine(1e-3, warmup_steps=20, total_steps=10)
    lrs = [schedule(step) for step in range(12)]
    assert lrs[:10] == [1e-3 * (step + 1) / 20 for step in range(10)]
    assert lrs[10] == lrs[11] == 1e-3  # past the run: the peak (never used by a run)


def test_schedule_and_scaling_refuse_impossible_settings() -> None:
    with pytest.raises(ConfigError, match=r"min_lr=0.1 must be in \[0, peak_lr=0.001\]"):
        WarmupCosine(1e-3, total_steps=10, min_lr=0.1)
    with pytest.raises(ConfigError, match="base_batch=0"):
        linear_scaling(1e-3, base_batch=0, global_batch=8)
    assert linear_scaling(1e-3, 256, 512) == 2e-3


def test_train_state_is_a_pytree_of_its_tensors() -> None:
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    state = TrainState.create(model, optimizer, step=7, data=DataPosition(1, 3))
    leaves, spec = optree.tree_flatten(state, namespace=NAMESPACE)
    # 2 params + 2 × (step, exp_avg, exp_avg_sq) optimizer tensors + step + rng + position
    assert len(leaves) == 2 + 6 + 3
    rebuilt = optree.tree_unflatten(spec, leaves)
    assert rebuilt.model is model and rebuilt.optimizer is optimizer and rebuilt.step == 7
    doubled = optree.tree_map(
        lambda x: x * 2 if isinstance(x, torch.Tensor) and x.is_floating_point() else x,
        state,
        namespace=NAMESPACE,
    )
    assert torch.equal(doubled.params["weight"], 2 * model.weight)
    assert doubled.opt_state["weight"]["exp_avg"].shape == (2, 3)
    assert doubled.data == DataPosition(1, 3)


def test_train_step_arguments_are_checked() -> None:
    model = torch.nn.Linear(2, 2)
    mesh = mt.make_mesh(dp=1, world_size=1, abstract=True)
    plan = mt.plan(model, mesh, mt.Rules({r".*": mt.P()}, fsdp="dp"))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TrainingError, match="on_nonfinite='ignore' is not a policy"):
        make_train_step(plan, summed_cross_entropy, optimizer, on_nonfinite="ignore")  # type: ignore[arg-type]
    with pytest.raises(TrainingError, match=r"max_norm=0\.0 must be positive"):
        make_train_step(plan, summed_cross_entropy, optimizer, max_norm=0.0)
