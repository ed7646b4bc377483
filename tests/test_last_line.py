"""The last line is true (issue 33, point 5), in one process: a closed terminal does not crash a
rank, and a rank's unexpected error is one line on the console with its traceback in a log file.
How the launcher turns the ranks' reports into a status is in tests/test_cli_train.py."""

from __future__ import annotations

import errno
import io
import sys
from pathlib import Path

import pytest

from meshtrain.recipes.job import _write_traceback
from meshtrain.train.metrics.sinks import ConsoleSink


class ClosedTerminal(io.StringIO):
    """A terminal whose window was closed: every write fails with EIO, as a tty's does."""

    def write(self, text: str) -> int:
        raise OSError(errno.EIO, "Input/output error")


def test_a_closed_terminal_does_not_stop_training(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "stdout", sys.stdout)
    monkeypatch.setattr(sys, "stderr", sys.stderr)
    sink = ConsoleSink(10, run_name="debug", stream=ClosedTerminal())
    sink.start(config={}, plan_text="", plan_json="{}")
    for step in range(1, 4):
        sink.log(step, {"loss": 1.0})  # no OSError reaches the training loop
    sink.close(failed=False)
    assert sys.stdout.name == "/dev/null" and sys.stderr.name == "/dev/null"  # type: ignore[attr-defined]
    print("a later line and the flush at exit do not fail either")
    sys.stdout.close()  # the process's own would live until it exits


def test_a_crash_is_one_line_and_its_traceback_goes_to_the_run_directory(tmp_path: Path) -> None:
    try:
        {}["missing"]
    except KeyError as err:
        path = _write_traceback(err, 1, tmp_path)
    assert path == str(tmp_path / "logs" / "rank-1.log")
    text = Path(path).read_text()
    assert text.startswith("Traceback (most recent call last):") and "KeyError: 'missing'" in text


def test_a_finished_runs_summary_names_its_figures_and_what_to_run_next(tmp_path: Path) -> None:
    """Under the last line: wall time, tokens and tokens/s over the steps' time, MFU where the
    device's peak is known, the best validation loss and its step, the last checkpoint and the
    commands that read the run."""
    from meshtrain.recipes import recipe_from_toml
    from meshtrain.recipes.job import _ending
    from meshtrain.recipes.run import RunResult, RunTally

    recipe = recipe_from_toml('[model]\npreset = "debug"\n[mesh]\ndp = 1\n', source="debug.toml")
    checkpoint = tmp_path / "checkpoints" / "step_00000040"
    tally = RunTally(52.25, 40.0, 81_920, mfu=0.125, best_eval=(30, 2.25))
    result = RunResult({40: 2.5}, None, checkpoint, tmp_path, "fp", tally=tally)
    lines = _ending(recipe, result).splitlines()
    assert lines[0] == f"debug: trained to step 40, loss 2.5000; run directory {tmp_path}"
    assert lines[1] == (
        "  52.2 s in all; 81,920 tokens in 40.0 s of steps, saves and evaluations "
        "(2,048 tokens/s, MFU 12.5%)"
    )
    assert lines[2] == "  best validation loss 2.2500 at step 30"
    assert lines[3] == f"  last checkpoint {checkpoint}"
    assert lines[4].startswith(f"  next: meshtrain eval {tmp_path}  |  meshtrain generate")
    cpu = RunResult({40: 2.5}, None, checkpoint, tmp_path, "fp", tally=RunTally(1, 1, 10))
    assert "MFU n/a: no peak FLOP/s known" in _ending(recipe, cpu)
    assert "best validation loss" not in _ending(recipe, cpu)
