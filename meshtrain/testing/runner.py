"""A persistent pool of real multi-process gloo ranks that SPMD tests reuse ("SPMD runner").

Why: launching fresh processes per Hypothesis example costs seconds (``import torch`` plus the
rendezvous), while a pool started once answers a task in milliseconds. A mismatched collective
hangs gloo forever, so every task has a timeout, and after any failure the pool kills its ranks
and respawns them lazily on the next :meth:`SPMDPool.run`. The parent never initialises
``torch.distributed``; each rank does, with gloo over a ``FileStore`` in a temp dir the pool owns.

Example::

    def rank_sum() -> float:  # module level: tasks are pickled by reference
        import torch
        import torch.distributed as dist

        t = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(t)
        return t.item()

    assert get_pool(2).run(rank_sum) == [1.0, 1.0]
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import multiprocessing.connection as mpc
import multiprocessing.util
import os
import pickle
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from meshtrain.errors import MeshtrainError

__all__ = [
    "SPMDError",
    "SPMDPool",
    "SPMDPoolStats",
    "SPMDTaskError",
    "SPMDTimeoutError",
    "close_pools",
    "get_pool",
    "shared_pool_stats",
]

T = TypeVar("T")
_MAX_WORLD = 8
_LOG_TAIL_LINES = 40
_FAILURE_GRACE_S = 1.0  # after one rank raised, how long the others get to report
_JOIN_S = 3.0
# The parent keeps the per-task clock; gloo's own timeout only has to outlive any task timeout.
_PG_TIMEOUT_S = 2 * 3600.0


class SPMDError(MeshtrainError):
    """The SPMD runner could not run a task: unpicklable task, closed pool, ranks that won't start.

    Example::

        pool.run(lambda: 1)  # SPMDError: ... must be defined at module level ...
    """


class SPMDTaskError(SPMDError):
    """One or more ranks raised (or died) running a task; ``failures`` maps rank -> details.

    Example::

        try:
            pool.run(check_grads)
        except SPMDTaskError as err:
            print(err.failures[1])  # "AssertionError: ..." and rank 1's traceback
    """

    def __init__(self, message: str, failures: dict[int, str], task: str = "") -> None:
        super().__init__(message)
        self.failures = dict(failures)
        self.task = task

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.message, self.failures, self.task))


class SPMDTimeoutError(SPMDError):
    """Some ranks did not answer within the task's timeout (typically a mismatched collective).

    Example::

        with pytest.raises(SPMDTimeoutError):
            pool.run(rank0_skips_all_reduce, _timeout_s=5.0)  # ``err.pending == (1,)``
    """

    def __init__(
        self, message: str, pending: tuple[int, ...] = (), task: str = "", timeout_s: float = 0.0
    ) -> None:
        super().__init__(message)
        self.pending = pending
        self.task = task
        self.timeout_s = timeout_s

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.message, self.pending, self.task, self.timeout_s))


@dataclass(frozen=True)
class SPMDPoolStats:
    """Counters of one pool: ``starts`` (rank spawns), ``tasks_run`` (dispatched), last start time."""

    starts: int
    tasks_run: int
    last_start_s: float


@dataclass(frozen=True)
class _RankSpec:
    rank: int
    world_size: int
    store_path: str
    log_path: str
    master_port: int
    parent_pid: int


@dataclass(frozen=True)
class _RankWarning:
    rank: int
    category: bytes  # the pickled class, b"" when it cannot be pickled
    category_name: str
    message: str
    filename: str
    lineno: int


@dataclass(frozen=True)
class _Reply:
    ok: bool
    result: bytes  # the pickled return value when ok
    error: str  # "Type: message" plus the remote traceback when not ok
    warnings: tuple[_RankWarning, ...]


@dataclass(frozen=True)
class _Progress:
    """A starting rank's progress report (``phase`` one of :data:`_START_PHASES`)."""

    phase: str


#: What a starting rank has done, in order; each report restarts the start clock.
_START_PHASES = ("spawned", "running", "torch imported", "joined")


@dataclass
class _Rank:
    process: multiprocessing.process.BaseProcess
    conn: mpc.Connection


@dataclass
class _Resources:
    """What a pool must release; its finalizer holds this, never the pool itself."""

    ranks: list[_Rank] = field(default_factory=list)
    dir: Path | None = None
    busy: bool = False  # a task is in flight: its ranks will not read a polite "exit"
    owner: int = field(default_factory=os.getpid)  # a forked copy of the pool must not kill them


# ---------------------------------------------------------------- worker side (runs in ranks)


def _worker_main(spec: _RankSpec, conn: mpc.Connection) -> None:
    """Entry point of one rank: redirect output, join the gloo group, then serve tasks."""
    fd = os.open(spec.log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(line_buffering=True)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    print(f"=== rank {spec.rank}/{spec.world_size} pid {os.getpid()} starting", flush=True)
    threading.Thread(target=_exit_when_orphaned, args=(spec.parent_pid,), daemon=True).start()
    conn.send(_Progress("running"))
    os.environ.update(
        RANK=str(spec.rank),
        WORLD_SIZE=str(spec.world_size),
        LOCAL_RANK=str(spec.rank),
        LOCAL_WORLD_SIZE=str(spec.world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(spec.master_port),
    )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("default")  # an inherited `-W error` must not kill start-up
            import torch
            import torch.distributed as dist

            from meshtrain.launch import init_distributed

            conn.send(_Progress("torch imported"))
            torch.set_num_threads(1)
            store = dist.FileStore(spec.store_path, spec.world_size)
            init_distributed(
                backend="gloo",
                store=store,
                rank=spec.rank,
                world_size=spec.world_size,
                timeout_s=_PG_TIMEOUT_S,
            )
    except BaseException:
        traceback.print_exc()
        conn.send(_Reply(False, b"", traceback.format_exc(), ()))
        return
    conn.send(_Reply(True, b"", "", ()))
    while True:
        try:
            message = conn.recv()
        except EOFError:
            break
        if message is None:
            break
        sys.path[:] = message[0]
        conn.send(_run_task(spec.rank, message[1]))
    if dist.is_initialized():  # a task may have destroyed it
        dist.destroy_process_group()
    # Run the exit hooks a normal exit would (coverage saves its data there), then skip the
    # interpreter teardown of torch, which costs ~0.5 s per rank.
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _exit_when_orphaned(parent_pid: int) -> None:
    """Kill this rank if the parent died without closing the pool (it may be stuck in gloo)."""
    while os.getppid() == parent_pid:
        time.sleep(1.0)
    os._exit(3)


def _run_task(rank: int, payload: bytes) -> _Reply:
    """Unpickle and run one task, recording its warnings; never raises."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            fn, args, kwargs = pickle.loads(payload)
            reply = _Reply(True, pickle.dumps(fn(*args, **kwargs)), "", ())
        except BaseException as exc:  # SystemExit from a task must not end the rank
            name = type(exc).__qualname__
            lines = traceback.format_exception(type(exc), exc, exc.__traceback__)
            reply = _Reply(False, b"", f"{name}: {exc}\n{''.join(lines)}", ())
            traceback.print_exc()  # and the warnings too, so that log tails show them
            for w in caught:
                print(warnings.formatwarning(w.message, w.category, w.filename, w.lineno), end="")
    seen: dict[tuple[str, str, str, int], _RankWarning] = {}
    for w in caught:
        try:
            category = pickle.dumps(w.category)
        except Exception:
            category = b""
        packed = _RankWarning(
            rank, category, w.category.__qualname__, str(w.message), w.filename, w.lineno
        )
        seen.setdefault((packed.category_name, packed.message, w.filename, w.lineno), packed)
    sys.stdout.flush()
    sys.stderr.flush()
    return _Reply(reply.ok, reply.result, reply.error, tuple(seen.values()))


# ---------------------------------------------------------------- parent side


class SPMDPool:
    """``world_size`` real gloo ranks, spawned lazily on the first :meth:`run` and kept warm.

    Why: equivalence tests run many small examples; reusing one set of ranks makes each cost
    milliseconds instead of a process launch. Use it as a context manager or call :meth:`close`.

    Example::

        with SPMDPool(world_size=2, timeout_s=30.0) as pool:
            assert pool.run(rank_sum) == [1.0, 1.0]
    """

    def __init__(
        self, world_size: int, timeout_s: float = 120.0, *, start_timeout_s: float = 120.0
    ) -> None:
        if not 1 <= world_size <= _MAX_WORLD:
            raise SPMDError(f"world_size must be in 1..{_MAX_WORLD}, got {world_size}")
        if timeout_s <= 0 or start_timeout_s <= 0:
            raise SPMDError(f"timeouts must be positive, got {timeout_s}, {start_timeout_s}")
        self.world_size = world_size
        self.timeout_s = float(timeout_s)
        self.start_timeout_s = float(start_timeout_s)
        self._res = _Resources()
        self._closed = False
        self._lock = threading.RLock()
        self._starts = 0
        self._tasks_run = 0
        self._last_start_s = 0.0
        # Runs on close(), when the pool is garbage collected, and at exit *before*
        # multiprocessing joins live non-daemon children (which would wait forever on our ranks).
        self._finalizer = multiprocessing.util.Finalize(
            self, _release, args=(self._res, True), exitpriority=10
        )

    def __enter__(self) -> SPMDPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran; a closed pool refuses tasks."""
        return self._closed

    @property
    def stats(self) -> SPMDPoolStats:
        """A snapshot of this pool's counters."""
        return SPMDPoolStats(self._starts, self._tasks_run, self._last_start_s)

    def log_path(self, rank: int) -> Path:
        """The file that rank ``rank``'s stdout and stderr go to (kept across restarts)."""
        if not 0 <= rank < self.world_size:
            raise SPMDError(f"rank {rank} is not in 0..{self.world_size - 1}")
        return self._workdir() / f"rank{rank}.log"

    def run(
        self, fn: Callable[..., T], /, *args: Any, _timeout_s: float | None = None, **kwargs: Any
    ) -> list[T]:
        """Call ``fn(*args, **kwargs)`` on every rank; return the results in rank order.

        Example::

            per_rank = pool.run(rank_sum, _timeout_s=10.0)
        """
        task = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"
        payload = _pickle_task(task, fn, args, kwargs)
        timeout = self.timeout_s if _timeout_s is None else float(_timeout_s)
        with self._lock:
            self.start()
            self._tasks_run += 1
            self._res.busy = True
            try:
                replies, failures, pending = self._dispatch(payload, timeout)
            except BaseException:  # e.g. KeyboardInterrupt while ranks are mid-task
                self._kill()
                raise
            finally:
                self._res.busy = False
            if self._closed:
                self._kill()
                raise SPMDError(f"the pool was closed while task {task} was running")
            if failures or pending:
                logs = self._log_tails(sorted(set(failures) | set(pending)))
                self._kill()
                if failures:
                    message = _failure_message(task, failures, pending, logs)
                    raise SPMDTaskError(message, failures, task)
                raise SPMDTimeoutError(
                    f"task {task} timed out after {timeout:g} s: ranks {list(pending)} did not "
                    f"answer (a mismatched collective?); the pool was killed and will restart."
                    f"{logs}",
                    pending,
                    task,
                    timeout,
                )
        results: list[T] = []
        for rank in range(self.world_size):
            try:
                results.append(pickle.loads(replies[rank].result))
            except Exception as exc:
                raise SPMDError(f"cannot unpickle rank {rank}'s result of {task}: {exc}") from exc
        for rank in range(self.world_size):
            for w in replies[rank].warnings:
                _reissue(w)
        return results

    def start(self) -> None:
        """Spawn the ranks now if they are not running (``run`` does it lazily)."""
        with self._lock:
            if self._closed:
                raise SPMDError("this SPMDPool is closed; create a new one or use get_pool()")
            if self._res.ranks and all(r.process.is_alive() for r in self._res.ranks):
                return
            self._kill()
            self._spawn()

    def restart(self) -> None:
        """Kill the ranks and spawn fresh ones."""
        with self._lock:
            self._kill()
            self.start()

    def close(self) -> None:
        """Stop the ranks and remove the pool's temp dir; a task in flight elsewhere is killed."""
        locked = self._lock.acquire(timeout=0.5)  # do not wait for a task in another thread
        try:
            self._closed = True
            self._finalizer()
        finally:
            if locked:
                self._lock.release()

    # -- private helpers

    def _workdir(self) -> Path:
        if self._res.dir is None:
            if self._closed:
                raise SPMDError("this SPMDPool is closed")
            prefix = f"meshtrain-spmd-w{self.world_size}-"
            self._res.dir = Path(tempfile.mkdtemp(prefix=prefix))
        return self._res.dir

    def _spawn(self) -> None:
        began = time.monotonic()
        self._starts += 1
        for stale in self._workdir().glob("store*"):  # a killed group leaves its FileStore
            stale.unlink(missing_ok=True)
        store = self._workdir() / f"store{self._starts}"
        port = _free_port()
        ctx = multiprocessing.get_context("spawn")
        for rank in range(self.world_size):
            spec = _RankSpec(
                rank, self.world_size, str(store), str(self.log_path(rank)), port, os.getpid()
            )
            parent_end, child_end = ctx.Pipe()
            process = ctx.Process(
                target=_worker_main, args=(spec, child_end), name=f"meshtrain-spmd-rank{rank}"
            )
            process.start()
            child_end.close()
            self._res.ranks.append(_Rank(process, parent_end))
        failures, pending = self._await_start()
        if self._closed:
            self._kill()
            raise SPMDError("the pool was closed while its ranks were starting")
        if failures or pending:
            logs = self._log_tails(sorted(set(failures) | set(pending)))
            self._kill()
            raise SPMDError(
                f"could not start {self.world_size} gloo ranks after "
                f"{time.monotonic() - began:.0f} s: failed {failures}; "
                f"{_start_stall(pending, self.start_timeout_s, port)}{logs}"
            )
        self._last_start_s = time.monotonic() - began

    def _await_start(self) -> tuple[dict[int, str], dict[int, str]]:
        """Wait while the ranks make progress: every report (running, torch imported, joined)
        restarts a clock of ``start_timeout_s``, so a slow but moving start on a loaded machine
        succeeds and a stuck one fails after ``start_timeout_s`` of silence. Returns the failed
        ranks' errors and the phase of each rank that did not join."""
        ranks = list(self._res.ranks)
        phase = dict.fromkeys(range(len(ranks)), "spawned")
        failures: dict[int, str] = {}
        deadline = time.monotonic() + self.start_timeout_s
        while not failures and any(p != "joined" for p in phase.values()):
            waiting: dict[Any, int] = {}
            for rank, r in enumerate(ranks):
                if phase[rank] != "joined":
                    waiting[r.conn] = waiting[r.process.sentinel] = rank
            remaining = deadline - time.monotonic()
            ready = mpc.wait(list(waiting), timeout=remaining) if remaining > 0 else []
            if not ready:
                break
            for rank in sorted({waiting[obj] for obj in ready}):
                message = _receive(ranks[rank].conn)
                if isinstance(message, _Progress):
                    phase[rank] = message.phase
                elif isinstance(message, _Reply) and message.ok:
                    phase[rank] = "joined"
                elif isinstance(message, _Reply):
                    failures[rank] = message.error
                else:
                    ranks[rank].process.join(1.0)
                    code = ranks[rank].process.exitcode
                    failures[rank] = f"rank process died (exit code {code})"
            deadline = time.monotonic() + self.start_timeout_s  # progress: the clock restarts
        pending = {r: p for r, p in phase.items() if p != "joined" and r not in failures}
        return failures, pending

    def _dispatch(
        self, payload: bytes, timeout: float
    ) -> tuple[dict[int, _Reply], dict[int, str], tuple[int, ...]]:
        message = (list(sys.path), payload)
        for r in self._res.ranks:
            with contextlib.suppress(OSError):  # a dead rank: _collect reports its sentinel
                r.conn.send(message)
        return self._collect(timeout)

    def _collect(self, timeout: float) -> tuple[dict[int, _Reply], dict[int, str], tuple[int, ...]]:
        """Wait for one reply per rank: ``(ok replies, failures, ranks that stayed silent)``.

        Once any rank failed or died, the others only get a short grace: they may be blocked
        forever in a collective that the failed rank never entered.
        """
        ranks = list(self._res.ranks)  # close() from another thread may clear the list
        replies: dict[int, _Reply] = {}
        failures: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        while len(replies) + len(failures) < len(ranks):
            waiting: dict[Any, int] = {}
            for rank, r in enumerate(ranks):
                if rank not in replies and rank not in failures:
                    waiting[r.conn] = waiting[r.process.sentinel] = rank
            remaining = deadline - time.monotonic()
            ready = mpc.wait(list(waiting), timeout=remaining) if remaining > 0 else []
            if not ready:
                break
            for rank in sorted({waiting[obj] for obj in ready}):
                conn, process = ranks[rank].conn, ranks[rank].process
                try:
                    reply = conn.recv() if conn.poll() else None
                except (EOFError, OSError):
                    reply = None
                if isinstance(reply, _Reply) and reply.ok:
                    replies[rank] = reply
                elif isinstance(reply, _Reply):
                    failures[rank] = reply.error
                else:
                    process.join(1.0)
                    failures[rank] = f"rank process died (exit code {process.exitcode})"
            if failures:
                deadline = min(deadline, time.monotonic() + _FAILURE_GRACE_S)
        done = set(replies) | set(failures)
        return replies, failures, tuple(r for r in range(len(ranks)) if r not in done)

    def _kill(self) -> None:
        _kill_ranks(self._res.ranks)

    def _log_tails(self, ranks: list[int]) -> str:
        parts = []
        for rank in ranks:
            try:
                with self.log_path(rank).open(
                    "rb"
                ) as log:  # logs grow across tasks (one file per pool start): read the end
                    log.seek(max(0, log.seek(0, os.SEEK_END) - 64 * 1024))
                    text = log.read().decode(errors="replace")
            except OSError:
                continue
            tail = "\n".join(text.splitlines()[-_LOG_TAIL_LINES:])
            parts.append(f"\n--- rank {rank} log ({self.log_path(rank)}), last lines:\n{tail}")
        return "".join(parts)


def _receive(conn: mpc.Connection) -> object:
    """The next message on ``conn`` if one is there (``None``: closed or nothing to read)."""
    try:
        return conn.recv() if conn.poll() else None
    except (EOFError, OSError):
        return None


def _start_stall(pending: dict[int, str], idle_s: float, port: int) -> str:
    """Which ranks stalled in which phase, and the likely cause.

    Example:
        >>> _start_stall({1: "torch imported"}, 120.0, 29500).split(":")[0]
        'no progress for 120 s (rank 1 torch imported)'
    """
    if not pending:
        return ""
    where = ", ".join(f"rank {rank} {phase}" for rank, phase in sorted(pending.items()))
    if any(phase in ("spawned", "running") for phase in pending.values()):
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
        cause = (
            f"still importing torch — the machine is overloaded (load average {load:.1f} on "
            f"{os.cpu_count()} cores): run fewer tests at once, or allow a longer start "
            "(meshtrain check --start-timeout S; SPMDPool's start_timeout_s)"
        )
    else:
        cause = (
            "every rank imported torch but the gloo rendezvous did not complete — a rank cannot "
            f"reach the FileStore or 127.0.0.1:{port} (a full temporary directory, a firewall, "
            "or another process on the port)"
        )
    return f"no progress for {idle_s:g} s ({where}): {cause}."


def _kill_ranks(ranks: list[_Rank]) -> None:
    for r in ranks:
        if r.process.is_alive():
            r.process.kill()
    for r in ranks:
        r.process.join(_JOIN_S)  # reaps: no zombies
        r.conn.close()
    ranks.clear()


def _release(res: _Resources, polite: bool) -> None:
    """Stop a pool's ranks (asking idle ones to exit first) and remove its temp dir."""
    if os.getpid() != res.owner:
        return
    if polite and not res.busy:  # idle ranks exit normally (atexit hooks, coverage data)
        for r in res.ranks:
            with contextlib.suppress(OSError):
                r.conn.send(None)
        deadline = time.monotonic() + _JOIN_S
        for r in res.ranks:
            r.process.join(max(0.0, deadline - time.monotonic()))
    _kill_ranks(res.ranks)
    if res.dir is not None:
        shutil.rmtree(res.dir, ignore_errors=True)
        res.dir = None


def _pickle_task(task: str, fn: Callable[..., Any], args: Any, kwargs: Any) -> bytes:
    try:
        pickle.dumps(fn)
    except Exception as exc:
        raise SPMDError(
            f"cannot send task {task} to the ranks: tasks are pickled by reference, so the function "
            f"must be defined at module level of an importable module (not a lambda, a nested "
            f"function or a bound method of an unpicklable object). Pickle said: {exc}"
        ) from exc
    try:
        return pickle.dumps((fn, args, kwargs))
    except Exception as exc:
        raise SPMDError(f"cannot pickle the arguments of task {task}: {exc}") from exc


def _failure_message(
    task: str, failures: dict[int, str], pending: tuple[int, ...], logs: str
) -> str:
    lines = [f"task {task} failed on {len(failures)} rank(s) {sorted(failures)}:"]
    lines += [f"--- rank {rank}: {failures[rank]}" for rank in sorted(failures)]
    if pending:
        lines.append(f"ranks {list(pending)} had not answered (likely blocked in a collective).")
    lines.append("The pool was killed and will restart on the next run().")
    return "\n".join(lines) + logs


def _reissue(w: _RankWarning) -> None:
    """Warn in the parent, so ``filterwarnings = error`` fails a test on a rank's warning."""
    try:
        category = pickle.loads(w.category) if w.category else None
        instance = category(f"[rank {w.rank}] {w.message}") if category else None
    except Exception:
        instance = None
    if not isinstance(instance, Warning):
        instance = UserWarning(f"[rank {w.rank}] {w.category_name}: {w.message}")
    warnings.warn_explicit(instance, type(instance), w.filename, w.lineno)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# ---------------------------------------------------------------- the shared-pool registry

_SHARED_POOLS: dict[int, SPMDPool] = {}


def get_pool(world_size: int, *, start_timeout_s: float | None = None) -> SPMDPool:
    """The process-wide pool for ``world_size``, created on first use, closed at exit;
    ``start_timeout_s`` (when given) is how long its next rank start may go without progress.

    Example::

        assert get_pool(2).run(rank_sum) == [1.0, 1.0]
    """
    pool = _SHARED_POOLS.get(world_size)
    if pool is None or pool.closed:
        pool = _SHARED_POOLS[world_size] = SPMDPool(world_size)
    if start_timeout_s is not None:
        if start_timeout_s <= 0:
            raise SPMDError(f"start_timeout_s must be positive, got {start_timeout_s}")
        pool.start_timeout_s = float(start_timeout_s)
    return pool


def shared_pool_stats() -> dict[int, SPMDPoolStats]:
    """The counters of every open pool :func:`get_pool` handed out, by world size.

    A pool with more than one start was killed and respawned (a task failed or timed out).

    Example::

        get_pool(2).run(rank_sum)
        assert shared_pool_stats()[2].tasks_run >= 1
    """
    return {size: pool.stats for size, pool in sorted(_SHARED_POOLS.items()) if not pool.closed}


def close_pools() -> None:
    """Close every pool handed out by :func:`get_pool`."""
    while _SHARED_POOLS:
        _SHARED_POOLS.popitem()[1].close()


atexit.register(close_pools)
