"""The run directory's lock, in process and with a real second process: a second run is refused
naming the holder, a job's processes share it, a killed holder leaves nothing behind, and where
``flock`` is missing a stale lock is recognised by PID and host."""

from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from meshtrain import CheckpointError
from meshtrain.files import lock as lock_module
from meshtrain.files.lock import LOCK_FILE, acquire_run_lock

HOLD = """
import sys
from meshtrain.files.lock import acquire_run_lock
held = acquire_run_lock(sys.argv[1])
print("locked", flush=True)
sys.stdin.read()
"""


def test_a_second_run_is_refused_naming_the_holder(tmp_path: Path) -> None:
    with acquire_run_lock(tmp_path / "run") as held:
        assert held.owned and (tmp_path / "run" / LOCK_FILE).is_file()
        with pytest.raises(CheckpointError) as raised:
            acquire_run_lock(tmp_path / "run")
    message = raised.value.message
    assert f"run directory '{tmp_path / 'run'}' is in use by another run" in message
    assert f"pid {os.getpid()} on host {socket.gethostname()}" in message
    assert f"kill -TERM {os.getpid()}" in message and "logging.run_dir" in message
    with acquire_run_lock(tmp_path / "run"):  # released: free again
        pass


def test_the_processes_of_one_job_share_its_lock(tmp_path: Path) -> None:
    with acquire_run_lock(tmp_path, token="job-1") as held:
        shared = acquire_run_lock(tmp_path, token="job-1")
        assert not shared.owned and shared.holder.token == "job-1"
        shared.release()  # not the owner: the lock stays
        with pytest.raises(CheckpointError, match="in use by another run"):
            acquire_run_lock(tmp_path, token="job-2")
        assert held.owned


def test_a_killed_holder_leaves_no_lock_behind(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "locked\n"
        with pytest.raises(CheckpointError, match=f"pid {holder.pid} on host"):
            acquire_run_lock(tmp_path)
        holder.kill()
        holder.wait(timeout=30)
    finally:
        holder.kill()
        holder.communicate()
    with acquire_run_lock(tmp_path) as held:  # the kernel released it with the process
        assert held.owned


def _without_flock(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_flock(fd: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(lock_module, "_flock", no_flock)


def _plant(directory: Path, *, pid: int, host: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    holder = {
        "host": host,
        "pid": pid,
        "token": "old",
        "started": time.time() - 60,
        "command": "meshtrain train debug",
        "pid_start": None,
    }
    (directory / LOCK_FILE).write_text(json.dumps(holder))


def _dead_pid() -> int:
    finished = subprocess.Popen([sys.executable, "-c", "pass"])
    finished.wait(timeout=60)
    return finished.pid


def test_without_flock_a_lock_whose_holder_died_here_is_taken_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _without_flock(monkeypatch)
    _plant(tmp_path, pid=_dead_pid(), host=socket.gethostname())
    with acquire_run_lock(tmp_path) as held:
        assert held.owned
        recorded = json.loads((tmp_path / LOCK_FILE).read_text())
        assert recorded["pid"] == os.getpid()
        with pytest.raises(CheckpointError, match=f"pid {os.getpid()}"):
            acquire_run_lock(tmp_path)
    assert not (tmp_path / LOCK_FILE).exists()


def test_without_flock_a_live_or_remote_holder_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _without_flock(monkeypatch)
    _plant(tmp_path / "live", pid=os.getppid(), host=socket.gethostname())
    with pytest.raises(CheckpointError, match=f"pid {os.getppid()} on host"):
        acquire_run_lock(tmp_path / "live")
    _plant(tmp_path / "remote", pid=_dead_pid(), host="node-elsewhere")
    with pytest.raises(CheckpointError) as raised:
        acquire_run_lock(tmp_path / "remote")
    assert "on host node-elsewhere" in raised.value.message
    assert f"delete '{tmp_path / 'remote' / LOCK_FILE}'" in raised.value.message


def _unwritable(tmp_path: Path) -> Path:
    """A directory this process cannot create files in: read-only permissions, or (as root,
    whom permissions do not stop) a place in sysfs, which refuses new directories."""
    if os.geteuid() != 0:
        frozen = tmp_path / "read-only"
        frozen.mkdir()
        frozen.chmod(0o555)
        return frozen / "run"
    return Path("/sys/meshtrain-test-run")


def test_an_unwritable_run_directory_is_named_with_the_reason(tmp_path: Path) -> None:
    run_dir = _unwritable(tmp_path)
    with pytest.raises(CheckpointError) as raised:
        acquire_run_lock(run_dir)
    message = raised.value.message
    assert message.startswith(f"cannot lock the run directory '{run_dir}': ")
    assert "fix its permissions or choose another directory" in message
