"""The console, JSONL and run-file sinks, and :class:`Sinks`, which fans a step's metrics out to
every sink the run's :class:`LoggingConfig` asks for (wandb's sink is in
:mod:`meshtrain.train.metrics.wandb_sink`).

Every rank calls the same three methods; only the logging rank (rank 0 unless told otherwise)
gets real sinks, every other rank gets an empty :class:`Sinks` whose methods do nothing. The loss
and gradient norm arrive already reduced to global values on every rank, so one rank is enough.

Example (the train loop, on every rank)::

    sinks = make_sinks(LoggingConfig(), run_dir=Path("runs/debug"), rank=dist.get_rank(),
                       total_steps=100, run_name="debug")
    sinks.start(config=recipe_as_dict, plan_text=plan.explain(), plan_json=plan.to_json())
    meter = Throughput(flops_per_token=llama_flops_per_token(config, seq_len), device=device)
    for step in range(1, 101):
        ...
        sinks.log(step, meter.update({"loss": loss, "grad_norm": norm, "lr": lr, "tokens": n}))
    sinks.close()

On the logging rank ``start`` writes ``plan.txt``, ``plan.json`` and ``config.json`` into
``run_dir``; ``log`` prints a line (or moves a progress bar on a terminal), appends one JSON
object to ``run_dir/metrics.jsonl`` and logs to wandb (offline unless configured ``"online"``).

    >>> LoggingConfig(wandb="offline", log_every=10).log_every
    10
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, TextIO

from meshtrain.errors import MeshtrainError
from meshtrain.files import open_for_append, refuse_link, write_text_atomically
from meshtrain.train.metrics.config import LoggingConfig
from meshtrain.train.metrics.values import (
    MetricValue,
    _is_number,
    _parse_plan_json,
    _plain_value,
    _with_newline,
    _writing,
)
from meshtrain.train.metrics.wandb_sink import (
    WANDB_RUN_ID_FILE,
    WandbSink,
    check_wandb_credentials,
)

_LOGGER = logging.getLogger(__name__)
METRICS_FILE = "metrics.jsonl"
#: what :class:`RunFilesSink` writes into the run directory
RUN_FILES = ("plan.txt", "plan.json", "config.json")
#: every file the sinks write at the top of a run directory (the launcher refuses a link there)
RUN_DIR_FILES = (*RUN_FILES, METRICS_FILE, WANDB_RUN_ID_FILE)


class Sink(Protocol):
    """One destination for a run's metrics."""

    def start(self, *, config: Mapping[str, object], plan_text: str, plan_json: str) -> None:
        """Begin the run: ``config`` is the recipe as a dict, the plan as text and JSON."""

    def log(self, step: int, metrics: Mapping[str, MetricValue]) -> None:
        """Record the metrics of one step."""

    def close(self, *, failed: bool = False) -> None:
        """End the run (``failed`` when training raised); safe to call twice."""


class Sinks:
    """The sinks of one run behind one start/log/close; empty (a no-op) on non-logging ranks.

    ``log`` forwards the first step, every ``log_every``-th step and the last one (when
    ``total_steps`` is known). A sink whose ``log`` raises (wandb's service gone, a full disk
    under ``metrics.jsonl``, a closed console) is named in one line on stderr and turned off for
    the rest of the run; training goes on with the others, and the sink is not closed (a dead
    service could hold ``close`` up) but abandoned where it can be (``abandon()``). Used as a context manager it closes the sinks on the way
    out, marking the run failed when the block raised.

    Example:
        >>> sinks = Sinks([], log_every=10, total_steps=25)
        >>> [step for step in range(1, 26) if sinks.is_due(step)]
        [1, 10, 20, 25]
        >>> sinks.enabled
        False
    """

    def __init__(
        self, sinks: Sequence[Sink], *, log_every: int = 1, total_steps: int | None = None
    ) -> None:
        self.sinks = tuple(sinks)
        self.log_every = log_every
        self.total_steps = total_steps
        self.failed: dict[str, str] = {}  # a turned-off sink's name → what it raised

    @property
    def enabled(self) -> bool:
        """True on the logging rank (there is at least one sink)."""
        return bool(self.sinks)

    def is_due(self, step: int) -> bool:
        """Whether ``log`` forwards this step."""
        return step == 1 or step % self.log_every == 0 or step == self.total_steps

    def start(
        self, *, config: Mapping[str, Any] | None = None, plan_text: str = "", plan_json: str = "{}"
    ) -> None:
        """Start every sink (writes the plan files, opens the wandb run); on an error the sinks
        already started are closed before it propagates."""
        try:
            for sink in self.sinks:
                sink.start(config=dict(config or {}), plan_text=plan_text, plan_json=plan_json)
        except BaseException:
            self.close(failed=True)
            raise

    def log(self, step: int, metrics: Mapping[str, MetricValue]) -> None:
        """Hand a step's metrics to every working sink when the step is due; a sink that raises
        is reported once and turned off (see the class)."""
        if self.sinks and self.is_due(step):
            for sink in self.sinks:
                try:
                    sink.log(step, metrics)
                except Exception as error:
                    self._turn_off(sink, step, error)

    def _turn_off(self, sink: Sink, step: int, error: Exception) -> None:
        name = type(sink).__name__
        what = f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"
        self.failed[name] = what
        self.sinks = tuple(other for other in self.sinks if other is not sink)
        abandon = getattr(sink, "abandon", None)  # let go of what the sink holds (a service)
        if abandon is not None:
            with contextlib.suppress(Exception):
                abandon()
        with contextlib.suppress(OSError):
            print(
                f"meshtrain: the metrics sink {name} failed at step {step} ({what}); it is "
                "turned off for the rest of this run, which trains and checkpoints on "
                f"(still logging to: {', '.join(type(s).__name__ for s in self.sinks) or 'none'})",
                file=sys.stderr,
                flush=True,
            )

    def close(self, *, failed: bool = False) -> None:
        """Close every sink, even when one of them raises (the first error is re-raised)."""
        first_error: BaseException | None = None
        for sink in self.sinks:
            try:
                sink.close(failed=failed)
            except Exception as error:
                first_error = first_error or error
        if first_error is not None:
            raise first_error

    def __enter__(self) -> Sinks:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        self.close(failed=exc_type is not None)


def make_sinks(
    config: LoggingConfig,
    *,
    run_dir: Path | str,
    rank: int,
    total_steps: int | None,
    run_name: str,
    logging_rank: int = 0,
    start_step: int = 0,
) -> Sinks:
    """The sinks ``config`` asks for on the logging rank; empty :class:`Sinks` on the others.

    ``logging_rank`` picks the rank that logs (e.g. the last pipeline stage's first rank when the
    loss is not reduced to every rank). wandb ``"online"`` credentials are checked on every rank,
    so a missing key stops all ranks before training starts rather than one of them mid-run.
    ``start_step`` is the step the run resumes from (0: a fresh start): the metrics file drops
    rows past it and the wandb run of the run directory continues (a fresh start begins a new one).

    Example:
        >>> make_sinks(LoggingConfig(), run_dir="runs/x", rank=1, total_steps=10, run_name="x").enabled
        False
    """
    if config.wandb == "online":
        check_wandb_credentials(config)
    if rank != logging_rank:
        return Sinks((), log_every=config.log_every, total_steps=total_steps)
    run_dir = Path(run_dir)
    with _writing(run_dir):
        run_dir.mkdir(parents=True, exist_ok=True)
    sinks: list[Sink] = [RunFilesSink(run_dir)]
    if config.jsonl:
        sinks.append(JsonlSink(run_dir / METRICS_FILE, start_step=start_step))
    if config.wandb != "disabled":
        sinks.append(WandbSink(config, run_dir=run_dir, run_name=run_name, resume=start_step > 0))
    if config.console:  # last: its progress bar starts only once the others have
        sinks.append(ConsoleSink(total_steps, run_name=run_name))
    return Sinks(sinks, log_every=config.log_every, total_steps=total_steps)


class RunFilesSink:
    """Writes ``plan.txt`` (``plan.explain()``), ``plan.json`` and ``config.json`` into the run dir.

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as run_dir:
        ...     RunFilesSink(run_dir).start(config={}, plan_text="plan", plan_json="{}")
        ...     sorted(path.name for path in Path(run_dir).iterdir())
        ['config.json', 'plan.json', 'plan.txt']
    """

    def __init__(self, run_dir: Path | str) -> None:
        self.run_dir = Path(run_dir)

    def start(self, *, config: Mapping[str, object], plan_text: str, plan_json: str) -> None:
        _parse_plan_json(plan_json)
        config_text = json.dumps(config, indent=2, sort_keys=True, default=str)
        with _writing(self.run_dir):
            self.run_dir.mkdir(parents=True, exist_ok=True)
            write_text_atomically(self.run_dir / "plan.txt", _with_newline(plan_text))
            write_text_atomically(self.run_dir / "plan.json", _with_newline(plan_json))
            write_text_atomically(self.run_dir / "config.json", config_text + "\n")

    def log(self, step: int, metrics: Mapping[str, MetricValue]) -> None:
        """Nothing per step."""

    def close(self, *, failed: bool = False) -> None:
        """Nothing to close."""


class JsonlSink:
    """One JSON object per line, ``{"step": ..., "time": <unix s>, **metrics}``, flushed per line.

    The file is opened for appending, so a resumed run continues its history; at ``start`` rows
    past ``start_step`` (the step the run resumes from; 0 for a fresh start) are dropped, so a
    step the resumed run trains again appears once. A crash loses at most the line being written
    (:func:`read_jsonl` skips a torn last line). Non-finite floats are written as
    ``NaN``/``Infinity``, as Python's json module reads them back.

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as run_dir:
        ...     sink = JsonlSink(Path(run_dir) / "metrics.jsonl")
        ...     sink.log(1, {"loss": 2.5})
        ...     sink.close()
        ...     [row["loss"] for row in read_jsonl(sink.path)]
        [2.5]
    """

    def __init__(self, path: Path | str, *, start_step: int = 0) -> None:
        self.path = Path(path)
        self.start_step = start_step
        self._file: TextIO | None = None

    def start(self, *, config: Mapping[str, object], plan_text: str, plan_json: str) -> None:
        with _writing(self.path):
            truncate_jsonl(self.path, self.start_step)
        self._open()

    def log(self, step: int, metrics: Mapping[str, MetricValue]) -> None:
        row = {"step": step, "time": time.time()}
        row.update((key, _plain_value(key, value)) for key, value in metrics.items())
        file = self._open()
        with _writing(self.path):
            file.write(json.dumps(row) + "\n")
            file.flush()

    def close(self, *, failed: bool = False) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def _open(self) -> TextIO:
        if self._file is None:
            with _writing(self.path):
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._file = open_for_append(self.path)
        return self._file


def truncate_jsonl(path: Path | str, last_step: int) -> int:
    """Drop the rows of a metrics file past ``last_step`` (and a torn last line); return how many
    were dropped. The file is rewritten whole or not at all.

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as run_dir:
        ...     path = Path(run_dir) / "m.jsonl"
        ...     _ = path.write_text('{"step": 1}\\n{"step": 2}\\n{"step": 3}\\n{"st')
        ...     truncate_jsonl(path, 2), [row["step"] for row in read_jsonl(path)]
        (2, [1, 2])
    """
    path = Path(path)
    refuse_link(path)  # a resume reads and rewrites it: never another file through a link
    if not path.is_file():
        return 0
    lines = path.read_text(encoding="utf-8").split("\n")
    kept, dropped = [], 0
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):  # torn by a crash mid-write
                dropped += 1
                continue
            row = None  # not ours to judge: read_jsonl names it
        if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] > last_step:
            dropped += 1
            continue
        kept.append(line)
    if dropped:
        write_text_atomically(path, "".join(line + "\n" for line in kept))
    return dropped


def read_jsonl(path: Path | str) -> list[dict[str, Any]]:
    """The rows of a metrics JSONL file, in order; a torn last line (a crash mid-write) is skipped.

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as run_dir:
        ...     path = Path(run_dir) / "m.jsonl"
        ...     _ = path.write_text('{"step": 1, "loss": 2.0}\\n{"step": 2, "lo')
        ...     read_jsonl(path)
        [{'step': 1, 'loss': 2.0}]
    """
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    lines = text.split("\n")
    rows: list[dict[str, Any]] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            if number == len(lines):  # the last line has no newline: torn by a crash
                break
            raise MeshtrainError(
                f"{path}:{number} is not a JSON object ({error.msg}); a metrics file holds one "
                "object per line. Remove or repair that line."
            ) from error
        if not isinstance(row, dict):
            raise MeshtrainError(
                f"{path}:{number} holds {type(row).__name__}, not a JSON object; a metrics file "
                "holds one object per line. Remove or repair that line."
            )
        rows.append(row)
    return rows


class ConsoleSink:
    """Human-readable progress: a rich progress bar on a terminal, plain lines elsewhere.

    Each logged step becomes one line, ``step 3/100 | loss 2.3010 | grad_norm 0.912 | lr 1.00e-03
    | tok/s 12,345 | rss 1.21 GiB | mfu 41.2% | 0.512 s/step`` (the fields present); on a terminal
    the lines scroll above a bar with the step count, elapsed and remaining time. Without a
    terminal (CI logs, files, pytest) nothing but those lines is written: no escape codes.

    Example:
        >>> console = ConsoleSink(100, stream=sys.stdout)
        >>> console.log(3, {"loss": 2.301, "lr": 1e-3, "tokens": 4096})
        step 3/100 | loss 2.3010 | lr 1.00e-03
    """

    def __init__(
        self, total_steps: int | None, *, run_name: str = "train", stream: TextIO | None = None
    ) -> None:
        self.total_steps = total_steps
        self.run_name = run_name
        self._stream = stream
        self._progress: Any = None
        self._task: Any = None

    @property
    def stream(self) -> TextIO:
        """Where lines go: the given stream, else ``sys.stdout`` as it is now."""
        return self._stream if self._stream is not None else sys.stdout

    def start(self, *, config: Mapping[str, object], plan_text: str, plan_json: str) -> None:
        steps = f"{self.total_steps} steps" if self.total_steps is not None else "open-ended"
        if _is_terminal(self.stream):
            self._start_progress()
        self._print(f"run {self.run_name}: {steps}")

    def log(self, step: int, metrics: Mapping[str, MetricValue]) -> None:
        self._print(format_metrics(step, metrics, self.total_steps))
        if self._progress is not None:
            with self._console_guard():
                self._progress.update(self._task, completed=step)

    def close(self, *, failed: bool = False) -> None:
        if self._progress is not None:
            with self._console_guard():
                self._progress.stop()
            self._progress = None
        if failed:
            self._print(f"run {self.run_name}: stopped by an error")

    def _start_progress(self) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self._progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=Console(file=self.stream),
        )
        self._task = self._progress.add_task(self.run_name, total=self.total_steps)
        self._progress.start()

    def _print(self, line: str) -> None:
        with self._console_guard():
            if self._progress is not None:
                self._progress.console.print(line, markup=False, highlight=False)
            else:
                print(line, file=self.stream, flush=True)

    @contextlib.contextmanager
    def _console_guard(self) -> Iterator[None]:
        """A closed terminal or pipe must not stop training: on the first OS error writing to
        it, the progress bar is dropped and this process's stdout and stderr go to /dev/null
        (so no later print, nor the flush at exit, fails)."""
        try:
            yield
        except OSError:
            progress, self._progress = self._progress, None
            refresh = getattr(getattr(progress, "live", None), "_refresh_thread", None)
            if refresh is not None:
                refresh.done.set()  # rich's redraw thread: its next write would fail again
            devnull = open(os.devnull, "w")  # noqa: SIM115 - lives as long as the process
            self._stream = devnull
            sys.stdout = sys.stderr = devnull


def format_metrics(
    step: int, metrics: Mapping[str, MetricValue], total_steps: int | None = None
) -> str:
    """One console line for a step: known fields in a fixed order, then any other numbers.

    Example:
        >>> format_metrics(7, {"loss": 1.5, "grad_norm": 0.25, "tokens_per_s": 12345.6,
        ...                    "cuda_memory_gib": 30.5, "mfu": 0.412, "loss_scale": 65536.0})
        'step 7 | loss 1.5000 | grad_norm 0.25 | tok/s 12,346 | cuda 30.50 GiB | mfu 41.2% | loss_scale 6.554e+04'
    """
    fields = [f"step {step}/{total_steps}" if total_steps is not None else f"step {step}"]
    for key, render in _CONSOLE_FIELDS.items():
        value = metrics.get(key)
        if _is_number(value) and not (key == "skipped" and not value):
            fields.append(render(_plain_value(key, value)))
    for key, value in metrics.items():
        if key not in _CONSOLE_FIELDS and key not in _CONSOLE_HIDDEN and _is_number(value):
            fields.append(f"{key} {_plain_value(key, value):.4g}")
    return " | ".join(fields)


#: How the console shows each known metric, in display order.
_CONSOLE_FIELDS: dict[str, Callable[[Any], str]] = {
    "loss": lambda value: f"loss {value:.4f}",
    "grad_norm": lambda value: f"grad_norm {value:.4g}",
    "lr": lambda value: f"lr {value:.2e}",
    "tokens_per_s": lambda value: f"tok/s {value:,.0f}",
    "cuda_memory_gib": lambda value: f"cuda {value:.2f} GiB",
    "rss_gib": lambda value: f"rss {value:.2f} GiB",
    "mfu": lambda value: f"mfu {value:.1%}",
    "step_time_s": lambda value: f"{value:.3f} s/step",
    "skipped": lambda value: f"skipped {value}",
}
_CONSOLE_HIDDEN = frozenset({"tokens", "warmup", "step", "time"})


def _is_terminal(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty()) and os.environ.get("TERM") != "dumb"
