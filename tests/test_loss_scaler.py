"""The fp16 loss scaler under DeepSpeed's settings: the scale it uses at each step, over a run of
overflows and finite steps, equals DeepSpeed's ``DynamicLossScaler.update_scale`` (written out
below as the reference, with its initial scale, window, hysteresis and floor); a static scale
never moves and overflowing steps are still skipped; the recipe's [train] keys build it."""

from __future__ import annotations

import math
import random
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from meshtrain.recipes import load_recipe
from meshtrain.recipes.run import loss_scaler
from meshtrain.train.scaler import LossScaler


class DeepSpeedDynamicScaler:
    """deepspeed/runtime/fp16/loss_scaler.py, ``DynamicLossScaler.update_scale`` (scale factor
    2, consecutive_hysteresis off), without its error at the floor."""

    def __init__(self, init_scale: float, window: int, hysteresis: int, min_scale: float) -> None:
        self.cur_scale, self.window, self.min_scale = init_scale, window, min_scale
        self.delayed_shift = self.cur_hysteresis = hysteresis
        self.cur_iter, self.last_overflow_iter = 0, -1

    def update_scale(self, overflow: bool) -> None:
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                self.cur_scale = max(self.cur_scale / 2, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        elif (self.cur_iter - self.last_overflow_iter) % self.window == 0:
            self.cur_hysteresis = self.delayed_shift
            self.cur_scale *= 2
        self.cur_iter += 1


def _step(scaler: LossScaler, overflow: bool) -> bool:
    """One step's unscale and update with a gradient that is finite or not; True if it steps."""
    param = torch.nn.Parameter(torch.ones(3))
    param.grad = torch.full((3,), math.inf if overflow else scaler.scale_value)
    stepped = scaler.unscale_([param])
    if stepped:
        assert param.grad.tolist() == [1.0, 1.0, 1.0]  # divided by the scale in place
    scaler.update()
    return stepped


@pytest.mark.parametrize(
    ("window", "hysteresis", "min_scale"), [(3, 1, 0.0), (4, 2, 1024.0), (2, 3, 4096.0)]
)
def test_the_dynamic_scale_follows_deepspeed_step_by_step(
    window: int, hysteresis: int, min_scale: float
) -> None:
    rng = random.Random(window * 10 + hysteresis)
    overflows = [rng.random() < 0.35 for _ in range(300)]
    ours = LossScaler(2.0**14, growth_interval=window, hysteresis=hysteresis, min_scale=min_scale)
    reference = DeepSpeedDynamicScaler(2.0**14, window, hysteresis, min_scale)
    scales = []
    for overflow in overflows:
        assert ours.scale_value == reference.cur_scale
        assert _step(ours, overflow) is not overflow  # every overflow is skipped
        reference.update_scale(overflow)
        scales.append(ours.scale_value)
    assert ours.scale_value == reference.cur_scale
    assert ours.skipped_steps == sum(overflows)
    assert len(set(scales)) > 3 and min(scales) >= min_scale  # it moved, never below the floor


def test_hysteresis_survives_a_checkpoint() -> None:
    scaler = LossScaler(8.0, growth_interval=100, hysteresis=3)
    _step(scaler, True)
    restored = LossScaler(8.0, growth_interval=100, hysteresis=3)
    restored.load_state_dict(scaler.state_dict())
    _step(restored, True)
    assert restored.scale_value == 8.0  # two of three overflows used
    _step(restored, True)
    assert restored.scale_value == 4.0


def test_a_static_scale_never_moves_and_still_skips_overflows() -> None:
    scaler = LossScaler(128.0, growth_interval=1, dynamic=False)
    stepped = [_step(scaler, overflow) for overflow in [False, True, False, False, True]]
    assert stepped == [True, False, True, True, False]
    assert scaler.scale_value == 128.0 and scaler.skipped_steps == 2


def test_the_recipe_keys_build_the_scaler() -> None:
    fp16: Any = SimpleNamespace(options=SimpleNamespace(precision="fp16"))
    keys = [
        "train.loss_scale_window=7",
        "train.loss_scale_hysteresis=2",
        "train.min_loss_scale=2",
        "train.initial_loss_scale=512",
    ]
    scaler = loss_scaler(load_recipe("debug", keys).train, fp16)
    assert scaler is not None and scaler.dynamic
    assert (scaler.scale_value, scaler.growth_interval, scaler.hysteresis, scaler.min_scale) == (
        512.0,
        7,
        2,
        2.0,
    )
    static = loss_scaler(load_recipe("debug", ["train.loss_scale=64"]).train, fp16)
    assert static is not None and not static.dynamic and static.scale_value == 64.0
    fp32: Any = SimpleNamespace(options=SimpleNamespace(precision="fp32"))
    assert loss_scaler(load_recipe("debug", keys).train, fp32) is None


class _NoRefill(LossScaler):
    """A planted fault: the hysteresis count is never refilled when the scale grows."""

    def update(self) -> None:
        left = self.overflows_left
        super().update()
        self.overflows_left = min(self.overflows_left, left)


def test_a_planted_missing_refill_departs_from_deepspeed() -> None:
    rng = random.Random(7)
    overflows = [rng.random() < 0.35 for _ in range(300)]
    planted = _NoRefill(2.0**14, growth_interval=2, hysteresis=3)
    reference = DeepSpeedDynamicScaler(2.0**14, 2, 3, 0.0)
    departed = False
    for overflow in overflows:
        departed |= planted.scale_value != reference.cur_scale
        _step(planted, overflow)
        reference.update_scale(overflow)
    assert departed
