"""The non-finite budget and the last good checkpoint, in process: what ends a run, what counts,
and which checkpoint ``keep_last`` must keep."""

from __future__ import annotations

import math

import pytest

from meshtrain.errors import TrainingError
from meshtrain.train.guard import LastGood, SkipBudget, SkipGuard, SkipRecord

NAN = math.nan


def _metrics(loss: float, *, scaler: bool = False, overflow: bool = False) -> dict[str, float]:
    skipped = overflow or not math.isfinite(loss)
    metrics = {"loss": loss, "grad_norm": math.inf if skipped else 1.0, "skipped": float(skipped)}
    if scaler:
        metrics["loss_scale"] = 1024.0
    return metrics


def test_more_consecutive_skips_than_the_budget_stop_the_run_naming_the_losses() -> None:
    guard = SkipGuard(SkipBudget(max_consecutive=3, max_total=100))
    for step, loss in enumerate([2.0, NAN, NAN, NAN], start=1):
        guard.update(step, _metrics(loss))
    with pytest.raises(TrainingError) as raised:
        guard.update(5, _metrics(math.inf))
    message = raised.value.message
    assert message.startswith("step 5: 4 steps in a row were skipped (max_consecutive_skips = 3)")
    assert "step 2: nan, step 3: nan, step 4: nan, step 5: inf" in message
    assert "train.max_consecutive_skips" in message and "no checkpoint was written" in message


def test_the_total_budget_catches_skips_that_never_come_in_a_row() -> None:
    guard = SkipGuard(SkipBudget(max_consecutive=2, max_total=3))
    losses = [NAN, 2.0] * 3
    for step, loss in enumerate(losses, start=1):
        guard.update(step, _metrics(loss))
    assert guard.record.total == 3 and guard.record.consecutive == 0
    with pytest.raises(TrainingError, match=r"step 7: 4 steps of this run were skipped"):
        guard.update(7, _metrics(NAN))


def test_a_total_budget_of_zero_has_no_bound() -> None:
    guard = SkipGuard(SkipBudget(max_consecutive=1, max_total=0))
    for step in range(1, 200):
        guard.update(step, _metrics(NAN if step % 2 else 2.0))
    assert guard.record.total == 100


def test_loss_scaler_overflows_count_in_a_row_but_not_in_the_total() -> None:
    guard = SkipGuard(SkipBudget(max_consecutive=3, max_total=1))
    for step in range(1, 4):  # the scaler halving its scale: finite loss, overflowing gradients
        guard.update(step, _metrics(2.0, scaler=True, overflow=True))
    assert guard.record.total == 0 and guard.record.consecutive == 3
    guard.update(4, _metrics(2.0, scaler=True))
    with pytest.raises(TrainingError, match="in a row"):
        for step in range(5, 9):
            guard.update(step, _metrics(2.0, scaler=True, overflow=True))


def test_a_checkpoint_may_follow_only_a_step_whose_update_was_applied() -> None:
    guard = SkipGuard(SkipBudget())
    guard.update(1, _metrics(2.0))
    assert guard.may_checkpoint
    guard.update(2, _metrics(NAN))
    assert not guard.may_checkpoint
    guard.update(3, _metrics(2.0))
    assert guard.may_checkpoint


def test_the_counts_survive_a_resume_through_checkpoint_json() -> None:
    guard = SkipGuard(SkipBudget(max_consecutive=2, max_total=10))
    guard.update(1, _metrics(NAN))
    guard.update(2, _metrics(NAN))
    resumed = SkipGuard(guard.budget, SkipRecord.from_json(guard.record.to_json()))
    with pytest.raises(TrainingError, match="3 steps in a row"):
        resumed.update(3, _metrics(NAN))
    assert SkipRecord.from_json(None) == SkipRecord()


@pytest.mark.parametrize(
    ("field", "value"),
    [("max_consecutive", 0), ("max_total", -1), ("max_consecutive", 2.5), ("max_total", True)],
)
def test_a_budget_must_be_whole_numbers(field: str, value: object) -> None:
    with pytest.raises(TrainingError, match=f"SkipBudget.{field}"):
        SkipBudget(**{field: value})  # type: ignore[arg-type]


def test_a_checkpoint_is_good_once_the_run_trained_an_interval_past_it_unskipped() -> None:
    good = LastGood().after_save(4)
    good = good.after_step(skipped=False, confirm_steps=2)
    assert good.step is None  # one clean step is not yet an interval
    good = good.after_step(skipped=False, confirm_steps=2)
    assert good.step == 4
    # A harmful update leaves a finite loss for a step, then the skips start: the checkpoint
    # saved in between is never confirmed, and step 4 stays the last good one.
    good = good.after_save(6).after_step(skipped=True, confirm_steps=2)
    for _ in range(5):
        good = good.after_step(skipped=False, confirm_steps=2)
    assert good.step == 4
    assert good.after_save(10).after_step(skipped=False, confirm_steps=1).step == 10


def test_a_resumed_run_confirms_its_checkpoint_anew_and_keeps_the_older_good_one() -> None:
    saved = LastGood(step=4, candidate=None).to_json()
    good = LastGood.resumed(saved, step=6)
    assert (good.step, good.candidate) == (4, 6)
    assert good.after_step(skipped=True, confirm_steps=1).step == 4
    assert good.after_step(skipped=False, confirm_steps=1).step == 6
    assert LastGood.resumed(None, step=3).step is None
