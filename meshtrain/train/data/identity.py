"""What a file source is made of: each file's path, size and sha256, so prepared tokens are
never reused for files that changed, and a resume can tell that its data did.

:func:`source_identity` hashes each file a source reads. The hashes are kept beside the
prepared tokens (``sources.json``) with each file's stamp (size, modification and change times,
inode): a file whose stamp is unchanged keeps its recorded hash, any other is read again. The
change time (``ctime``) moves on every write and on every reset of the modification time, so an
edit that keeps the size and the modification time is read again too.

Example:
    >>> import tempfile
    >>> root = Path(tempfile.mkdtemp())
    >>> _ = (root / "a.jsonl").write_text('{"text": "hi"}\\n')
    >>> files = source_identity(DocumentSource("jsonl", str(root / "a.jsonl")))
    >>> [(Path(f.path).name, f.size, f.sha256[:8]) for f in files]
    [('a.jsonl', 15, 'b0395eba')]
    >>> identity_change(files, files) is None
    True
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from meshtrain.files import write_text_atomically
from meshtrain.train.data.documents import DocumentSource, source_files

__all__ = [
    "SOURCES_JSON",
    "SourceFile",
    "as_json",
    "from_json",
    "identity_change",
    "read_identity",
    "source_identity",
    "write_identity",
]

#: the file beside a prepared token directory's splits that records its source's files
SOURCES_JSON = "sources.json"
_CHUNK = 8 << 20


@dataclass(frozen=True)
class SourceFile:
    """One file of a source: its path, size and sha256, and the stamp the hash was taken at."""

    path: str
    size: int
    sha256: str
    stamp: tuple[int, int, int] = (0, 0, 0)  # modification time, change time, inode

    def same_content(self, other: SourceFile) -> bool:
        return (self.path, self.size, self.sha256) == (other.path, other.size, other.sha256)


def source_identity(
    source: DocumentSource, recorded: Sequence[SourceFile] = ()
) -> list[SourceFile]:
    """Every file ``source`` reads (a saved dataset's directory: each file in it), hashed; a
    file whose size and stamp match ``recorded`` keeps the hash recorded there."""
    known = {file.path: file for file in recorded}
    files = []
    for top in source_files(source):
        for path in sorted(p for p in top.rglob("*") if p.is_file()) if top.is_dir() else [top]:
            status = path.stat()
            stamp = (status.st_mtime_ns, status.st_ctime_ns, status.st_ino)
            seen = known.get(str(path))
            if seen is not None and seen.size == status.st_size and tuple(seen.stamp) == stamp:
                files.append(seen)
            else:
                files.append(SourceFile(str(path), status.st_size, _sha256(path), stamp))
    return files


def identity_change(saved: Sequence[SourceFile], now: Sequence[SourceFile]) -> str | None:
    """How the files ``now`` differ from ``saved``, in words (the first difference), or None."""
    before = {file.path: file for file in saved}
    after = {file.path: file for file in now}
    for path, file in after.items():
        old = before.get(path)
        if old is None:
            return f"{path!r} was added"
        if not old.same_content(file):
            sizes = f"{old.size:,} → {file.size:,} bytes" if old.size != file.size else "same size"
            return f"{path!r} changed ({sizes}; sha256 {old.sha256[:12]}… → {file.sha256[:12]}…)"
    removed = [path for path in before if path not in after]
    return f"{removed[0]!r} was removed" if removed else None


def read_identity(directory: Path) -> list[SourceFile]:
    """The files recorded beside a prepared token directory (none when nothing is)."""
    try:
        data = json.loads((Path(directory) / SOURCES_JSON).read_text())
        return [_file(item) for item in data["files"]]
    except (OSError, ValueError, KeyError, TypeError):
        return []


def write_identity(directory: Path, files: Sequence[SourceFile]) -> None:
    """Record ``files`` beside the prepared tokens in ``directory``."""
    text = json.dumps({"files": [asdict(file) for file in files]}, indent=1, sort_keys=True)
    write_text_atomically(Path(directory) / SOURCES_JSON, text + "\n")


def as_json(files: Sequence[SourceFile]) -> list[dict[str, Any]]:
    """``files`` as a checkpoint records them (path, size, sha256)."""
    return [{"path": f.path, "size": f.size, "sha256": f.sha256} for f in files]


def from_json(data: Any) -> list[SourceFile]:
    """What :func:`as_json` wrote (nothing when ``data`` is not that)."""
    try:
        return [_file(item) for item in data]
    except (KeyError, TypeError):
        return []


def _file(item: Mapping[str, Any]) -> SourceFile:
    stamp = tuple(item.get("stamp", (0, 0, 0)))
    return SourceFile(str(item["path"]), int(item["size"]), str(item["sha256"]), stamp)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()
