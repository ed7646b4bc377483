"""Where a safetensors checkpoint's tensors live: a ``transformers`` model directory (one
``model.safetensors``, or shards listed by ``model.safetensors.index.json``) or one
``.safetensors`` file. Only headers are read (names, shapes, dtypes); no tensor data.

Example:
    >>> import tempfile
    >>> from safetensors.torch import save_file
    >>> path = Path(tempfile.mkdtemp()) / "model.safetensors"
    >>> save_file({"w": torch.ones(2, 3)}, str(path))
    >>> weights = weight_files(path)
    >>> weights.shapes["w"], weights.dtypes["w"], weights.files["w"].name
    ((2, 3), 'F32', 'model.safetensors')
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from meshtrain.errors import CheckpointError

__all__ = ["CONFIG_FILE", "INDEX_FILE", "SINGLE_FILE", "WeightFiles", "read_config", "weight_files"]

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


@dataclass(frozen=True)
class WeightFiles:
    """A checkpoint's tensors: for each name, the file holding it, its shape and its stored
    dtype (safetensors' spelling: ``F32``, ``BF16``, ``F16``...). ``source`` is what was given
    (a directory or a file), ``index`` the index file of a sharded directory."""

    source: Path
    files: dict[str, Path]
    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, str]
    index: Path | None = None

    def where(self, name: str | None) -> str:
        """The file holding ``name`` (``None``: the one file), as messages name it."""
        if not self.source.is_dir():
            return str(self.source)
        return self.files[name].name if name in self.files else SINGLE_FILE

    def total_bytes(self) -> int:
        """Bytes of tensor data in every file (headers excluded)."""
        sizes = {"F64": 8, "I64": 8, "F32": 4, "I32": 4, "BF16": 2, "F16": 2, "I16": 2}
        return sum(
            sizes.get(self.dtypes[name], 1) * _numel(shape) for name, shape in self.shapes.items()
        )


def weight_files(path: str | Path) -> WeightFiles:
    """The tensors of the checkpoint at ``path`` (see the module docstring); a
    :class:`CheckpointError` saying what to give when it is neither."""
    source = Path(path)
    if source.is_file():
        if source.suffix != ".safetensors":
            raise CheckpointError(
                f"{str(source)!r} is not a .safetensors file: give a transformers model directory "
                "(config.json and model*.safetensors) or a .safetensors file."
            )
        return _read_headers(source, {None: source}, None)
    if not source.is_dir():
        raise CheckpointError(
            f"{str(source)!r} does not exist: give a transformers model directory (config.json "
            "and model*.safetensors, as save_pretrained writes) or a .safetensors file."
        )
    index = source / INDEX_FILE
    if index.is_file():
        weight_map = _read_index(index)
        files: dict[str | None, Path] = {name: source / file for name, file in weight_map.items()}
        missing = sorted({file.name for file in files.values() if not file.is_file()})
        if missing:
            raise CheckpointError(
                f"{str(index)!r} lists {', '.join(repr(name) for name in missing[:3])}"
                f"{f' and {len(missing) - 3} more' if len(missing) > 3 else ''}, which "
                f"{'is' if len(missing) == 1 else 'are'} not in {str(source)!r}: the download or "
                "copy is incomplete. Copy every shard the index lists."
            )
        return _read_headers(source, files, index)
    if (source / SINGLE_FILE).is_file():
        return _read_headers(source, {None: source / SINGLE_FILE}, None)
    raise CheckpointError(
        f"{str(source)!r} has neither {SINGLE_FILE} nor {INDEX_FILE}: it holds no safetensors "
        "weights (pytorch_model.bin is not read: it is a pickle). Save the model with "
        "save_pretrained (safetensors is its default), or give a .safetensors file."
    )


def read_config(directory: str | Path) -> dict[str, Any] | None:
    """``config.json`` of a model directory (``None`` for a file or a directory without one)."""
    path = Path(directory) / CONFIG_FILE
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"cannot read {str(path)!r}: {err}. Fix or replace it.") from err
    if not isinstance(config, dict):
        raise CheckpointError(f"{str(path)!r} is not a JSON object; it is not a model config.")
    return config


def _read_index(index: Path) -> dict[str, str]:
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as err:
        raise CheckpointError(
            f"cannot read {str(index)!r} ({type(err).__name__}: {err}): a safetensors index is "
            'a JSON object with a "weight_map" of tensor name → file. Fix or replace it.'
        ) from err
    if not isinstance(weight_map, dict) or not all(
        isinstance(file, str) and Path(file).name == file for file in weight_map.values()
    ):
        raise CheckpointError(
            f"{str(index)!r}: its weight_map must map tensor names to file names in the same "
            "directory. Fix or replace it."
        )
    return weight_map


def _read_headers(
    source: Path, files: Mapping[str | None, Path], index: Path | None
) -> WeightFiles:
    """Names, shapes and dtypes from each file's header; with an index, every name it lists
    must be in the file it names."""
    found: dict[str, Path] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    dtypes: dict[str, str] = {}
    for file in sorted(set(files.values())):
        try:
            with safe_open(str(file), framework="pt", device="cpu") as handle:
                for name in handle.keys():  # noqa: SIM118 (a safe_open handle is not iterable)
                    tensor = handle.get_slice(name)
                    found[name] = file
                    shapes[name] = tuple(int(size) for size in tensor.get_shape())
                    dtypes[name] = str(tensor.get_dtype())
        except Exception as err:  # safetensors raises its own error types for a bad header
            raise CheckpointError(
                f"cannot read the safetensors header of {str(file)!r}: {type(err).__name__}: "
                f"{err}. The file is damaged or not safetensors; replace it."
            ) from err
    if index is not None:
        misplaced = sorted(
            name for name, file in files.items() if name is not None and found.get(name) != file
        )
        if misplaced:
            raise CheckpointError(
                f"{str(index)!r} places {misplaced[0]!r}"
                f"{f' (and {len(misplaced) - 1} more)' if len(misplaced) > 1 else ''} in "
                f"{files[misplaced[0]].name!r}, which does not hold it. The index does not "
                "match the shards; replace it with the one saved with them."
            )
    return WeightFiles(source, found, shapes, dtypes, index)


def _numel(shape: tuple[int, ...]) -> int:
    return int(torch.Size(shape).numel())
