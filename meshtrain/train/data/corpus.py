"""A real English text corpus built on the spot: the docstrings of Python's standard library.

Why: training and examples need text that is real (so a model has something to learn), ships with
every Python installation (so nothing is downloaded at run time, which CI and air-gapped clusters
cannot do) and is the same on every rank and every run. The stdlib's docstrings are that: a few
MB of careful technical English. They are read by parsing the ``*.py`` sources with :mod:`ast`;
no stdlib module is imported, so building the corpus runs no library code and has no side
effects. Files are visited in sorted order of their path under the stdlib, so the corpus is a
pure function of the Python installation.

Example:
    >>> docs = list(stdlib_documents(limit_bytes=2_000))
    >>> 0 < sum(len(doc.encode()) for doc in docs) <= 2_000
    True
    >>> docs == list(stdlib_documents(limit_bytes=2_000))
    True
"""

from __future__ import annotations

import ast
import contextlib
import gc
import platform
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from meshtrain.errors import DataError

__all__ = [
    "DataError",
    "corpus_text",
    "stdlib_documents",
    "stdlib_root",
    "stdlib_source_description",
]

# Test suites and their fixtures (some deliberately invalid Python), installed third-party
# packages, and codec tables: much source, little prose. Skipping them keeps the build fast.
_SKIPPED_DIRS = frozenset(
    {"test", "tests", "idle_test", "site-packages", "dist-packages", "encodings", "__pycache__"}
)
_MIN_DOCUMENT_CHARS = 40
_DOCUMENTED = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def stdlib_root() -> Path:
    """The directory of the running interpreter's standard library sources.

    Example:
        >>> (stdlib_root() / "os.py").is_file()
        True
    """
    return Path(sysconfig.get_path("stdlib"))


def stdlib_source_description(limit_bytes: int | None = None) -> str:
    """A line that names exactly which corpus :func:`stdlib_documents` yields here.

    Prepared token files record it, so a file built by another Python (another corpus) is not
    mistaken for this one.

    Example:
        >>> stdlib_source_description(1000).startswith("docstrings of the Python ")
        True
    """
    limit = "all" if limit_bytes is None else f"first {limit_bytes} bytes"
    return (
        f"docstrings of the Python {platform.python_version()} standard library at "
        f"{stdlib_root()} ({limit})"
    )


def stdlib_documents(limit_bytes: int | None = None) -> Iterator[str]:
    """Yield the stdlib's docstrings, one document per module, class or function docstring.

    Each is cleaned with :func:`inspect.cleandoc` (indentation removed); docstrings shorter than
    40 characters are skipped. With ``limit_bytes`` the documents stop before their total UTF-8
    size would pass it, so a smaller limit always yields a prefix of a larger one (and a limit
    below the first document's size yields nothing: documents are never cut). Source files
    this interpreter cannot parse are skipped. The whole corpus is about 1.8 MB for CPython 3.11.

    Example:
        >>> first = next(stdlib_documents())
        >>> isinstance(first, str) and len(first) >= 40
        True
    """
    if limit_bytes is not None and limit_bytes < 0:
        raise DataError(
            f"stdlib_documents(limit_bytes={limit_bytes}): the limit must be >= 0 bytes; "
            "pass None for the whole corpus."
        )
    total_bytes = 0
    for source in _source_files(stdlib_root()):
        for document in _file_docstrings(source):
            size = len(document.encode("utf-8", errors="replace"))
            if limit_bytes is not None and total_bytes + size > limit_bytes:
                return
            total_bytes += size
            yield document


def corpus_text(limit_bytes: int | None = None, separator: str = "\n\n") -> str:
    """The corpus as one string, documents joined by ``separator``.

    Example:
        >>> text = corpus_text(limit_bytes=20_000)
        >>> text.startswith(next(stdlib_documents())), len(text.encode()) < 21_000
        (True, True)
    """
    return separator.join(stdlib_documents(limit_bytes))


def _source_files(root: Path) -> list[Path]:
    """Every ``*.py`` under ``root`` outside the skipped directories, sorted by relative path."""
    found: list[tuple[str, Path]] = []
    for path in root.rglob("*.py"):
        relative = path.relative_to(root)
        if _SKIPPED_DIRS.isdisjoint(relative.parts[:-1]) and path.is_file():
            found.append((relative.as_posix(), path))
    found.sort()
    return [path for _, path in found]


def _file_docstrings(path: Path) -> Iterator[str]:
    """The docstrings of one source file in source order (module first), cleaned."""
    try:
        source = path.read_bytes()
        with _garbage_collection_paused():
            tree = ast.parse(source, filename=str(path))
    except (SyntaxError, ValueError, OSError):
        return
    for node in _documented_nodes(tree):
        docstring = ast.get_docstring(node, clean=True)
        if docstring is None:
            continue
        document = docstring.replace("\x00", "").strip()
        if len(document) >= _MIN_DOCUMENT_CHARS:
            yield document


@contextlib.contextmanager
def _garbage_collection_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector while an AST is built, restoring its state after.

    An AST has no reference cycles, but its many allocations set off collections that scan every
    live object (all of torch, in a training process): pausing halves the corpus build time.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _documented_nodes(
    node: ast.AST,
) -> Iterator[ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef]:
    """Nodes that can carry a docstring, in source order, descending only through statements
    (expressions never hold a ``def``), which is several times faster than :func:`ast.walk`."""
    if isinstance(node, _DOCUMENTED):
        yield node
    for field in ("body", "orelse", "finalbody", "handlers", "cases"):
        for child in getattr(node, field, ()):
            if isinstance(child, ast.stmt | ast.excepthandler | ast.match_case):
                yield from _documented_nodes(child)
