"""Checksums for checkpoints: every file's size and sha256, and a checksum of the JSON state.

When a save finishes, the ranks hash the files DCP wrote (each rank a share of them) and rank 0
records them in ``meshtrain.json`` under ``files``; the state itself is sealed with a
``checksum`` over its canonical JSON, so a flipped byte in a tensor file, a truncated
``.metadata`` or a hand-edited ``step`` is found before anything is loaded. :func:`inspect_checkpoint`
judges one checkpoint directory: ``intact`` (everything matches), ``damaged`` (the problems say
which file and why), ``incomplete`` (a save that never finished) or ``unverified`` (no checksums
recorded: saved before they existed, or stripped of them; it loads only when asked for, with
``checkpoint.allow_unverified``, since nothing can tell a flipped byte in it).

Example:
    >>> import tempfile
    >>> root = Path(tempfile.mkdtemp()) / "step_00000003"
    >>> root.mkdir()
    >>> _ = (root / ".metadata").write_bytes(b"index")
    >>> state = {"format": "meshtrain-checkpoint", "version": 2, "step": 3, "extra": {"step": 3},
    ...          "files": digest_files(root, sorted(p.name for p in root.iterdir()))}
    >>> _ = (root / "meshtrain.json").write_text(seal_state(state))
    >>> inspect_checkpoint(root).status
    'intact'
    >>> _ = (root / ".metadata").write_bytes(b"indeX")
    >>> inspect_checkpoint(root).problems
    ('.metadata: its content does not match its sha256 (the file is corrupted)',)
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from meshtrain.errors import CheckpointError
from meshtrain.train.checkpoint.files import (
    STATE_FILE,
    TMP_MARKER,
    checkpoint_step,
    read_state_file,
)

__all__ = [
    "CheckpointStatus",
    "digest_files",
    "file_digest",
    "file_problems",
    "inspect_checkpoint",
    "inspect_directory",
    "seal_state",
    "state_problems",
]

Status = Literal["intact", "damaged", "incomplete", "unverified"]
UNVERIFIED = (
    "saved without checksums, so its files cannot be verified; load it on purpose with "
    "--set checkpoint.allow_unverified=true"
)
_CHUNK = 8 << 20


@dataclass(frozen=True)
class CheckpointStatus:
    """What :func:`inspect_checkpoint` found: the checkpoint's directory, its step (``None`` when the name
    does not say), its status, the problems (one line each, naming the file) and its size."""

    path: Path
    step: int | None
    status: Status
    problems: tuple[str, ...]
    size_bytes: int

    @property
    def loadable(self) -> bool:
        """Intact: every file matches the checksums recorded when it was saved."""
        return self.status == "intact"

    def loadable_if(self, allow_unverified: bool) -> bool:
        """Intact, or unverified (no checksums to check against) when ``allow_unverified``."""
        return self.loadable or (allow_unverified and self.status == "unverified")


def file_digest(path: Path) -> dict[str, Any]:
    """``{"size": bytes, "sha256": hex}`` of one file, read in 8 MiB chunks."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return {"size": size, "sha256": digest.hexdigest()}


def digest_files(directory: Path, names: Iterable[str]) -> dict[str, dict[str, Any]]:
    """:func:`file_digest` of each named file in ``directory``."""
    return {name: file_digest(directory / name) for name in names}


def _canonical(state: Mapping[str, Any]) -> bytes:
    body = {key: value for key, value in state.items() if key != "checksum"}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def seal_state(state: Mapping[str, Any]) -> str:
    """``state`` as ``meshtrain.json`` text, with ``checksum`` = sha256 of its canonical JSON."""
    sealed = {**state, "checksum": hashlib.sha256(_canonical(state)).hexdigest()}
    return json.dumps(sealed, indent=1)


def state_problems(path: Path, state: Mapping[str, Any]) -> list[str]:
    """What is wrong with a checkpoint's JSON state: a checksum that does not match, or a step
    that disagrees with the directory's name."""
    problems = []
    checksum = state.get("checksum")
    if checksum != hashlib.sha256(_canonical(state)).hexdigest():
        problems.append(
            f"{STATE_FILE}: its checksum does not match its content (edited by hand or corrupted)"
        )
    try:
        named = checkpoint_step(path)
    except CheckpointError:
        named = None
    steps = {state.get("step"), (state.get("extra") or {}).get("step", state.get("step"))}
    if named is not None and steps != {named}:
        shown = " and ".join(str(step) for step in sorted(steps, key=str))
        problems.append(f"{STATE_FILE}: says step {shown}, but the directory is {path.name}")
    return problems


def file_problems(
    path: Path, listed: Mapping[str, Any], names: Sequence[str], *, content: bool = True
) -> list[str]:
    """What is wrong with the ``names`` among the files ``listed`` in a checkpoint's state:
    missing, another size, or (``content``) another sha256."""
    problems = []
    for name in names:
        expected = listed[name]
        file = path / name
        try:
            size = file.stat().st_size
        except FileNotFoundError:
            problems.append(f"{name}: missing")
            continue
        if size != expected["size"]:
            cut = " (truncated)" if size < expected["size"] else ""
            problems.append(f"{name}: {size:,} bytes, expected {expected['size']:,}{cut}")
        elif content and file_digest(file)["sha256"] != expected["sha256"]:
            problems.append(
                f"{name}: its content does not match its sha256 (the file is corrupted)"
            )
    return problems


def inspect_checkpoint(path: str | Path, *, content: bool = True) -> CheckpointStatus:
    """Judge one checkpoint directory (see the module docstring); ``content=False`` checks sizes
    and the state's checksum but reads no tensor file."""
    path = Path(path)
    size = sum(entry.stat().st_size for entry in path.iterdir() if entry.is_file())
    step = _step_of(path)
    if TMP_MARKER in path.name or not (path / STATE_FILE).is_file():
        why = "a save that did not finish" if TMP_MARKER in path.name else f"no {STATE_FILE}"
        return CheckpointStatus(path, step, "incomplete", (why,), size)
    try:
        state = read_state_file(path)
    except CheckpointError as err:
        return CheckpointStatus(path, step, "damaged", (f"{STATE_FILE}: {err.message}",), size)
    if "files" not in state:
        return CheckpointStatus(path, step, "unverified", (UNVERIFIED,), size)
    problems = state_problems(path, state)
    listed = state["files"]
    problems += file_problems(path, listed, sorted(listed), content=content)
    return CheckpointStatus(path, step, "damaged" if problems else "intact", tuple(problems), size)


def inspect_directory(directory: str | Path, *, content: bool = True) -> list[CheckpointStatus]:
    """Every checkpoint in ``directory``, finished or not, oldest step first."""
    root = Path(directory)
    if not root.is_dir():
        return []
    found = [
        inspect_checkpoint(entry, content=content)
        for entry in root.iterdir()
        if _is_candidate(entry)
    ]
    return sorted(found, key=lambda status: (status.step is None, status.step, status.path.name))


def _is_candidate(entry: Path) -> bool:
    return entry.is_dir() and entry.name.startswith("step_")


def _step_of(path: Path) -> int | None:
    name = path.name.split(TMP_MARKER)[0]
    try:
        return checkpoint_step(name)
    except CheckpointError:
        return None
