"""The launcher's progress watchdog (issue 33, point 4) on real processes: a rank that keeps
beating is never killed however long its step takes; a stopped one is named with its step and
state, and the job's processes are ended. The end-to-end launch is in
tests/test_fault_injection.py::test_a_stopped_rank_is_named_by_the_watchdog_and_the_job_ends_with_124."""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
from pathlib import Path

from meshtrain.launch import Watchdog, beat_path


def _beat(directory: Path, rank: int, pid: int, step: int, age_s: float = 0.0) -> None:
    beat = {"rank": rank, "pid": pid, "step": step, "time": time.time() - age_s}
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
