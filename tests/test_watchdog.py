"""The launcher's progress watchdog (issue 33, point 4) on real processes: a rank that keeps
beating is never killed however long its step takes or however the wall clock steps; a stopped
one is named with its step and state, and the job's processes are ended. The end-to-end launch
(with the wall clock stepping and the whole job paused) is in
tests/test_fault_injection.py::test_a_stopped_rank_is_named_by_the_watchdog_and_the_job_ends_with_124."""

from __future__ import annotations

import itertools
import json
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from meshtrain.launch import Watchdog, beat_path

_COUNT = itertools.count()


def _beat(directory: Path, rank: int, pid: int, step: int, age_s: float = 0.0) -> None:
    beat = {
        "rank": rank,
        "pid": pid,
        "step": step,
        "beat": next(_COUNT),
        "time": time.time() - age_s,
    }
    beat_path(directory, rank, attempt=0).write_text(json.dumps(beat))


def test_a_slow_live_rank_is_never_killed_and_a_stopped_one_is_named(tmp_path: Path) -> None:
    slow = subprocess.Popen(["sleep", "60"])
    stopped = subprocess.Popen(["sleep", "60"])
    beating = threading.Event()

    def keep_beating() -> None:  # a live rank's heartbeat thread: its step never advances
        while not beating.wait(0.3):
            _beat(tmp_path, 1, slow.pid, step=3)

    thread = threading.Thread(target=keep_beating, daemon=True)
    thread.start()
    watchdog = Watchdog(tmp_path, timeout_s=1.0, log_dir=tmp_path / "logs")
    watchdog.start()
    try:
        time.sleep(4.0)  # four timeouts on one step: slow, not stopped
        assert watchdog.verdict == "" and slow.poll() is None
        stopped.send_signal(signal.SIGSTOP)
        _beat(tmp_path, 0, stopped.pid, step=7, age_s=5.0)
        deadline = time.monotonic() + 10
        while not watchdog.verdict and time.monotonic() < deadline:
            time.sleep(0.1)
        assert watchdog.verdict.startswith("rank 0 stopped making progress after step 7: ")
        assert "its process is stopped by a signal (SIGSTOP or a debugger)" in watchdog.verdict
        assert stopped.wait(10) == -signal.SIGKILL
        # The live rank was asked for its stacks (a rank's faulthandler writes them; `sleep` has
        # no handler, so the request ends it), then the job was ended.
        assert slow.wait(10) in (-signal.SIGUSR1, -signal.SIGKILL)
    finally:
        beating.set()
        watchdog.stop()
        for process in (slow, stopped):
            if process.poll() is None:
                process.kill()
                process.wait()


def test_steps_of_the_wall_clock_never_end_a_beating_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The wall clock stepping by hours, forward and back (NTP, a resumed VM), between beats of
    a live rank: the watchdog times beats on its own monotonic clock, so it never sees a silence.
    It used to compare the beats' wall times with its own and ended the job ("no heartbeat for
    3601 s")."""
    live = subprocess.Popen(["sleep", "60"])
    offset = [0.0]
    wall = time.time
    monkeypatch.setattr(time, "time", lambda: wall() + offset[0])  # the clock shim
    beating = threading.Event()

    def keep_beating() -> None:  # every 0.6 s: well inside the 1 s allowance
        while not beating.wait(0.6):
            _beat(tmp_path, 0, live.pid, step=1)

    thread = threading.Thread(target=keep_beating, daemon=True)
    thread.start()
    watchdog = Watchdog(tmp_path, timeout_s=1.0, log_dir=None)
    watchdog.start()
    try:
        for jump in (3600, 3600, -7200, 86400, -3600, 3600):
            offset[0] += jump  # the watchdog polls every 0.25 s: it looks before the next beat
            time.sleep(0.7)
        assert watchdog.verdict == "" and live.poll() is None
    finally:
        beating.set()
        watchdog.stop()
        live.kill()
        live.wait()


def test_a_rank_s_heartbeat_is_one_whole_record_written_in_place_never_through_a_link(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loop's beats are written over the last in one write (no file per step); the watchdog
    reads each whole, with the step the loop last finished; a link where the heartbeat goes is
    refused, naming it, and what it points to is left alone."""
    from meshtrain.errors import CheckpointError
    from meshtrain.launch import read_beats
    from meshtrain.train import heartbeat

    monkeypatch.setattr(heartbeat, "_beating", [])  # this process beats only in this test
    monkeypatch.setattr(heartbeat, "_written", [-float("inf")])
    path = heartbeat.start(tmp_path, rank=0, attempt=0, every_s=60.0)
    first = read_beats(tmp_path)[0]
    heartbeat.progress(41)
    (beat,) = read_beats(tmp_path).values()
    assert (beat["step"], beat["rank"]) == (41, 0) and beat["beat"] > first["beat"]
    assert path.stat().st_size == heartbeat._RECORD_BYTES and sorted(tmp_path.iterdir()) == [path]
    elsewhere = tmp_path / "elsewhere.txt"
    elsewhere.write_text("not a heartbeat")
    linked = tmp_path / "linked"
    linked.mkdir()
    beat_path(linked, 0, attempt=1).symlink_to(elsewhere)
    with pytest.raises(CheckpointError, match="is a symbolic link"):
        heartbeat.start(linked, rank=0, attempt=1, every_s=60.0)
    assert elsewhere.read_text() == "not a heartbeat"
