"""Learning-rate schedules: linear warmup then a cosine (or linear) decay, and the linear scaling
rule.

A schedule is a pure function of the optimizer step (steps count from 0), so it needs no state
of its own in a checkpoint: the :class:`~meshtrain.train.state.TrainState`'s step is enough.

Example:
    >>> schedule = WarmupCosine(peak_lr=1e-3, warmup_steps=10, total_steps=110, min_lr=1e-4)
    >>> schedule(0), schedule(9), round(schedule(60), 6), schedule(110)
    (0.0001, 0.001, 0.00055, 0.0001)
    >>> linear = WarmupCosine(1e-3, warmup_steps=10, total_steps=110, decay="linear")
    >>> round(linear(35), 6), round(linear(85), 6)
    (0.00075, 0.00025)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, get_args

from meshtrain.errors import ConfigError

#: How the rate falls from its peak to ``min_lr`` after warmup (``[train] decay``).
Decay = Literal["cosine", "linear"]
DECAYS: tuple[Decay, ...] = get_args(Decay)


@dataclass(frozen=True)
class WarmupCosine:
    """``peak_lr × (step + 1) / warmup_steps`` for the first ``warmup_steps`` steps, then a
    cosine from ``peak_lr`` down to ``min_lr`` at ``total_steps`` (and ``min_lr`` after it).

    ``decay = "linear"`` falls in a straight line instead (DeepSpeed's ``WarmupDecayLR``).
    ``warmup_steps = 0`` starts at the peak; ``min_lr = peak_lr`` gives a constant rate after
    warmup. A run shorter than its warmup (a smoke test of a long recipe) ramps the whole way:
    its last step has ``peak_lr × total_steps / warmup_steps``.
    """

    peak_lr: float
    warmup_steps: int = 0
    total_steps: int = 1
    min_lr: float = 0.0
    decay: Decay = "cosine"

    def __post_init__(self) -> None:
        problems = []
        if self.decay not in DECAYS:
            problems.append(f"decay={self.decay!r} must be one of {DECAYS}")
        if not self.peak_lr > 0:
            problems.append(f"peak_lr={self.peak_lr} must be positive")
        if not 0 <= self.min_lr <= self.peak_lr:
            problems.append(f"min_lr={self.min_lr} must be in [0, peak_lr={self.peak_lr}]")
        if self.warmup_steps < 0 or self.total_steps < 1:
            problems.append(
                f"warmup_steps={self.warmup_steps} must be ≥ 0 and total_steps="
                f"{self.total_steps} ≥ 1"
            )
        if problems:
            raise ConfigError(
                "WarmupCosine: " + "; ".join(problems) + ". Fix the schedule's settings "
                "(in a recipe: train.lr, train.min_lr, train.warmup_steps, train.steps, "
                "train.decay)."
            )

    def __call__(self, step: int) -> float:
        """The learning rate of optimizer step ``step`` (0-based)."""
        if step < self.warmup_steps and step < self.total_steps:
            return self.peak_lr * (step + 1) / self.warmup_steps
        decay_steps = self.total_steps - self.warmup_steps
        if decay_steps <= 0 or step >= self.total_steps:
            return self.min_lr if decay_steps > 0 else self.peak_lr
        progress = (step - self.warmup_steps) / decay_steps
        if self.decay == "linear":
            return self.min_lr + (self.peak_lr - self.min_lr) * (1.0 - progress)
        cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_lr + (self.peak_lr - self.min_lr) * cosine


def linear_scaling(base_lr: float, base_batch: int, global_batch: int) -> float:
    """The linear scaling rule (Goyal et al., 2017): scale the learning rate tuned at
    ``base_batch`` sequences per step by ``global_batch / base_batch``.

    Example:
        >>> linear_scaling(3e-4, base_batch=256, global_batch=1024)
        0.0012
    """
    if base_lr <= 0 or base_batch < 1 or global_batch < 1:
        raise ConfigError(
            f"linear_scaling(base_lr={base_lr}, base_batch={base_batch}, "
            f"global_batch={global_batch}) needs a positive rate and batch sizes ≥ 1."
        )
    return base_lr * global_batch / base_batch
