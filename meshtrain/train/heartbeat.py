"""A rank's heartbeat for its launcher's watchdog (:class:`meshtrain.launch.Watchdog`).

Each finished step, and a thread every few seconds, write ``beat-attempt-<A>-rank-<R>.json``
(pid, the last step finished, a count of the beats written, the wall time for people to read)
into the launcher's report directory, whatever the rank is doing: a slow step,
a long save or a wait in a collective all keep beating, so a slow but live rank is never taken
for a hung one. A rank stopped by a signal, frozen in the kernel, or stuck holding the GIL stops
beating; the watchdog names it with the step it had reached. ``SIGUSR1`` makes the rank write
every thread's Python stack to ``<log dir>/stacks-rank-<R>.txt`` (``faulthandler``): the
watchdog asks the ranks still alive for theirs before it ends the job. No torch here.

Example:
    >>> progress(12)  # the training loop, after each step
    >>> last_step()
    12
"""

from __future__ import annotations

import contextlib
import faulthandler
import itertools
import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import IO

from meshtrain.files import open_for_append, open_to_overwrite
from meshtrain.launch import LOG_DIR_VARIABLE, beat_path

__all__ = ["last_step", "progress", "start"]

_state = {"step": 0}
_stacks: list[IO[str]] = []  # kept open: faulthandler writes to its file descriptor
_beating: list[tuple[int, int]] = []  # (heartbeat file's descriptor, rank) once started
_written = [-float("inf")]  # when progress() last wrote the heartbeat (monotonic seconds)
_count = itertools.count(1)  # each beat's number: the watchdog sees a new one, not a new time
#: the least time between two heartbeats written from the training loop: a step slower than this
#: writes one each (the watchdog names the step a stopped rank reached); faster steps write one
#: per window, so the named step is at most this much behind (at 1 s, a rank stopped 1 s after
#: step 1 was named at step 1 while rank 0 logged step 4)
_AT_MOST_EVERY_S = 0.1


#: each beat is written over the last in one ``pwrite`` of this many bytes (the JSON padded with
#: spaces, which JSON readers skip): a reader sees one whole beat or the other, and a beat costs
#: one system call — a new file renamed over the old cost 2 ms of each 0.3 s debug step
_RECORD_BYTES = 256


def progress(step: int) -> None:
    """Record that this rank finished ``step``: a heartbeat at once when :func:`start` ran and
    the last one from here is :data:`_AT_MOST_EVERY_S` old (one small write: the watchdog then
    names the step a stopped rank reached; the heartbeat thread writes the latest step on its
    own schedule, so fast steps cost no write per step)."""
    _state["step"] = step
    now = time.monotonic()
    if _beating and now - _written[0] >= _AT_MOST_EVERY_S:
        _written[0] = now
        _beat(*_beating[0])


def last_step() -> int:
    """The last step :func:`progress` recorded."""
    return _state["step"]


def start(directory: str | os.PathLike[str], *, rank: int, attempt: int, every_s: float) -> Path:
    """Start this rank's heartbeat thread (a daemon) and its stack dump on ``SIGUSR1``; return
    the heartbeat file."""
    path = beat_path(directory, rank, attempt)
    descriptor = open_to_overwrite(path)
    _beating[:] = [(descriptor, rank)]
    _beat(descriptor, rank)
    thread = threading.Thread(
        target=_beat_forever,
        args=(descriptor, rank, every_s),
        name="meshtrain-heartbeat",
        daemon=True,
    )
    thread.start()
    logs = os.environ.get(LOG_DIR_VARIABLE)
    if logs and hasattr(signal, "SIGUSR1"):
        with contextlib.suppress(OSError, ValueError, RuntimeError):
            Path(logs).mkdir(parents=True, exist_ok=True)
            handle = open_for_append(Path(logs) / f"stacks-rank-{rank}.txt")
            _stacks.append(handle)
            faulthandler.register(signal.SIGUSR1, file=handle, all_threads=True)
    return path


def _beat_forever(descriptor: int, rank: int, every_s: float) -> None:
    while True:
        time.sleep(every_s)
        _beat(descriptor, rank)


def _beat(descriptor: int, rank: int) -> None:
    beat = {
        "rank": rank,
        "pid": os.getpid(),
        "step": _state["step"],
        "beat": next(_count),
        "time": time.time(),  # shown only: the watchdog times beats on its own monotonic clock
    }
    record = json.dumps(beat).encode().ljust(_RECORD_BYTES)
    with contextlib.suppress(OSError):
        os.pwrite(descriptor, record, 0)  # the loop's and the thread's: each a whole record
