"""Starting and supervising ranks: under ``torchrun`` (one node or many), started locally through
torchrun's agent, or joined through a store (the SPMD test runner) — :func:`init_distributed` is
the one function that starts the process group.

``meshtrain train`` run by ``torchrun`` finds its rank in the environment and joins the process
group. Run directly, it runs torchrun's elastic agent in its own process (:func:`run_agent`) with
``--nproc`` local ranks (``--nnodes``/``--node-rank``/``--rdzv-endpoint`` make this machine one
node of several; ``--max-restarts`` restarts failed ranks), so a laptop and a cluster run the same
command, and one signal to the launcher reaches every rank: the agent forwards SIGTERM, SIGINT
and SIGHUP to each rank's process group. Ranks follow their launcher (:func:`exit_with_parent`):
if it dies, even by SIGKILL, they stop after their current step. Nothing here imports torch at
module level, so the launcher can refuse a bad command line before paying for it.

Exit statuses (:data:`EXIT_CODES`): 0 done, 1 a rank failed (a crash: the summary names the first
rank that failed and its own first error line), 2 a meshtrain error (a bad recipe, a busy run
directory, a non-finite budget spent), 4 a rank failed again after every ``--max-restarts``
restart, 75 stopped on request after saving a checkpoint — run the same command to resume, 124
a rank stopped making progress (the watchdog ended the job).

Example:
    >>> torchrun_command(["train", "debug"], nproc=4)[3:6]
    ['--nproc-per-node=4', '--nnodes=1', '--standalone']
    >>> torchrun_command(["train", "debug"], nproc=2, nnodes=2, node_rank=1,
    ...                  rdzv_endpoint="10.0.0.1:29500")[5:8]
    ['--node-rank=1', '--rdzv-backend=static', '--rdzv-endpoint=10.0.0.1:29500']
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import select
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from meshtrain.errors import MeshtrainError

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

#: Environment variables torchrun sets for every worker.
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
#: Where a launcher asks its ranks to report how they ended (a directory per node).
REPORT_VARIABLE = "MESHTRAIN_RANK_REPORTS"
#: Where ranks write their stacks when the watchdog asks (``<run_dir>/logs``).
LOG_DIR_VARIABLE = "MESHTRAIN_LOG_DIR"
BEAT_PREFIX = "beat-"
#: How long ranks get to finish a step and save after a stop signal (torchrun's own variable).
STOP_TIMEOUT_VARIABLE = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_ERROR = 2
EXIT_RESTARTS_SPENT = 4
EXIT_STOPPED = 75  # sysexits' EX_TEMPFAIL: stopped for now, try again
EXIT_HUNG = 124  # as timeout(1): a rank stopped making progress
EXIT_CODES = {
    EXIT_OK: "trained to the last step (or nothing was left to train)",
    EXIT_FAILED: "a rank failed: it died or raised an unexpected error (the summary names the "
    "first one, its first error line and the log file holding its traceback)",
    EXIT_ERROR: "a meshtrain error: a bad recipe or command line, a busy run directory, a spent "
    "non-finite budget, a checkpoint that cannot be saved or loaded, bad token data",
    EXIT_RESTARTS_SPENT: "a rank failed again after every --max-restarts restart was used",
    EXIT_STOPPED: "stopped by a signal after saving a checkpoint; run the same command to resume",
    EXIT_HUNG: "a rank stopped making progress: the watchdog named it, dumped the stacks and "
    "ended the job; the newest intact checkpoint is where the next run resumes",
}


def under_torchrun() -> bool:
    """True in a process started by ``torchrun`` (or anything that sets its variables)."""
    return all(name in os.environ for name in TORCHRUN_VARIABLES)


def init_distributed(
    *,
    backend: str | None = None,
    timeout_s: float = 600.0,
    store: dist.Store | None = None,
    rank: int | None = None,
    world_size: int | None = None,
) -> torch.device:
    """Join (or create) the default process group; returns this rank's device. The one place
    meshtrain starts its runtime: the CLI, the SPMD test runner and users' scripts call it, then
    describe meshes with :func:`~meshtrain.make_mesh`. Does nothing when the group exists.

    Under ``torchrun`` (its variables set) it joins the job's rendezvous; with ``store``,
    ``rank`` and ``world_size`` it joins through that store; alone (no launcher) it creates a
    one-rank group, so a script runs unchanged on one device. The backend is NCCL on GPUs
    (the device is ``cuda:LOCAL_RANK``), gloo otherwise.

    Example (a user's script, run with ``torchrun --nproc_per_node 4 script.py``)::

        device = mt.init_distributed()
        mesh = mt.make_mesh(dp=-1, tp=2)
    """
    import torch
    import torch.distributed as dist

    if torch.cuda.is_available() and backend in (None, "nccl"):
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    backend = backend or ("nccl" if device.type == "cuda" else "gloo")
    if dist.is_initialized():
        return device
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is not None:
        if rank is None or world_size is None:
            raise MeshtrainError(
                "init_distributed(store=...) needs this process's rank and the world_size too."
            )
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size, timeout=timeout
        )
    elif under_torchrun():
        # torchrun's env:// rendezvous, its store keys kept apart per restart: the agent's store
        # outlives a restart, and a restarted rank must not read a dead rank's gloo address.
        store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        store = dist.PrefixStore(f"meshtrain/attempt_{attempt}", store)
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size, timeout=timeout
        )
    elif int(os.environ.get("WORLD_SIZE", "1")) == 1:
        dist.init_process_group(
            backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
        )
    else:
        missing = [name for name in TORCHRUN_VARIABLES if name not in os.environ]
        raise MeshtrainError(
            f"WORLD_SIZE={os.environ['WORLD_SIZE']} is set but the rest of torchrun's "
            f"environment is not ({', '.join(missing)} unset): start the ranks with `torchrun "
            "--nproc_per_node N script.py` (or `meshtrain train RECIPE --nproc N`)."
        )
    return device


def torchrun_arguments(
    args: Sequence[str],
    *,
    nproc: int,
    nnodes: int = 1,
    node_rank: int = 0,
    rdzv_endpoint: str | None = None,
    max_restarts: int = 0,
) -> list[str]:
    """torchrun's arguments for running ``python -m meshtrain <args>`` on ``nproc`` local ranks
    (one node standalone, or node ``node_rank`` of ``nnodes`` meeting at ``rdzv_endpoint``, node
    0's address: node ``R`` holds global ranks ``R·nproc`` to ``R·nproc + nproc - 1``), failed
    ranks restarted up to ``max_restarts`` times."""
    arguments = [f"--nproc-per-node={nproc}"]
    if nnodes == 1 and rdzv_endpoint is None:
        arguments += ["--nnodes=1", "--standalone"]
    else:
        if rdzv_endpoint is None:
            raise MeshtrainError(
                f"--nnodes={nnodes} needs --rdzv-endpoint HOST:PORT (the address every node "
                "can reach, usually node 0's), e.g. --rdzv-endpoint 10.0.0.1:29500."
            )
        if not 0 <= node_rank < nnodes:
            raise MeshtrainError(
                f"--node-rank={node_rank} is not in 0..{nnodes - 1} (--nnodes={nnodes}): give "
                "each node a distinct rank below the node count."
            )
        # Static rendezvous: node R's ranks are R·nproc … R·nproc + nproc - 1, and node 0 hosts
        # the store at the endpoint (c10d rendezvous would number nodes in joining order).
        arguments += [
            f"--nnodes={nnodes}",
            f"--node-rank={node_rank}",
            "--rdzv-backend=static",
            f"--rdzv-endpoint={rdzv_endpoint}",
        ]
    if max_restarts:
        arguments.append(f"--max-restarts={max_restarts}")
    return [*arguments, "-m", "meshtrain", *args]


def torchrun_command(args: Sequence[str], **options: Any) -> list[str]:
    """The ``torchrun`` command line that does what :func:`run_agent` does with the same
    :func:`torchrun_arguments` (``options`` are its keywords: ``nproc``, ``nnodes``, ...; what to
    type to run the ranks under torchrun yourself)."""
    return [sys.executable, "-m", "torch.distributed.run", *torchrun_arguments(args, **options)]


# ----------------------------------------------------------------------- the launcher


class StopRequested(BaseException):
    """A stop signal arrived before training started, when there is nothing to save: the rank
    unwinds (releasing its locks) and exits with :data:`EXIT_STOPPED`. A ``BaseException``, like
    ``KeyboardInterrupt``, so no ``except Exception`` swallows it."""

    def __init__(self, number: int) -> None:
        super().__init__(number)
        self.number = number

    @property
    def signal_name(self) -> str:
        """``SIGTERM``, ``SIGINT``, ..."""
        return signal.Signals(self.number).name


@dataclass(frozen=True)
class RankReport:
    """How one rank ended, written for its launcher: the exit status it chose and why."""

    rank: int
    exit_code: int
    event: str  # "done", "stopped", "error", "crash", "lost contact"
    message: str = ""  # what the launcher prints (once for the ranks that say the same)
    pid: int = 0
    attempt: int = 0  # torchrun's restart count: a report from an earlier attempt is stale
    time: float = 0.0  # when the rank ended (time.monotonic(): one clock for every process of
    # the host, which no step of the wall clock reorders): the first failure is the cause


def report_exit(exit_code: int, event: str, message: str = "") -> bool:
    """Tell this node's launcher how this rank ends, when it asked (through
    :data:`REPORT_VARIABLE`); True when told. A rank that dies without a report crashed."""
    directory = os.environ.get(REPORT_VARIABLE)
    if not directory:
        return False
    rank = int(os.environ.get("RANK", "0"))
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    report = RankReport(rank, exit_code, event, message, os.getpid(), attempt, time.monotonic())
    try:
        path = Path(directory) / f"attempt-{attempt}-rank-{rank}.json"
        path.write_text(json.dumps(asdict(report)))
    except OSError:
        return False
    return True


def refuse_restart() -> None:
    """A rank that failed for a reason a restart cannot fix (a meshtrain error: the same recipe
    fails the same way) asks torchrun's agent, its parent, to stop the job instead of restarting
    it; the agent then stops every local rank. Does nothing when no restart is left."""
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    if restarts > int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")):
        with contextlib.suppress(OSError):
            os.kill(os.getppid(), signal.SIGTERM)


def run_agent(
    arguments: Sequence[str],
    *,
    nproc: int,
    stop_timeout_s: int | None = None,
    hang_timeout_s: float = 0.0,
    log_dir: Path | None = None,
) -> int:
    """Run torchrun's elastic agent in this process with :func:`torchrun_arguments` and return
    this node's exit status (:data:`EXIT_CODES`).

    The agent forwards SIGTERM, SIGINT and SIGHUP to every rank's process group and gives them
    ``stop_timeout_s`` seconds to finish their step and save before it kills them (default:
    :data:`STOP_TIMEOUT_VARIABLE` when set, else 300). Ranks report
    how they ended (:func:`report_exit`), so a stop, a meshtrain error and a crash each end in
    one line and their own status instead of torchrun's tracebacks. With ``hang_timeout_s``, a
    :class:`Watchdog` ends the job when a rank stops beating for that long (exit status
    :data:`EXIT_HUNG`); ``log_dir`` receives the stuck ranks' stacks.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    reports = Path(tempfile.mkdtemp(prefix="meshtrain-ranks-"))
    os.environ[REPORT_VARIABLE] = str(reports)
    if stop_timeout_s is not None:
        os.environ[STOP_TIMEOUT_VARIABLE] = str(stop_timeout_s)
    os.environ.setdefault(STOP_TIMEOUT_VARIABLE, "300")
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default, without its banner
    _quiet_agent_logs()
    restarts = max(
        [
            0,
            *(
                int(item.split("=", 1)[1])
                for item in arguments
                if item.startswith("--max-restarts=")
            ),
        ]
    )
    began = time.monotonic()
    if log_dir is not None:
        os.environ[LOG_DIR_VARIABLE] = str(log_dir)
    watchdog = Watchdog(reports, hang_timeout_s, log_dir) if hang_timeout_s > 0 else None
    if watchdog is not None:
        watchdog.start()
    try:
        try:
            run(parse_args(list(arguments)))
        except SignalException as err:
            if watchdog is not None and watchdog.verdict:
                return _after_hang(watchdog.verdict)
            found = _read_reports(reports)
            _print_messages(found)
            return _after_signal(signal.Signals(err.sigval), found, nproc, time.monotonic() - began)
        except ChildFailedError as err:
            if watchdog is not None and watchdog.verdict:
                return _after_hang(watchdog.verdict)
            found = _read_reports(reports)
            _print_messages(found)
            return _after_failure(err.failures, found, restarts)
        return EXIT_OK
    finally:
        if watchdog is not None:
            watchdog.stop()
        shutil.rmtree(reports, ignore_errors=True)
        os.environ.pop(REPORT_VARIABLE, None)


def _after_hang(verdict: str) -> int:
    _say(verdict)
    return EXIT_HUNG


class Watchdog(threading.Thread):
    """The launcher's progress watchdog: reads the ranks' heartbeats
    (:mod:`meshtrain.train.heartbeat`) every few seconds; when a rank has written no new one for
    ``timeout_s`` and its process still exists, it asks the other ranks for their stacks
    (``SIGUSR1``: they write them to ``log_dir``), kills every rank of the attempt (SIGKILL: a
    checkpoint is published whole or not at all, so the newest intact one stays) and records the
    :attr:`verdict` naming the rank, its step and its process state. A rank that is slow but
    alive keeps beating and is never killed.

    Time is the watchdog's own monotonic clock, from when it first saw each beat: the wall
    clock's steps (NTP, a resumed VM) mean nothing to it, and a pause of the whole job (the
    watchdog's polls stop too: SIGSTOP of the job, a suspended machine) starts every rank's
    allowance afresh instead of counting the pause against the ranks."""

    def __init__(self, reports: Path, timeout_s: float, log_dir: Path | None) -> None:
        super().__init__(name="meshtrain-watchdog", daemon=True)
        self.reports, self.timeout_s, self.log_dir = reports, timeout_s, log_dir
        self.verdict = ""
        self.every_s = min(5.0, timeout_s / 4)
        self._stopped = threading.Event()
        self._seen: dict[int, tuple[tuple[int, int], float]] = {}  # rank → (pid, beat), since

    def stop(self) -> None:
        self._stopped.set()

    def run(self) -> None:
        polled = time.monotonic()
        while not self._stopped.wait(self.every_s):
            now = time.monotonic()
            if now - polled > 2 * self.every_s + 1.0:  # the watchdog itself was held: a pause
                self._seen.clear()
            polled = now
            beats = read_beats(self.reports)
            stale = self.stale(beats, now)
            if stale:
                self._end(stale, beats, now)

    def stale(self, beats: Mapping[int, Any], now: float) -> list[int]:
        """The ranks whose newest beat the watchdog first saw over ``timeout_s`` ago and whose
        process still exists (a rank that exited is the launcher's to report)."""
        for rank, beat in beats.items():
            key = (beat["pid"], beat.get("beat", beat["step"]))
            if self._seen.get(rank, (None, 0.0))[0] != key:
                self._seen[rank] = (key, now)
        return sorted(
            rank
            for rank, beat in beats.items()
            if now - self._seen[rank][1] > self.timeout_s and _process_state(beat["pid"])
        )

    def _end(self, stale: list[int], beats: Mapping[int, Any], now: float) -> None:
        live = [beat["pid"] for rank, beat in beats.items() if rank not in stale]
        for pid in live:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGUSR1)
        time.sleep(1.0)  # faulthandler writes at once; give the files a moment
        first = beats[stale[0]]
        state = _process_state(first["pid"])
        stacks = (
            f"; the other ranks' stacks are in {self.log_dir}/stacks-rank-*.txt"
            if live and self.log_dir is not None
            else ""
        )
        silent_s = now - self._seen[stale[0]][1]
        self.verdict = (
            f"rank {', '.join(map(str, stale))} stopped making progress after step "
            f"{first['step']}: no heartbeat for {silent_s:.0f} s (the watchdog allows "
            f"{self.timeout_s:.0f} s: train.heartbeat_timeout); its process is {state}{stacks}. "
            "The job was ended; the newest intact checkpoint is where the next run resumes "
            "(`meshtrain checkpoints RUN_DIR` lists them)."
        )
        for beat in beats.values():
            with contextlib.suppress(OSError):
                os.kill(beat["pid"], signal.SIGKILL)


def beat_path(directory: str | os.PathLike[str], rank: int, attempt: int) -> Path:
    """Where rank ``rank`` of restart ``attempt`` writes its heartbeat
    (:mod:`meshtrain.train.heartbeat`)."""
    return Path(directory) / f"{BEAT_PREFIX}attempt-{attempt}-rank-{rank}.json"


def read_beats(directory: Path) -> dict[int, dict[str, Any]]:
    """The newest attempt's heartbeats in ``directory``, by rank."""
    found = []
    for path in directory.glob(f"{BEAT_PREFIX}attempt-*-rank-*.json"):
        with contextlib.suppress(OSError, ValueError, KeyError, IndexError):
            attempt = int(path.name.split("-")[2])
            found.append((attempt, json.loads(path.read_text())))
    newest = max((attempt for attempt, _ in found), default=0)
    return {beat["rank"]: beat for attempt, beat in found if attempt == newest}


def _process_state(pid: int) -> str:
    """How the process ``pid`` is, in words ("" when it is gone), from ``/proc`` on Linux."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except OSError:
            return ""
        return "alive but not beating"
    states = {
        "T": "stopped by a signal (SIGSTOP or a debugger)",
        "t": "stopped by a debugger",
        "D": "waiting on the kernel (uninterruptible I/O)",
        "Z": "a zombie (exited)",
    }
    if fields[0] == "Z":
        return ""
    return states.get(fields[0], "running but not beating (stuck holding the interpreter?)")


def _quiet_agent_logs() -> None:
    """The agent's own log lines ("Sending process 123 closing signal SIGTERM", "failed
    (exitcode: -9) local_rank: 1", ...) are what :func:`run_agent` replaces with one line. Each
    torchrun module sets its logger's level when imported, so this runs after the imports."""
    for name, logger in list(logging.root.manager.loggerDict.items()):
        if name.startswith(("torch.distributed.elastic", "torch.distributed.run")) and isinstance(
            logger, logging.Logger
        ):
            logger.setLevel(logging.CRITICAL)


def _read_reports(directory: Path) -> dict[int, RankReport]:
    """The reports of the last attempt that wrote any (restarts start new attempts)."""
    found: list[RankReport] = []
    for path in directory.glob("attempt-*-rank-*.json"):
        with contextlib.suppress(OSError, ValueError, TypeError):
            found.append(RankReport(**json.loads(path.read_text())))
    last = max((report.attempt for report in found), default=0)
    return {report.rank: report for report in found if report.attempt == last}


def _print_messages(reports: Mapping[int, RankReport]) -> None:
    """Each distinct error the ranks reported, once, with the ranks that raised it; a lost
    peer is left to the summary line."""
    ranks_of: dict[str, list[int]] = {}
    for rank, report in sorted(reports.items()):
        if report.message and report.event == "error":
            text = report.message.split("] ", 1)[-1]  # without the rank's own "[rank N] "
            ranks_of.setdefault(text, []).append(rank)
    for text, ranks in ranks_of.items():
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
        with contextlib.suppress(OSError):
            print(f"[{who}] {text}", file=sys.stderr, flush=True)


def _after_signal(
    number: signal.Signals, reports: dict[int, RankReport], nproc: int, elapsed_s: float = 0.0
) -> int:
    """The status after a signal stopped the job: what the ranks reported decides; only ranks
    that did not report were killed, and the line says which, and why."""
    codes = {report.exit_code for report in reports.values()}
    if EXIT_ERROR in codes:
        return EXIT_ERROR  # the ranks printed their error; they asked the agent to stop
    everyone = len(reports) >= nproc
    if everyone and codes <= {EXIT_OK, EXIT_STOPPED}:
        return EXIT_STOPPED if EXIT_STOPPED in codes else EXIT_OK  # rank 0 said where to resume
    # A rank stopped during start-up leaves its peers without a partner, but no step had run.
    if everyone and EXIT_STOPPED in codes and codes <= {EXIT_STOPPED, EXIT_FAILED}:
        return EXIT_STOPPED
    timeout = float(os.environ.get(STOP_TIMEOUT_VARIABLE, "300"))
    silent = sorted(set(range(nproc)) - set(reports)) if nproc else []
    who = ", ".join(map(str, silent)) or "some"
    why = (
        f"did not stop within {timeout:.0f} s (--stop-timeout) and were killed"
        if elapsed_s >= timeout
        else "ended without saying how (killed, or crashed while stopping)"
    )
    _say(
        f"{number.name} reached the ranks; rank(s) {who} {why}. The newest intact checkpoint is "
        "where the next run resumes (`meshtrain checkpoints RUN_DIR` lists them)."
    )
    return EXIT_FAILED


def _after_failure(
    failures: Mapping[int, object], reports: Mapping[int, RankReport], restarts: int = 0
) -> int:
    """A rank failed: the reports decide; the line names the rank that failed first with its
    own first error line, not the ranks that lost contact with it afterwards."""
    reports = {
        rank: report
        for rank, report in reports.items()
        if rank in failures and getattr(failures[rank], "pid", report.pid) == report.pid
    }  # only what the failed processes themselves reported
    codes = {reports[rank].exit_code for rank in failures if rank in reports}
    if all(rank in reports for rank in failures):
        if EXIT_ERROR in codes:
            return EXIT_ERROR
        if codes == {EXIT_STOPPED}:
            return EXIT_STOPPED
    first = _first_failure(failures, reports)
    attempt = max((report.attempt for report in reports.values()), default=0)
    if restarts and attempt >= restarts:
        _say(
            f"{first}. The ranks were restarted {restarts} time(s) and failed again, so they are "
            "not restarted: fix the cause, then run the same command to resume from the newest "
            "intact checkpoint."
        )
        return EXIT_RESTARTS_SPENT
    advice = "" if restarts else ", or pass --max-restarts N to resume automatically"
    _say(f"{first}. Run the same command to resume from the newest intact checkpoint{advice}.")
    return EXIT_FAILED


def _first_failure(failures: Mapping[int, object], reports: Mapping[int, RankReport]) -> str:
    """The rank whose failure came first and how: its own report (a crash with its first error
    line) before the ranks that lost contact with it; a rank that died without a report by how
    it died."""
    causes = sorted(
        (report.time, rank) for rank, report in reports.items() if report.event == "crash"
    )
    if causes:
        rank = causes[0][1]
        text = reports[rank].message.split("] ", 1)[-1]
        return f"rank {rank} failed first: {text}"
    silent = [rank for rank in sorted(failures) if rank not in reports]
    if silent:
        return "; ".join(f"rank {rank} {_how_it_ended(failures[rank])}" for rank in silent) + (
            " (the other ranks stopped after losing contact with it)" if reports else ""
        )
    rank = min(reports, key=lambda rank: reports[rank].time)
    return f"rank {rank} {_how_it_ended(failures[rank])}: {reports[rank].message}"


def _how_it_ended(failure: object) -> str:
    code = getattr(failure, "exitcode", None)
    if isinstance(code, int) and code < 0:
        name = signal.Signals(-code).name
        hint = (
            " (a memory-mapped file, such as the token file, shrank under it?)"
            if name == "SIGBUS"
            else ""
        )
        return f"was killed by {name}{hint}"
    return f"exited with status {code}"


def _say(line: str) -> None:
    with contextlib.suppress(OSError):
        print(f"meshtrain: {line}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------- ranks

#: How gloo and NCCL say that another rank is gone (they raise a plain RuntimeError).
_PEER_GONE = (
    "Connection reset by peer",
    "Connection closed by peer",
    "Broken pipe",
    "Connection refused",
    "gloo/transport",
    "NCCL communicator was aborted",
    "ncclRemoteError",
)


def lost_peer(err: BaseException) -> bool:
    """Whether ``err`` is a collective failing because another rank died or left.

    Example:
        >>> lost_peer(RuntimeError("[pair.cc:537] Read error: Connection reset by peer"))
        True
        >>> lost_peer(RuntimeError("shape mismatch"))
        False
    """
    import torch.distributed as dist

    if isinstance(err, dist.DistError):
        return True
    return isinstance(err, RuntimeError) and any(text in str(err) for text in _PEER_GONE)


def exit_with_parent(*, grace_s: float | None = None) -> None:
    """Make this rank stop when its launcher dies, however it dies (SIGKILL included).

    The rank gets SIGTERM — the graceful stop: finish the step, save, exit — through the
    kernel's parent-death signal on Linux and a watcher thread everywhere; if it has not exited
    ``grace_s`` seconds later (default: :data:`STOP_TIMEOUT_VARIABLE`, else 30) the watcher ends
    the process, so no rank outlives its job.
    """
    parent = os.getppid()
    _set_parent_death_signal(signal.SIGTERM)
    grace = grace_s if grace_s is not None else float(os.environ.get(STOP_TIMEOUT_VARIABLE, "30"))
    watcher = threading.Thread(
        target=_follow_parent, args=(parent, grace), name="meshtrain-parent-watch", daemon=True
    )
    watcher.start()


def _set_parent_death_signal(number: signal.Signals) -> None:
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(number))  # PR_SET_PDEATHSIG


def _follow_parent(parent: int, grace_s: float) -> None:
    _wait_for_exit(parent)
    with contextlib.suppress(OSError):
        os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(grace_s)  # the graceful stop's deadline
    _say(f"the launcher (pid {parent}) is gone and this rank did not stop within {grace_s:.0f} s")
    os._exit(EXIT_FAILED)


def _wait_for_exit(parent: int) -> None:
    """Return when ``parent`` is no longer this process's parent (a pidfd where the kernel has
    them, else a 0.2 s poll of the parent PID)."""
    if os.getppid() != parent:
        return
    pidfd_open = getattr(os, "pidfd_open", None)
    if pidfd_open is not None:
        with contextlib.suppress(OSError):
            handle = pidfd_open(parent)
            try:
                if os.getppid() == parent:
                    select.select([handle], [], [])
            finally:
                os.close(handle)
            return
    while os.getppid() == parent:
        time.sleep(0.2)
