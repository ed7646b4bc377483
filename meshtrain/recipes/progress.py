"""Progress bars on a terminal (rich), for the long steps: exporting a checkpoint, tokenising
data, loading ``init_from`` weights (on rank 0). Elsewhere (a pipe, a log file) they are nothing, and the command's one line at
the end says what happened.

Example::

    with byte_progress("exporting runs/debug") as progress:
        export_run("runs/debug", "out/", progress=progress)   # progress(done, total) or None
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator

__all__ = ["byte_progress", "count_progress"]


@contextlib.contextmanager
def byte_progress(title: str) -> Iterator[Callable[[int, int], None] | None]:
    """A bar of bytes done out of a total, as ``progress(done, total)``; ``None`` off a terminal.

    Example:
        >>> with byte_progress("x") as progress:   # doctest runs without a terminal
        ...     progress is None
        True
    """
    if not sys.stdout.isatty():
        yield None
        return
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
    )

    bar = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TimeRemainingColumn(),
        transient=True,
    )
    task = bar.add_task(title, total=None)

    def update(done: int, total: int) -> None:
        bar.update(task, completed=done, total=total)

    with bar:
        yield update


@contextlib.contextmanager
def count_progress(title: str, unit: str) -> Iterator[Callable[[int, int], None] | None]:
    """A bar of items done out of a total (``12/291 tensors``), as ``progress(done, total)``;
    ``None`` off a terminal.

    Example:
        >>> with count_progress("loading", "tensors") as progress:   # no terminal here
        ...     progress is None
        True
    """
    if not sys.stdout.isatty():
        yield None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    bar = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn(unit),
        TimeElapsedColumn(),
        transient=True,
    )
    task = bar.add_task(title, total=None)

    def update(done: int, total: int) -> None:
        bar.update(task, completed=done, total=total)

    with bar:
        yield update
