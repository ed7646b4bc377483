"""One run per directory: an exclusive lock on a run directory, held by the job.

Two runs writing the same run directory delete each other's checkpoint scratch directories,
interleave their metrics and open two wandb runs. :func:`acquire_run_lock` makes the second one
stop at once with a :class:`~meshtrain.CheckpointError` naming the holder (host, PID, start time,
command). The lock is ``<directory>/meshtrain.lock``: an advisory ``flock`` that the kernel
releases when the holder dies however it dies, so a crashed run never leaves a lock behind; the
file records who holds it. On filesystems without ``flock`` the file alone is the lock, and a
lock whose holder's PID is gone from the same host is stale and taken over; one left by a process
on another host must be removed by hand (the message says so).

A job shares one lock among its processes through a token: ``meshtrain train --nproc`` takes the
lock before starting its ranks and hands its token to them (``MESHTRAIN_RUN_TOKEN``), so its
rank 0 finds the lock held by its own job.

Example:
    >>> import tempfile
    >>> run_dir = Path(tempfile.mkdtemp())
    >>> with acquire_run_lock(run_dir) as lock:
    ...     try:
    ...         acquire_run_lock(run_dir)
    ...     except CheckpointError as err:
    ...         print("in use by another run: pid" in err.message)
    True
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shlex
import socket
import sys
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from types import TracebackType

from meshtrain.errors import CheckpointError, describe_os_error
from meshtrain.files import refuse_link

__all__ = ["LOCK_FILE", "TOKEN_VARIABLE", "LockHolder", "RunLock", "acquire_run_lock"]

LOCK_FILE = "meshtrain.lock"
#: The environment variable through which a launcher hands its lock's token to its ranks.
TOKEN_VARIABLE = "MESHTRAIN_RUN_TOKEN"
_NO_FLOCK = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


@dataclass(frozen=True)
class LockHolder:
    """Who holds a run directory's lock: host, PID (and the process's start time where the
    system tells it, against PID reuse), the job's token, when and with what command."""

    host: str
    pid: int
    token: str
    started: float
    command: str
    pid_start: str | None = None

    @classmethod
    def me(cls, token: str) -> LockHolder:
        """This process, holding for the job ``token``."""
        program = Path(sys.argv[0]) if sys.argv and sys.argv[0] else Path("python")
        shown = (
            f"python -m {program.parent.name}" if program.name == "__main__.py" else program.name
        )
        command = " ".join([shown, *(shlex.quote(arg) for arg in sys.argv[1:])])
        pid = os.getpid()
        return cls(socket.gethostname(), pid, token, time.time(), command, _start_time(pid))

    def describe(self) -> str:
        """``pid 42 on host node1 since 2026-01-02 03:04:05 (meshtrain train debug)``."""
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        return f"pid {self.pid} on host {self.host} since {since} ({self.command})"

    def is_gone(self) -> bool:
        """True when the holder ran on this host and its process no longer exists."""
        if self.host != socket.gethostname():
            return False
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:  # alive, another user's
            return False
        return self.pid_start is not None and _start_time(self.pid) != self.pid_start


class RunLock:
    """A held (or, for a job's other processes, shared) lock on a run directory; release it with
    :meth:`release` or by leaving its ``with`` block."""

    def __init__(self, path: Path, holder: LockHolder, fd: int | None, *, owned: bool) -> None:
        self.path = path
        self.holder = holder
        self.owned = owned
        self._fd = fd

    def release(self) -> None:
        """Give the lock up (a shared lock is left to its owner). Safe to call twice."""
        if not self.owned:
            return
        self.owned = False
        with contextlib.suppress(OSError):
            if self._fd is None:  # the file is the lock
                self.path.unlink(missing_ok=True)
            else:
                os.ftruncate(self._fd, 0)  # an empty file: nobody holds it
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> RunLock:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()


def acquire_run_lock(directory: str | Path, *, token: str | None = None) -> RunLock:
    """Lock ``directory`` (created if missing) for this job; raise :class:`CheckpointError`
    naming the holder when another job holds it, or naming the directory when it cannot be
    written. ``token`` identifies the job: a lock held under the same token is shared, not
    refused."""
    directory = Path(directory)
    path = directory / LOCK_FILE
    holder = LockHolder.me(token or uuid.uuid4().hex)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        refuse_link(path)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
    except OSError as err:
        if err.errno == errno.ELOOP:
            refuse_link(path)
        raise CheckpointError(
            f"cannot lock the run directory {str(directory)!r}: {describe_os_error(err)} "
            "(set logging.run_dir in a recipe)."
        ) from None
    try:
        _flock(fd)
    except BlockingIOError:
        os.close(fd)
        return _held_elsewhere(path, holder)
    except OSError as err:
        os.close(fd)
        if err.errno in _NO_FLOCK:
            return _acquire_without_flock(path, holder)
        raise CheckpointError(f"cannot lock {str(path)!r}: {describe_os_error(err)}.") from None
    _write_holder(fd, holder)
    return RunLock(path, holder, fd, owned=True)


def _flock(fd: int) -> None:
    import fcntl

    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)


def _held_elsewhere(path: Path, me: LockHolder) -> RunLock:
    """The lock is held: shared when by this job, else refused naming the holder."""
    holder = _read_holder(path)
    if holder is not None and holder.token == me.token:
        return RunLock(path, holder, None, owned=False)
    raise _busy(path, holder)


def _acquire_without_flock(path: Path, me: LockHolder) -> RunLock:
    """The file is the lock (created exclusively); a stale one from this host is taken over."""
    for _ in range(3):
        try:
            fd = os.open(
                path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644
            )
        except FileExistsError:
            holder = _read_holder(path)
            if holder is not None and holder.token == me.token:
                return RunLock(path, holder, None, owned=False)
            if holder is None or not holder.is_gone():
                raise _busy(path, holder) from None
            path.unlink(missing_ok=True)  # stale: its holder died on this host
            continue
        try:
            _write_holder(fd, me)
        finally:
            os.close(fd)
        return RunLock(path, me, None, owned=True)
    raise _busy(path, _read_holder(path))


def _busy(path: Path, holder: LockHolder | None) -> CheckpointError:
    directory = path.parent
    if holder is None:
        who = "a process that has not recorded itself yet"
        fix = "Wait for it to start or finish"
    else:
        who = holder.describe()
        gone = " (that process has exited; a child of it still holds the lock)"
        who += gone if holder.is_gone() else ""
        fix = (
            f"Wait for it to finish, stop it (`kill -TERM {holder.pid}` on {holder.host} saves a "
            "checkpoint and exits)"
        )
    return CheckpointError(
        f"run directory {str(directory)!r} is in use by another run: {who}. {fix}, or give "
        f"this run another directory (logging.run_dir). If that run no longer exists anywhere, "
        f"delete {str(path)!r}."
    )


def _write_holder(fd: int, holder: LockHolder) -> None:
    data = json.dumps(asdict(holder)).encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)
    with contextlib.suppress(OSError):
        os.fsync(fd)


def _read_holder(path: Path) -> LockHolder | None:
    """The holder recorded in the lock file (``None`` while it is empty or being written)."""
    for _ in range(20):
        try:
            text = path.read_text(encoding="utf-8")
            return LockHolder(**json.loads(text))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, TypeError):
            time.sleep(0.01)  # written right now by the process that took the lock
    return None


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (Linux), else ``None``."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rpartition(")")[2].split()[19]
