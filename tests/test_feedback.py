"""What ``meshtrain train`` and ``check`` say and when: the first line before torch is imported,
"nothing to train" decided in the launcher (no rank starts), and a configurable rank-start
timeout whose message names the cause and the option."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch

from meshtrain.cli import build_parser, main
from meshtrain.testing.runner import SPMDError, SPMDPool, get_pool
from meshtrain.train.checkpoint import CheckpointConfig, Checkpointer

_FIRST_LINE = """
import sys
import meshtrain.launch as launch
def stop(*args, **kwargs):
    print("torch imported:", "torch" in sys.modules, flush=True)
    raise SystemExit(0)
launch.torchrun_arguments = stop
from meshtrain.cli import main
main(["train", "debug", "--nproc", "2"])
"""


def test_the_first_line_comes_before_torch_is_imported() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _FIRST_LINE], capture_output=True, text=True, timeout=120, check=True
    ).stdout.splitlines()
    assert out[0].startswith("meshtrain train debug: 2 ranks, mesh {dp=-1, tp=2}, zero 3")
    assert out[1] == "torch imported: False"


def test_nothing_to_train_is_decided_in_the_launcher(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    params = {"w": torch.nn.Parameter(torch.zeros(2))}
    Checkpointer(CheckpointConfig(run_dir / "checkpoints")).save(4, params, None, {"step": 4})
    sets = [
        "--set",
        f"logging.run_dir={run_dir}",
        "--set",
        "train.steps=4",
        "--set",
        "train.warmup_steps=1",
        "--set",
        "data.source=synthetic",
    ]
    with mock.patch("meshtrain.launch.run_agent", side_effect=AssertionError("a rank started")):
        assert main(["train", "debug", "--nproc", "2", *sets]) == 0
    assert "already at step 4 of 4; nothing to train" in capsys.readouterr().out


def test_check_takes_a_start_timeout() -> None:
    args = build_parser().parse_args(["check", "debug", "--start-timeout", "300"])
    assert args.start_timeout == 300
    assert get_pool(3, start_timeout_s=300.0).start_timeout_s == 300.0


@pytest.mark.slow
def test_a_stalled_rank_start_names_the_cause_and_the_option() -> None:
    pool = SPMDPool(2, start_timeout_s=0.01)  # no rank imports torch that fast
    with pytest.raises(SPMDError, match=r"no progress for 0.01 s .*--start-timeout"):
        pool.run(int)
    pool.close()


def test_export_reports_its_progress_to_the_last_byte(tmp_path: Path) -> None:
    from meshtrain.train.hf.export import export_hf

    params = {f"layer{i}.weight": torch.nn.Parameter(torch.ones(64, 64)) for i in range(3)}
    saved = Checkpointer(CheckpointConfig(tmp_path / "ckpt")).save(1, params, None, {"step": 1})
    calls: list[tuple[int, int]] = []
    export_hf(
        saved,
        tmp_path / "out",
        config={},
        max_shard_size=64 * 64 * 4,
        progress=lambda done, total: calls.append((done, total)),
    )
    assert [done for done, _ in calls] == [64 * 64 * 4 * k for k in (1, 2, 3)]
    assert {total for _, total in calls} == {3 * 64 * 64 * 4}
