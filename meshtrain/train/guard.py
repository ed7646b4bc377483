"""The non-finite budget: how many skipped steps a run may take before it stops.

``make_train_step(on_nonfinite="skip")`` drops the update of a step whose loss or gradient norm
is not finite. Alone, that lets a ruined run (a learning rate a million times too high) skip
nearly every step and still "finish". :class:`SkipGuard` bounds it: more than
``max_consecutive`` skipped steps in a row, or more than ``max_total`` over the whole run
(resumes included), stops training with a :class:`~meshtrain.TrainingError` on every rank alike
(the skip decision is global, so every rank counts the same). It also says when a checkpoint may
be written: never right after a skipped step, so a checkpoint always holds a state whose last
update was applied. :class:`LastGood` keeps the last good checkpoint out of ``keep_last``'s reach.

Under fp16 the loss scaler skips a step whose gradients overflow while the loss is finite; that is
how it finds its scale, so such a step counts towards the consecutive budget (a scale that never
settles is divergence) but not towards the total.

Example:
    >>> guard = SkipGuard(SkipBudget(max_consecutive=2, max_total=10))
    >>> for step, loss in enumerate([2.5, float("nan"), 2.4], start=1):
    ...     guard.update(step, {"loss": loss, "grad_norm": 1.0, "skipped": float(loss != loss)})
    >>> guard.record.total, guard.record.consecutive, guard.may_checkpoint
    (1, 0, True)
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal, get_args

from meshtrain.errors import TrainingError

__all__ = ["ON_NONFINITE", "LastGood", "OnNonFinite", "SkipBudget", "SkipGuard", "SkipRecord"]

#: What a non-finite loss or gradient norm does: ``skip`` drops the step's update on every
#: rank, ``stop`` raises a :class:`~meshtrain.TrainingError` on every rank (declared here, with
#: the budget, so the recipe schema reads it without importing the train step).
OnNonFinite = Literal["skip", "stop"]
ON_NONFINITE: tuple[OnNonFinite, ...] = get_args(OnNonFinite)

#: How many of the latest skipped losses a TrainingError quotes.
_QUOTED = 5


@dataclass(frozen=True)
class SkipBudget:
    """How many skipped steps a run tolerates: ``max_consecutive`` in a row (at least 1) and
    ``max_total`` over the run (0: no bound on the total).

    Example:
        >>> SkipBudget(max_consecutive=0)
        Traceback (most recent call last):
        ...
        meshtrain.errors.TrainingError: SkipBudget.max_consecutive = 0 must be a whole number ≥ 1 (skipped steps in a row that end the run).
    """

    max_consecutive: int = 10
    max_total: int = 100

    def __post_init__(self) -> None:
        for name, least, meaning in (
            ("max_consecutive", 1, "skipped steps in a row that end the run"),
            ("max_total", 0, "skipped steps over the run that end it; 0 for no bound"),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise TrainingError(
                    f"SkipBudget.{name} = {value!r} must be a whole number ≥ {least} ({meaning})."
                )


@dataclass(frozen=True)
class SkipRecord:
    """What a run has skipped so far; saved in checkpoints so a resumed run keeps counting.

    ``consecutive``: skipped steps in a row up to the latest step. ``total``: skipped steps that
    count towards the total budget. ``last_step``: the latest step seen. ``recent``: the losses of
    the latest skipped steps (for the error message).

    Example:
        >>> SkipRecord.from_json(SkipRecord(consecutive=1, total=3, last_step=7).to_json())
        SkipRecord(consecutive=1, total=3, last_step=7, recent=())
    """

    consecutive: int = 0
    total: int = 0
    last_step: int = 0
    recent: tuple[tuple[int, float], ...] = field(default=(), compare=False)

    def to_json(self) -> dict[str, Any]:
        """The counters as checkpoint JSON (the quoted losses are not kept)."""
        return {"consecutive": self.consecutive, "total": self.total, "last_step": self.last_step}

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | None) -> SkipRecord:
        """The record a checkpoint holds (an empty one for checkpoints saved without it)."""
        if not data:
            return cls()
        return cls(int(data["consecutive"]), int(data["total"]), int(data["last_step"]))


class SkipGuard:
    """Counts skipped steps against a :class:`SkipBudget` (see the module docstring)."""

    def __init__(self, budget: SkipBudget, record: SkipRecord | None = None) -> None:
        self.budget = budget
        self.record = record or SkipRecord()

    @property
    def may_checkpoint(self) -> bool:
        """True when the latest step applied its update (a checkpoint may be written now)."""
        return self.record.consecutive == 0

    def update(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Count step ``step``'s outcome (``metrics`` from the train step: ``loss``,
        ``grad_norm``, ``skipped`` and, under fp16, ``loss_scale``); raise
        :class:`~meshtrain.TrainingError` when the budget is spent."""
        record = self.record
        if not metrics.get("skipped"):
            self.record = replace(record, consecutive=0, last_step=step)
            return
        loss = float(metrics.get("loss", math.nan))
        scaler_overflow = "loss_scale" in metrics and math.isfinite(loss)
        self.record = SkipRecord(
            consecutive=record.consecutive + 1,
            total=record.total + (0 if scaler_overflow else 1),
            last_step=step,
            recent=(*record.recent, (step, loss))[-_QUOTED:],
        )
        self._check(step)

    def _check(self, step: int) -> None:
        record, budget = self.record, self.budget
        if record.consecutive > budget.max_consecutive:
            what = (
                f"{record.consecutive} steps in a row were skipped "
                f"(max_consecutive_skips = {budget.max_consecutive})"
            )
        elif budget.max_total and record.total > budget.max_total:
            what = (
                f"{record.total} steps of this run were skipped "
                f"(max_total_skips = {budget.max_total})"
            )
        else:
            return
        losses = ", ".join(f"step {at}: {loss:.4g}" for at, loss in record.recent)
        raise TrainingError(
            f"step {step}: {what} because the loss or the global gradient norm was not finite "
            f"(latest skipped losses: {losses}). The run stops instead of training on a ruined "
            "model; no checkpoint was written from a skipped step. Lower the learning rate, "
            "check the data, or raise the budget (train.max_consecutive_skips, "
            "train.max_total_skips)."
        )


@dataclass(frozen=True)
class LastGood:
    """The last good checkpoint: the newest one the run then trained ``confirm_steps`` steps
    past without a skipped step. ``keep_last`` never prunes it.

    A harmful update (a learning rate far too high) often leaves a finite loss for a step or
    two before the non-finite ones start, so the newest checkpoint before the first skipped step
    may already hold a ruined model; one the run trained a whole stretch past cannot. A skipped
    step disqualifies the checkpoint waiting to be confirmed (``candidate``).

    Example:
        >>> good = LastGood().after_save(10)                # saved at step 10
        >>> good = good.after_step(skipped=False, confirm_steps=2)
        >>> good = good.after_step(skipped=False, confirm_steps=2)
        >>> good.step, good.after_save(12).after_step(skipped=True, confirm_steps=2).step
        (10, 10)
    """

    step: int | None = None
    candidate: int | None = None
    clean_steps: int = 0

    def after_step(self, *, skipped: bool, confirm_steps: int) -> LastGood:
        """One more step trained (``skipped`` when its update was dropped)."""
        if skipped:
            return LastGood(self.step)
        if self.candidate is None:
            return self
        if self.clean_steps + 1 >= confirm_steps:
            return LastGood(self.candidate)
        return LastGood(self.step, self.candidate, self.clean_steps + 1)

    def after_save(self, step: int) -> LastGood:
        """A checkpoint of ``step`` was saved: it waits to be confirmed."""
        return LastGood(self.step, step, 0)

    def to_json(self) -> dict[str, Any]:
        """As saved in checkpoints: the confirmed step (a resume confirms its own checkpoint
        anew)."""
        return {"step": self.step}

    @classmethod
    def resumed(cls, data: Mapping[str, Any] | None, step: int) -> LastGood:
        """After resuming from the checkpoint of ``step`` that holds ``data``."""
        saved = (data or {}).get("step")
        return cls(None if saved is None else int(saved), step, 0)
