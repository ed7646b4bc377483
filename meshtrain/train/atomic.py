"""Files that appear whole or not at all: write beside the target, fsync, rename over it.

A crash at any moment leaves either the old file or the new one, never a half-written file under
the target's name (``os.replace`` is atomic within one filesystem).

Example:
    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as root:
    ...     write_text_atomically(Path(root) / "state.json", '{"step": 3}')
    ...     sorted(p.name for p in Path(root).iterdir())
    ['state.json']
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def replaced_atomically(path: Path) -> Iterator[Path]:
    """Yield a scratch path beside ``path`` to write; when the block ends without an error, the
    scratch file is fsynced and renamed over ``path``. The scratch file never outlives the block."""
    scratch = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        yield scratch
        with open(scratch, "rb+") as handle:
            os.fsync(handle.fileno())
        os.replace(scratch, path)
    finally:
        scratch.unlink(missing_ok=True)


def write_text_atomically(path: Path, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` through :func:`replaced_atomically`."""
    with replaced_atomically(path) as scratch:
        scratch.write_text(text, encoding="utf-8")
