"""Files that appear whole or not at all, and never through a symbolic link: write beside the
target into a new file (``O_CREAT | O_EXCL | O_NOFOLLOW``), fsync, rename over it.

A crash at any moment leaves either the old file or the new one, never a half-written file under
the target's name (``os.replace`` is atomic within one filesystem). A symbolic link where
meshtrain writes (``plan.txt`` pointing at another file, say, in a run directory someone made
beforehand) is refused with a :class:`~meshtrain.errors.CheckpointError` naming both ends:
writing through it would overwrite or append to whatever it points to. Appends
(:func:`open_for_append`) and records written in place (:func:`open_to_overwrite`) open with
``O_NOFOLLOW`` for the same reason.

Example:
    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as root:
    ...     write_text_atomically(Path(root) / "state.json", '{"step": 3}')
    ...     sorted(p.name for p in Path(root).iterdir())
    ['state.json']
"""

from __future__ import annotations

import contextlib
import errno
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

from meshtrain.errors import CheckpointError

_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
_APPEND = os.O_WRONLY | os.O_CREAT | os.O_APPEND | getattr(os, "O_NOFOLLOW", 0)
_OVERWRITE = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0)


def refuse_link(path: Path | str) -> None:
    """Raise :class:`CheckpointError` when ``path`` is a symbolic link (dangling or not)."""
    if os.path.islink(path):
        target = os.readlink(path)
        raise CheckpointError(
            f"refusing to write {str(path)!r}: it is a symbolic link (to {target!r}), and "
            "meshtrain never writes through a link in a run, data or checkpoint directory "
            "(it would overwrite what the link points to). Remove the link, or choose another "
            "directory (logging.run_dir, checkpoint.dir)."
        )


@contextlib.contextmanager
def replaced_atomically(path: Path) -> Iterator[Path]:
    """Yield a new, empty scratch file beside ``path`` to write; when the block ends without an
    error, the scratch file is fsynced and renamed over ``path``. The scratch file never
    outlives the block; a link at ``path`` is refused before and after."""
    refuse_link(path)
    scratch = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    os.close(os.open(scratch, _NEW, 0o644))
    try:
        yield scratch
        refuse_link(scratch)
        with open(scratch, "rb+") as handle:
            os.fsync(handle.fileno())
        refuse_link(path)
        os.replace(scratch, path)
    finally:
        scratch.unlink(missing_ok=True)


def write_text_atomically(path: Path, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` through :func:`replaced_atomically`."""
    with replaced_atomically(path) as scratch:
        scratch.write_text(text, encoding="utf-8")


def open_for_append(path: Path | str) -> TextIO:
    """``path`` opened to append UTF-8 text (created when missing), never through a link."""
    return os.fdopen(_open(path, _APPEND), "a", encoding="utf-8")


def open_to_overwrite(path: Path | str) -> int:
    """A descriptor of ``path`` emptied to be written over in place (``os.pwrite``: a small
    record rewritten often, as a heartbeat is), created when missing, never through a link."""
    return _open(path, _OVERWRITE)


def _open(path: Path | str, flags: int) -> int:
    try:
        return os.open(path, flags, 0o644)
    except OSError as err:
        if err.errno == errno.ELOOP:
            refuse_link(path)
        raise
