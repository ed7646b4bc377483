"""A checkpoint on disk: its name, when it counts as complete, its JSON half, and its DCP
metadata read without unpickling arbitrary classes. No collectives here.

Layout of a checkpoint directory (one per saved step)::

    <directory>/step_00000100/              complete: meshtrain.json and .metadata both present
        .metadata                           DCP's index (a pickle: read by a restricted unpickler)
        __0_0.distcp, __1_0.distcp, ...     tensor payloads, one file per writing rank
        meshtrain.json                      the JSON half: step, optimizer hyper-parameters, extra
    <directory>/step_00000200.tmp-3f9a1c2e/  being written (or left by a crash): never listed

Why a restricted unpickler: DCP's own ``FileSystemReader.read_metadata`` calls ``pickle.load``
on ``.metadata``, so a checkpoint copied from elsewhere could run code when it is opened. The
metadata legitimately holds only a dozen classes (DCP's metadata dataclasses, ``torch.Size``,
dtypes, layouts, a path); anything else is refused unless the caller passes ``trust_pickle=True``.

Example:
    >>> import tempfile
    >>> root = Path(tempfile.mkdtemp())
    >>> for name in ("step_00000010", "step_00000020", "step_00000030.tmp-1a2b3c4d"):
    ...     (root / name).mkdir()
    ...     (root / name / METADATA_FILE).touch()
    ...     write_state_file(root / name, '{"format": "meshtrain-checkpoint", "version": 1}')
    >>> [path.name for path in list_checkpoints(root)]
    ['step_00000010', 'step_00000020']
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import logging
import os
import pickle
import re
import shutil
import uuid
import warnings
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

from meshtrain.errors import CheckpointError
from meshtrain.files import write_text_atomically

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "METADATA_FILE",
    "MODEL_PREFIX",
    "OPTIM_PREFIX",
    "STATE_FILE",
    "RestrictedFileSystemReader",
    "canonical_fqn",
    "checkpoint_name",
    "checkpoint_step",
    "format_names",
    "latest_checkpoint",
    "list_checkpoints",
    "read_checkpoint_metadata",
    "read_state_file",
    "write_state_file",
]

FORMAT = "meshtrain-checkpoint"
FORMAT_VERSION = 2  # 2: file checksums and a sealed state (version 1 still loads)
STATE_FILE = "meshtrain.json"
METADATA_FILE = ".metadata"
TMP_MARKER = ".tmp-"
MODEL_PREFIX = "model."
OPTIM_PREFIX = "optim."
# Wrappers that activation checkpointing, torch.compile and FSDP1 insert into FQNs: a checkpoint
# saved with them must load without them (and the reverse).
_WRAPPER_SEGMENTS = frozenset({"_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module"})
_MAX_NAMES = 6
_COMPLETE_NAME = re.compile(r"step_(\d{8,})")
_LOG = logging.getLogger(__name__)

# Everything a DCP ``.metadata`` file written by torch 2.13 for meshtrain's checkpoints asks
# ``find_class`` for (tensors only: plain, DTensor with Shard/_StridedShard/Replicate, scalars),
# plus the path classes of other Python versions. Dtypes are admitted separately (any torch.dtype).
_ALLOWED_GLOBALS = frozenset(
    {
        ("torch.distributed.checkpoint.metadata", "Metadata"),
        ("torch.distributed.checkpoint.metadata", "MetadataIndex"),
        ("torch.distributed.checkpoint.metadata", "StorageMeta"),
        ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"),
        ("torch.distributed.checkpoint.metadata", "TensorProperties"),
        ("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"),
        ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch.serialization", "_get_layout"),  # rebuilds torch.strided from its name
        ("torch", "Size"),
        ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id: the directory DCP wrote to
        ("pathlib", "WindowsPath"),
        ("pathlib._local", "PosixPath"),
        ("pathlib._local", "WindowsPath"),
    }
)


def canonical_fqn(fqn: str) -> str:
    """A parameter's FQN without wrapper segments: the name it has in a checkpoint.

    Example:
        >>> canonical_fqn("layers.0._checkpoint_wrapped_module.attention.wq.weight")
        'layers.0.attention.wq.weight'
    """
    return ".".join(part for part in fqn.split(".") if part not in _WRAPPER_SEGMENTS)


def format_names(keys: list[str]) -> str:
    """The first few keys quoted, and how many more there are.

    Example:
        >>> format_names(["a", "b"])
        "'a', 'b'"
    """
    shown = ", ".join(repr(key) for key in keys[:_MAX_NAMES])
    more = len(keys) - _MAX_NAMES
    return f"{shown} and {more} more" if more > 0 else shown


def checkpoint_name(step: int) -> str:
    """The directory name of the checkpoint of ``step`` (sorts by step up to 10⁸ steps).

    Example:
        >>> checkpoint_name(1200)
        'step_00001200'
    """
    return f"step_{step:08d}"


def checkpoint_step(path: str | Path) -> int:
    """The step a checkpoint directory was saved at, from its name.

    Example:
        >>> checkpoint_step("runs/ckpt/step_00001200")
        1200
    """
    match = _COMPLETE_NAME.fullmatch(Path(path).name)
    if match is None:
        raise CheckpointError(
            f"{str(path)!r} is not a checkpoint directory name (expected 'step_' and 8 digits, "
            "as Checkpointer.save writes them). Pass a checkpoint that `meshtrain checkpoints DIR` "
            "lists (list_checkpoints() in Python)."
        )
    return int(match.group(1))


def is_complete(path: Path) -> bool:
    """A finished checkpoint: its name is ``step_<digits>`` and both halves are present."""
    return (
        _COMPLETE_NAME.fullmatch(path.name) is not None
        and (path / STATE_FILE).is_file()
        and (path / METADATA_FILE).is_file()
    )


def list_checkpoints(directory: str | Path) -> list[Path]:
    """The complete checkpoints in ``directory``, oldest step first.

    Directories still being written (``*.tmp-*``), left by a crash, or lacking ``meshtrain.json``
    or ``.metadata`` are not listed: a checkpoint appears only once it is whole. A missing
    ``directory`` has none (``[]``).
    """
    root = Path(directory)
    if not root.is_dir():
        return []
    found = [path for path in root.iterdir() if path.is_dir() and is_complete(path)]
    return sorted(found, key=checkpoint_step)


def latest_checkpoint(directory: str | Path) -> Path | None:
    """The complete checkpoint of the highest step in ``directory``, or ``None`` when none is.

    Example:
        >>> latest_checkpoint("/nonexistent/checkpoints") is None
        True
    """
    found = list_checkpoints(directory)
    return found[-1] if found else None


def write_state_file(directory: Path, text: str) -> None:
    """Write ``meshtrain.json`` into ``directory`` whole (a temp file, fsync, rename)."""
    write_text_atomically(directory / STATE_FILE, text)


def read_state_file(path: str | Path) -> dict[str, Any]:
    """The JSON half of the checkpoint at ``path``, checked to be meshtrain's format."""
    state_path = Path(path) / STATE_FILE
    if not state_path.is_file():
        hint = (
            " It is a directory of checkpoints: pass latest_checkpoint(path) instead."
            if Path(path).is_dir() and list_checkpoints(path)
            else " Pass a complete checkpoint directory (`meshtrain checkpoints DIR` lists them)."
        )
        raise CheckpointError(
            f"{str(path)!r} is not a complete meshtrain checkpoint: it has no {STATE_FILE}.{hint}"
        )
    try:
        state = json.loads(state_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(
            f"cannot read {str(state_path)!r}: {err}. The checkpoint is damaged; load an earlier "
            "one (`meshtrain checkpoints DIR` lists them with their status)."
        ) from err
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(
            f"{str(state_path)!r} is not a meshtrain checkpoint state file (its 'format' is not "
            f"{FORMAT!r}). Point at a directory written by Checkpointer.save."
        )
    version = state.get("version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise CheckpointError(
            f"{str(state_path)!r} has format version {version!r}; this meshtrain reads versions "
            f"up to {FORMAT_VERSION}. Upgrade meshtrain to load it."
        )
    return state


def publish(scratch: Path, final: Path) -> None:
    """Make the finished ``scratch`` directory the checkpoint ``final`` with one rename.

    A checkpoint already at ``final`` (the same step saved again) is moved aside first and
    removed afterwards, so a crash in between leaves the new one or the older steps, never a mix.
    """
    replaced: Path | None = None
    if final.exists():
        replaced = final.with_name(f"{final.name}{TMP_MARKER}replaced-{uuid.uuid4().hex[:8]}")
        os.rename(final, replaced)
    os.rename(scratch, final)
    _fsync_directory(final.parent)
    if replaced is not None:
        shutil.rmtree(replaced, ignore_errors=True)


def prune(directory: Path, keep_last: int, *, protected: Collection[int] = ()) -> list[Path]:
    """Remove all but the ``keep_last`` newest complete checkpoints (0 keeps all); return them.
    The steps in ``protected`` are never removed (the last checkpoint before non-finite steps).

    Each is renamed to a ``*.tmp-*`` name before it is deleted, so a crash mid-delete never leaves
    a partly deleted directory that lists as complete.
    """
    if keep_last <= 0:
        return []
    removed = [
        path
        for path in list_checkpoints(directory)[:-keep_last]
        if checkpoint_step(path) not in protected
    ]
    for path in removed:
        doomed = path.with_name(f"{path.name}{TMP_MARKER}pruned-{uuid.uuid4().hex[:8]}")
        os.rename(path, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
    return removed


def remove_stale(directory: Path, *, keep: Path | None = None) -> list[Path]:
    """Remove ``*.tmp-*`` directories (saves a crash interrupted) except ``keep``; return them."""
    if not directory.is_dir():
        return []
    stale = [
        path
        for path in directory.iterdir()
        if path.is_dir() and TMP_MARKER in path.name and path != keep
    ]
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return stale


def _fsync_directory(directory: Path) -> None:
    with contextlib.suppress(OSError):  # not every filesystem lets a directory be fsynced
        handle = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(handle)
        finally:
            os.close(handle)


@contextlib.contextmanager
def single_process_dcp() -> Iterator[None]:
    """DCP warns on every call without a process group, even when asked for one (``no_dist``).

    Example:
        >>> with single_process_dcp():
        ...     pass
    """
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="torch.distributed is disabled, unavailable or uninitialized"
        )
        yield


# ------------------------------------------------------------------ DCP metadata, read safely


@functools.cache
def _dtype_names() -> frozenset[str]:
    return frozenset(name for name, value in vars(torch).items() if isinstance(value, torch.dtype))


class _RestrictedUnpickler(pickle.Unpickler):
    """Admits only the classes DCP metadata contains; refuses any other global by name."""

    def __init__(self, stream: io.BufferedIOBase, source: Path) -> None:
        super().__init__(stream)
        self._source = source

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED_GLOBALS or (module == "torch" and name in _dtype_names()):
            return super().find_class(module, name)
        raise CheckpointError(
            f"{str(self._source)!r} asks to unpickle '{module}.{name}', which DCP checkpoint "
            "metadata never contains; it was not loaded (nothing from it ran). The file was "
            "tampered with or written by another tool. If you trust where it came from, pass "
            "trust_pickle=True, which unpickles it with pickle.load: that can run any code."
        )


def read_checkpoint_metadata(
    path: str | os.PathLike[str], *, trust_pickle: bool = False
) -> Metadata:
    """DCP's ``.metadata`` of the checkpoint at ``path``, unpickled by a restricted unpickler.

    ``trust_pickle=True`` uses ``pickle.load`` instead (and logs that it does): only for files
    whose origin you trust. Either way the result must be DCP ``Metadata`` whose payload files lie
    inside ``path``.
    """
    source = Path(path) / METADATA_FILE
    try:
        with open(source, "rb") as handle:
            if trust_pickle:
                _LOG.warning("unpickling %s with pickle.load (trust_pickle=True)", source)
                metadata = pickle.load(handle)
            else:
                metadata = _RestrictedUnpickler(handle, source).load()
    except CheckpointError:
        raise
    except FileNotFoundError as err:
        raise CheckpointError(
            f"{str(path)!r} has no DCP {METADATA_FILE} file: it is not a complete checkpoint "
            "(a save that did not finish?). Load one that `meshtrain checkpoints DIR` lists as "
            "intact."
        ) from err
    except Exception as err:  # a truncated or corrupt pickle raises almost anything
        raise CheckpointError(
            f"cannot read {str(source)!r}: {type(err).__name__}: {err}. The checkpoint is "
            "damaged; load an earlier one (`meshtrain checkpoints DIR` lists them with their "
            "status)."
        ) from err
    _check_metadata(metadata, source)
    return metadata


def _check_metadata(metadata: object, source: Path) -> None:
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise CheckpointError(
            f"{str(source)!r} holds a {type(metadata).__name__}, not DCP checkpoint Metadata. "
            "Point at a directory written by Checkpointer.save."
        )
    for key, entry in metadata.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata):
            raise CheckpointError(
                f"{str(source)!r} lists {key!r} as {type(entry).__name__}: meshtrain checkpoints "
                "hold tensors only. Load it with torch.distributed.checkpoint directly."
            )
    for info in (metadata.storage_data or {}).values():
        relative = getattr(info, "relative_path", None)
        if (
            not isinstance(relative, str)
            or Path(relative).name != relative
            or relative in ("", ".", "..")
        ):
            raise CheckpointError(
                f"{str(source)!r} points a payload at {relative!r}, outside the checkpoint "
                "directory. The file was tampered with; do not load it."
            )


class RestrictedFileSystemReader(FileSystemReader):
    """DCP's filesystem reader whose metadata comes from :func:`read_checkpoint_metadata`.

    Tensor payloads are read as DCP always does (``torch.load(weights_only=True)``); the
    ``.metadata`` pickle is read once, by the restricted unpickler unless ``trust_pickle``.

    Example::

        reader = RestrictedFileSystemReader("runs/ckpt/step_00000100")
        dcp.load(state_dict, storage_reader=reader)
    """

    def __init__(self, path: str | Path, *, trust_pickle: bool = False) -> None:
        super().__init__(path)
        self.trust_pickle = trust_pickle
        self._metadata: Metadata | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise CheckpointError(
                f"{str(self.path)!r}: rank-local DCP metadata is not part of meshtrain checkpoints."
            )
        if self._metadata is None:
            self._metadata = read_checkpoint_metadata(self.path, trust_pickle=self.trust_pickle)
        if self._metadata.storage_meta is None:
            self._metadata.storage_meta = StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata
