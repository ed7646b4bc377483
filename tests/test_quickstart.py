"""Tier 3: the README's quickstart example under torchrun on 4 gloo ranks, end to end."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
STEP = re.compile(r"^step (\d+)  loss ([\d.]+)  one device ([\d.]+)")


@pytest.mark.slow
def test_quickstart_trains_like_one_device() -> None:
    env = {**os.environ, "PYTHONWARNINGS": "error"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "4",
            str(ROOT / "examples" / "quickstart.py"),
            "--steps",
            "3",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=ROOT,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "plan on mesh {dp: 2, tp: 2}" in proc.stdout
    assert "output: loss_parallel_head over 'tp'" in proc.stdout
    steps = [STEP.match(line) for line in proc.stdout.splitlines()]
    losses = [(float(m[2]), float(m[3])) for m in steps if m]
    assert len(losses) == 3, proc.stdout
    # Contract: fp32 reduction order. Tensor parallel splits the 64- and 192-wide matmul reductions
    # and the 256-way log-sum-exp into two partial sums, FSDP averages two dp halves; each changes
    # rounding by a few ulps per step. 64 ulps of the loss is far above that and far below any
    # real error (a wrong shard or a missing reduction moves the loss by > 1e-2).
    eps = torch.finfo(torch.float32).eps
    for distributed, reference in losses:
        assert abs(distributed - reference) <= 64 * eps * reference, losses
