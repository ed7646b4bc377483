"""Planning a QLoRA recipe needs no torchao: NF4's sizes are known numbers, so ``meshtrain plan``
gives the same bytes with torchao importable and without it (a plain install); only training
refuses, naming the ``qlora`` extra. Importing torchao prints nothing (its load-time log lines
are silenced where meshtrain imports it). Each case runs the real command in a subprocess."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from meshtrain.adapters.nf4 import torchao_nf4

ROOT = Path(__file__).resolve().parents[1]
#: Run Python code (the script's first argument "no-torchao" makes torchao unimportable first).
RUNNER = """
import sys
if sys.argv[1] == "no-torchao":
    sys.modules["torchao"] = None
exec(sys.argv[2])
"""
PLAN = """
from meshtrain.cli import main
sys.exit(main(["plan", "llama3_70b_qlora", "--world", "2", "--device-memory", "80GiB", "--json"]))
"""


def _run(code: str, *, torchao: bool) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", RUNNER, "torchao" if torchao else "no-torchao", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )


def _sizes(report: str) -> dict[str, Any]:
    """The plan report without its timing."""
    sizes = json.loads(report)
    sizes.pop("seconds", None)
    return dict(sizes)


def _needs_torchao() -> None:
    if torchao_nf4() is None:  # imported quietly, unlike pytest.importorskip
        pytest.skip("torchao is not installed (the test and qlora extras have it)")


def test_a_qlora_plan_is_the_same_without_torchao() -> None:
    _needs_torchao()
    without = _run(PLAN, torchao=False)
    assert without.returncode == 0 and without.stderr == "", without.stderr
    with_torchao = _run(PLAN, torchao=True)
    assert with_torchao.returncode == 0, with_torchao.stderr
    assert with_torchao.stderr == ""  # no "Failed to load …_C_mxfp8….so", no pytree notices
    assert _sizes(without.stdout) == _sizes(with_torchao.stdout)
    assert _sizes(without.stdout)["fits"] is True and _sizes(without.stdout)["memory"]


def test_training_a_base_planned_without_torchao_is_refused_naming_the_extra() -> None:
    code = """
import meshtrain as mt, torch
from meshtrain.adapters import lora
with torch.device("meta"):
    model = torch.nn.Sequential(torch.nn.Linear(256, 128, bias=False))
lora(model, rank=4, alpha=8, targets=["0"], quantize_base="nf4")
plan = mt.plan(model, mt.make_mesh(dp=1, world_size=1, abstract=True), mt.Rules({".*": mt.P()}))
assert plan.params[0].storage == "nf4", plan.params
try:
    mt.apply(plan, model)
except mt.PlanError as err:
    print(err.message)
"""
    result = _run(code, torchao=False)
    assert result.returncode == 0 and result.stderr == "", result.stderr
    assert result.stdout.startswith("training the QLoRA base '0.weight' (quantize_base='nf4') ")
    assert (
        "torchao is not installed. Install it with `pip install meshtrain[qlora]`" in result.stdout
    )


def test_importing_torchao_leaves_the_log_levels_as_they_were() -> None:
    levels = {name: logging.getLogger(name).level for name in ("torchao", "torch.utils._pytree")}
    _needs_torchao()
    assert {name: logging.getLogger(name).level for name in levels} == levels
