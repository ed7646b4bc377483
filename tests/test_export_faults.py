"""Disk and export faults (issue 33, point 6): an OS error while exporting is one line naming
the path, the scratch folder is removed on any exit and on the next export, and a stopped
export says it was stopped, not that the checkpoint is damaged."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
import torch

from meshtrain import CheckpointError
from meshtrain.cli import main
from meshtrain.train.checkpoint import CheckpointConfig, Checkpointer
from meshtrain.train.checkpoint.files import RestrictedFileSystemReader
from meshtrain.train.hf import export as export_module
from meshtrain.train.hf.export import export_hf


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    params = {"w": torch.arange(64.0).reshape(8, 8), "b": torch.ones(8)}
    return Checkpointer(CheckpointConfig(tmp_path / "ckpt")).save(1, params, None, {"step": 1})


def _leftovers(out: Path) -> list[str]:
    return sorted(path.name for path in out.parent.glob(f"{out.name}*"))


def test_a_full_disk_is_one_line_naming_the_path_and_leaves_nothing(
    checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "out"

    def full(tensors: object, path: str, metadata: object = None) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", path)

    monkeypatch.setattr(export_module, "save_file", full)
    with pytest.raises(CheckpointError) as caught:
        export_hf(checkpoint, out, config={})
    message = caught.value.message
    assert "\n" not in message and message.startswith(f"writing the export to '{out}' failed: ")
    assert "No space left on device" in message and "the disk is full" in message
    assert _leftovers(out) == []


def test_safetensors_own_report_of_a_full_disk_is_one_line_too(
    checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    class SafetensorError(Exception):
        pass

    def full(tensors: object, path: str, metadata: object = None) -> None:
        raise SafetensorError(
            "Error while serializing: IoError(Os { code: 28, kind: StorageFull })"
        )

    monkeypatch.setattr(export_module, "save_file", full)
    with pytest.raises(CheckpointError, match=r"StorageFull .*the disk is full") as caught:
        export_hf(checkpoint, tmp_path / "out", config={})
    assert "\n" not in caught.value.message and _leftovers(tmp_path / "out") == []


def test_a_killed_exports_scratch_folder_is_removed_by_the_next_export(
    checkpoint: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    left = tmp_path / "out.tmp-1a2b3c4d"  # what SIGKILL mid-export leaves
    left.mkdir()
    (left / "shard-00000.safetensors").write_bytes(b"half")
    export_hf(checkpoint, out, config={})
    assert _leftovers(out) == ["out"]


def test_a_stopped_export_says_it_was_stopped_not_that_the_checkpoint_is_damaged(
    checkpoint: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    def interrupted(self: object, *args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(RestrictedFileSystemReader, "read_data", interrupted)
    with pytest.raises(KeyboardInterrupt):  # through DCP's own exception, unwrapped
        export_hf(checkpoint, tmp_path / "out", config={})
    assert _leftovers(tmp_path / "out") == []

    def stopped(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr("meshtrain.recipes.pretrained.export_run", stopped)
    assert main(["export", str(tmp_path), "--out", str(tmp_path / "o")]) == 130
    err = capsys.readouterr().err
    assert err.startswith(f"export stopped by SIGINT: nothing was written to {tmp_path / 'o'}")
    assert "damaged" not in err and err.count("\n") == 1


@pytest.fixture
def full_disk(tmp_path: Path):  # type: ignore[no-untyped-def]
    """A real filesystem of 12 KiB (tmpfs): room for a lock and little else. Mounting needs
    root; elsewhere the test is skipped."""
    import os
    import subprocess

    mount = tmp_path / "full"
    mount.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=12k", "tmpfs", str(mount)], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", str(mount)], check=False)


@pytest.mark.extended  # a real launch of 2 ranks: about 20 s
def test_a_full_disk_at_start_up_is_one_line_and_exit_2(full_disk: Path) -> None:
    """The run directory on a full filesystem: the first file a rank writes fails, and the job
    ends with one line naming the directory and the fix, exit status 2 (not status 1 and the
    logging module's noise)."""
    import os
    import subprocess
    import sys

    sets = ["data.source=synthetic", "logging.wandb=disabled", f"logging.run_dir={full_disk}/run"]
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "meshtrain",
            "train",
            "debug",
            "--nproc",
            "2",
            "--set",
            sets[0],
            "--set",
            sets[1],
            "--set",
            sets[2],
            "--set",
            "train.steps=2",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    output = done.stdout + done.stderr
    assert done.returncode == 2, output
    errors = [line for line in output.splitlines() if "Error" in line]
    assert len(errors) == 1 and "No space left on device" in errors[0], output
    assert "the disk is full: free space or choose another directory" in errors[0]
    assert "Traceback" not in output and "Message:" not in output
