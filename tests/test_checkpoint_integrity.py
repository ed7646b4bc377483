"""Checkpoint checksums in one process, on real DCP checkpoints and real damage: flipped bytes,
truncated files, a hand-edited state; a resume falls back to the newest intact checkpoint and
says what it passed over; ``keep_last`` spares the last good one; ``meshtrain checkpoints``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from meshtrain import CheckpointError
from meshtrain.cli import main
from meshtrain.train.checkpoint import (
    CheckpointConfig,
    Checkpointer,
    find_resume_point,
    list_checkpoints,
    load_checkpoint,
)
from meshtrain.train.checkpoint.files import METADATA_FILE, STATE_FILE
from meshtrain.train.checkpoint.integrity import inspect_checkpoint, seal_state


def _save(directory: Path, *steps: int, keep_last: int = 0) -> Checkpointer:
    checkpointer = Checkpointer(CheckpointConfig(directory, keep_last=keep_last))
    for step in steps:
        weights = {"w": torch.arange(64.0) + step, "b": torch.full((3,), float(step))}
        checkpointer.save(step, weights, None, {"step": step})
    return checkpointer


def _payload(path: Path) -> Path:
    (payload,) = path.glob("*.distcp")
    return payload


def _flip(file: Path, start: int, count: int = 64) -> None:
    data = bytearray(file.read_bytes())
    for index in range(start, min(start + count, len(data))):
        data[index] ^= 0xFF
    file.write_bytes(bytes(data))


def _truncate(file: Path, keep: int) -> None:
    file.write_bytes(file.read_bytes()[:keep])


def test_every_file_and_the_state_are_recorded_and_verified(tmp_path: Path) -> None:
    _save(tmp_path, 3)
    path = tmp_path / "step_00000003"
    state = json.loads((path / STATE_FILE).read_text())
    on_disk = sorted(p.name for p in path.iterdir() if p.name != STATE_FILE)
    assert sorted(state["files"]) == on_disk and METADATA_FILE in on_disk
    assert all(len(entry["sha256"]) == 64 for entry in state["files"].values())
    assert len(state["checksum"]) == 64 and state["version"] == 2
    status = inspect_checkpoint(path)
    assert (status.status, status.step, status.problems) == ("intact", 3, ())


def test_flipped_bytes_in_a_tensor_file_are_found_before_anything_loads(tmp_path: Path) -> None:
    _save(tmp_path, 3)
    path = tmp_path / "step_00000003"
    payload = _payload(path)
    _flip(payload, start=payload.stat().st_size // 2)
    status = inspect_checkpoint(path)
    assert status.status == "damaged"
    assert status.problems == (
        f"{payload.name}: its content does not match its sha256 (the file is corrupted)",
    )
    target = {"w": torch.zeros(64), "b": torch.zeros(3)}
    with pytest.raises(
        CheckpointError, match=rf"(?s)is damaged, so nothing was loaded.*{payload.name}"
    ):
        load_checkpoint(path, target, None)
    assert torch.equal(target["w"], torch.zeros(64)), "nothing may be loaded from it"


@pytest.mark.parametrize("victim", ["payload", METADATA_FILE])
def test_a_truncated_file_is_named_with_its_size(tmp_path: Path, victim: str) -> None:
    _save(tmp_path, 3)
    path = tmp_path / "step_00000003"
    file = _payload(path) if victim == "payload" else path / METADATA_FILE
    expected = file.stat().st_size
    _truncate(file, 100)
    problem = f"{file.name}: 100 bytes, expected {expected:,} (truncated)"
    assert inspect_checkpoint(path, content=False).problems == (problem,)


def test_a_hand_edited_state_is_found_even_when_its_checksum_is_forged(tmp_path: Path) -> None:
    _save(tmp_path, 3)
    path = tmp_path / "step_00000003"
    state = json.loads((path / STATE_FILE).read_text())
    state["step"] = state["extra"]["step"] = 7
    (path / STATE_FILE).write_text(json.dumps(state, indent=1))
    assert inspect_checkpoint(path).problems == (
        f"{STATE_FILE}: its checksum does not match its content (edited by hand or corrupted)",
        f"{STATE_FILE}: says step 7, but the directory is step_00000003",
    )
    (path / STATE_FILE).write_text(seal_state(state))  # a consistent forgery of the checksum
    assert inspect_checkpoint(path).problems == (
        f"{STATE_FILE}: says step 7, but the directory is step_00000003",
    )


def test_a_resume_passes_over_damaged_and_unfinished_checkpoints_to_the_newest_intact(
    tmp_path: Path,
) -> None:
    _save(tmp_path, 1, 2, 3)
    _flip(_payload(tmp_path / "step_00000003"), start=10)
    unfinished = tmp_path / "step_00000004.tmp-1a2b3c4d"
    unfinished.mkdir()
    (unfinished / "__0_0.distcp").write_bytes(b"half a shard")
    point = find_resume_point(tmp_path)
    assert point.checkpoint == tmp_path / "step_00000002"
    assert [(s.path.name, s.status) for s in point.passed_over] == [
        ("step_00000004.tmp-1a2b3c4d", "incomplete"),
        ("step_00000003", "damaged"),
    ]
    lines = point.describe_passed_over()
    assert lines[1].startswith(f"passed over {tmp_path / 'step_00000003'}: damaged (__0_0.distcp")
    target = {"w": torch.zeros(64), "b": torch.zeros(3)}
    assert load_checkpoint(point.checkpoint, target, None, verify=False) == {"step": 2}
    assert torch.equal(target["w"], torch.arange(64.0) + 2)
    # Reading sizes only (verify=False) cannot see flipped bytes, only cut files.
    assert find_resume_point(tmp_path, verify=False).checkpoint == tmp_path / "step_00000003"


def test_a_checkpoint_without_checksums_loads_only_when_asked_for(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A checkpoint whose ``meshtrain.json`` has no checksums (older meshtrain, or stripped of
    them by whoever flipped a tensor byte) used to load silently, and ``meshtrain checkpoints``
    called it resumable. Now ``checkpoints``, resume and ``load_checkpoint`` agree: refused,
    naming ``checkpoint.allow_unverified``, and loaded only with it."""
    _save(tmp_path, 5)
    path = tmp_path / "step_00000005"
    state = json.loads((path / STATE_FILE).read_text())
    del state["files"], state["checksum"]
    state["version"] = 1
    (path / STATE_FILE).write_text(json.dumps(state))
    weights = (torch.arange(64.0) + 5).numpy().tobytes()
    at = _payload(path).read_bytes().find(weights)
    assert at >= 0
    _flip(_payload(path), start=at + 40, count=1)  # one byte of w[10]: nothing can tell
    status = inspect_checkpoint(path)
    assert status.status == "unverified" and not status.loadable and status.loadable_if(True)
    target = {"w": torch.zeros(64), "b": torch.zeros(3)}
    with pytest.raises(CheckpointError, match=r"is unverified, so nothing was loaded") as refusal:
        load_checkpoint(path, target, None)
    assert "--set checkpoint.allow_unverified=true" in str(refusal.value)
    point = find_resume_point(tmp_path)
    assert point.checkpoint is None and [s.status for s in point.blocking] == ["unverified"]
    with pytest.raises(CheckpointError, match=r"step_00000005: unverified \(saved without"):
        point.refuse_start_over(tmp_path)
    assert main(["checkpoints", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "unverified" in out and "no intact checkpoint" in out
    assert "load only with --set checkpoint.allow_unverified=true" in out
    # asked for: it resumes and loads
    assert find_resume_point(tmp_path, allow_unverified=True).checkpoint == path
    assert load_checkpoint(path, target, None, allow_unverified=True) == {"step": 5}
    assert target["w"][10] != 15.0  # the flipped byte, loaded as asked: why it is not the default


def test_keep_last_never_prunes_the_protected_checkpoint(tmp_path: Path) -> None:
    checkpointer = _save(tmp_path, 1, keep_last=1)
    checkpointer.protect(1)
    for step in (2, 3):
        checkpointer.save(step, {"w": torch.ones(2)}, None, {"step": step})
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000001", "step_00000003"]
    checkpointer.protect(None)
    checkpointer.save(4, {"w": torch.ones(2)}, None, {"step": 4})
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000004"]


def test_meshtrain_checkpoints_lists_status_step_and_size(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    _save(run_dir / "checkpoints", 1, 2)
    _truncate(run_dir / "checkpoints" / "step_00000002" / METADATA_FILE, 10)
    (run_dir / "checkpoints" / "step_00000003.tmp-0badf00d").mkdir()
    assert main(["checkpoints", str(run_dir)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"checkpoints in {run_dir / 'checkpoints'}"
    rows = [line.split() for line in lines[2:5]]
    assert [(row[0], row[1], row[4]) for row in rows] == [
        ("1", "intact", "step_00000001"),
        ("2", "damaged", "step_00000002"),
        ("3", "incomplete", "step_00000003.tmp-0badf00d"),
    ]
    size = sum(f.stat().st_size for f in (run_dir / "checkpoints" / "step_00000001").iterdir())
    assert size > 1024 and rows[0][2:4] == [f"{size / 1024:.1f}", "KiB"]
    assert "(truncated)" in lines[3] and "a save that did not finish" in lines[4]
    assert lines[-1] == "a run resumes from step 1 (step_00000001)"
    _flip(_payload(run_dir / "checkpoints" / "step_00000001"), start=0)
    assert main(["checkpoints", str(run_dir / "checkpoints")]) == 1
    assert "no intact checkpoint" in capsys.readouterr().out
    assert main(["checkpoints", str(tmp_path / "nowhere")]) == 2
    assert "is not a directory" in capsys.readouterr().err
