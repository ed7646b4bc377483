"""``meshtrain check``: a shipped recipe, shrunk to 4 gloo ranks, trains like one device; a bad
recipe exits 2 naming what is wrong; a failed comparison exits 1 with the report."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from meshtrain import EquivalenceError
from meshtrain.cli import main
from meshtrain.testing import harness

ROOT = Path(__file__).resolve().parents[1]


def _meshtrain(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "meshtrain", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONWARNINGS": "error"},
        cwd=ROOT,
        check=False,
    )


@pytest.mark.slow
@pytest.mark.spmd
def test_check_debug_trains_like_one_device() -> None:
    proc = _meshtrain("check", "debug", "--world", "4", "--steps", "2")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "debug: mesh {dp: -1, tp: 2} → {dp: 2, tp: 2}" in proc.stdout
    assert "plan on mesh {dp: 2, tp: 2} trains like one device." in proc.stdout
    assert "losses (plan / one device): 1: " in proc.stdout
    phases = [  # no silence: a line as the plan is made, the ranks start and each step compares
        "plan made and proven on 4 abstract ranks in ",
        "4 CPU ranks (gloo) ready in ",
        "training 2 step(s) under the plan and on one device",
        "step 1/2: loss ",
        "step 2/2: loss ",
        "plan on mesh {dp: 2, tp: 2} trains like one device.",
    ]
    places = [proc.stdout.find(phase) for phase in phases]
    assert -1 not in places and places == sorted(places), proc.stdout


@pytest.mark.slow
def test_check_a_recipe_with_an_unknown_key_exits_2(tmp_path: Path) -> None:
    recipe = tmp_path / "typo.toml"
    recipe.write_text('[model]\npreset = "debug"\n[mesh]\ndp = -1\n[parallel]\nzeroo = 3\n')
    proc = _meshtrain("check", str(recipe))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"RecipeError: {recipe}: unknown key parallel.zeroo = 3" in proc.stderr
    assert "did you mean 'zero'?" in proc.stderr


def test_a_world_too_small_for_the_recipe_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "llama3_70b", "--world", "2"]) == 2
    assert "cannot keep 'dp' ≥ 2 for bf16" in capsys.readouterr().err


def test_a_failed_comparison_exits_1_with_the_report(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    calls: list[dict[str, Any]] = []

    def diverging(*args: Any, **kwargs: Any) -> None:
        calls.append({"args": args, **kwargs})
        raise EquivalenceError("plan on mesh {dp: 2, tp: 2} does NOT train like one device.")

    monkeypatch.setattr(harness, "assert_equivalent", diverging)
    assert main(["check", "debug", "--steps", "1"]) == 1
    assert "does NOT train like one device" in capsys.readouterr().out
    (call,) = calls
    assert call["args"][1] == {"dp": 2, "tp": 2} and call["steps"] == 1
    assert call["args"][2]["options"].zero == 3 and call["batches"].batch_size == 8


def test_the_parser_refuses_a_world_that_is_not_positive(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        main(["check", "debug", "--world", "0"])
    assert "'0' is not a positive integer" in capsys.readouterr().err


def test_progress_lines_are_passed_on_whole_and_errors_reach_the_caller(tmp_path: Path) -> None:
    from meshtrain.testing.progress import StepLines, relayed

    lines = StepLines(str(tmp_path / "steps.txt"))
    said: list[str] = []

    def work() -> int:
        lines.say("step 1/2 compared")
        with open(lines.path, "a", encoding="utf-8") as handle:
            handle.write("step 2/2 half writ")  # a line still being written: not passed on
        return 7

    assert relayed(work, said.append, lines.path, every_s=0.01) == 7
    assert said == ["step 1/2 compared"]

    def fails() -> int:
        raise EquivalenceError("the ranks disagreed")

    with pytest.raises(EquivalenceError, match="the ranks disagreed"):
        relayed(fails, said.append, str(tmp_path / "none.txt"))
