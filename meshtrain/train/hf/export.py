"""Write a meshtrain checkpoint as a ``transformers`` model directory: ``config.json`` and
sharded safetensors with their index (``model-0000x-of-0000y.safetensors`` and
``model.safetensors.index.json``, or one ``model.safetensors`` when everything fits one shard).

Streamed, in one process, with no process group and without the mesh that saved it: DCP reads
a group of the checkpoint's tensors at a time as full plain tensors (only their bytes are read),
the group being what fits in the room left in the output shard being filled, so at most about
one output shard is in memory. Every tensor goes through one pipeline on its way out:

1. ``transform(fqn, tensor, checkpoint)`` → ``[(fqn, tensor), ...]``: the hook for changes
   made in meshtrain's names (a LoRA merge folds ``lora_A``/``lora_B`` into the base weight,
   reading them from ``checkpoint``, and returns ``[]`` for the adapters);
2. ``rename(fqn, tensor)`` → ``[(name, tensor), ...]``: meshtrain's names and layouts to the
   target's (meshtrain's Llama: :func:`meshtrain.models.llama_hf.llama_to_hf`);
3. the cast to ``dtype``, if given.

The directory is written under a temporary name beside ``out_dir`` and renamed into place
whole.

Example::

    export_hf(latest_checkpoint("runs/debug/checkpoints"), "out/hf",
              config=hf_config_from_llama(config), rename=partial(llama_to_hf, config),
              max_shard_size="2GB")
"""

from __future__ import annotations

import glob
import io
import json
import os
import shutil
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch import Tensor
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from meshtrain.adapters.nf4 import dequantize, register_nf4
from meshtrain.errors import CheckpointError, PlanError, describe_os_error
from meshtrain.plan.memory.sizes import parse_bytes
from meshtrain.train.checkpoint.files import (
    MODEL_PREFIX,
    TMP_MARKER,
    RestrictedFileSystemReader,
    single_process_dcp,
)
from meshtrain.train.hf.files import CONFIG_FILE, INDEX_FILE, SINGLE_FILE

__all__ = ["CheckpointTensors", "ExportReport", "Rename", "Transform", "export_hf"]

#: ``(fqn, tensor, checkpoint) → [(fqn, tensor), ...]``, in meshtrain's names (e.g. a LoRA merge)
Transform = Callable[[str, Tensor, "CheckpointTensors"], list[tuple[str, Tensor]]]
#: ``(fqn, tensor) → [(name, tensor), ...]``: meshtrain's names and layouts to the target's
Rename = Callable[[str, Tensor], list[tuple[str, Tensor]]]


@dataclass(frozen=True)
class ExportReport:
    """What an export wrote: the directory, its safetensors files, the number of tensors and
    their bytes, the most bytes of checkpoint tensors read at once (one group), and the
    checkpoint it read."""

    out_dir: Path
    files: tuple[str, ...]
    tensors: int
    total_bytes: int
    largest_read_bytes: int
    checkpoint: Path | None = None


class CheckpointTensors(Mapping[str, Tensor]):
    """The model tensors of a DCP checkpoint by FQN, read (full, plain) when asked for; what a
    :data:`Transform` gets to read the companions of a tensor (a LoRA adapter's ``lora_A``).

    Example::

        tensors = CheckpointTensors(Path("runs/debug/checkpoints/step_00000200"))
        tensors["norm.weight"].shape
    """

    def __init__(self, checkpoint: Path, *, trust_pickle: bool = False) -> None:
        self.checkpoint = checkpoint
        self.reader = RestrictedFileSystemReader(checkpoint, trust_pickle=trust_pickle)
        self.metadata = self.reader.read_metadata()
        entries = self.metadata.state_dict_metadata
        self.entries = {
            key[len(MODEL_PREFIX) :]: entry
            for key, entry in entries.items()
            if key.startswith(MODEL_PREFIX) and isinstance(entry, TensorStorageMetadata)
        }

    def __getitem__(self, fqn: str) -> Tensor:
        return self.read([fqn])[fqn]

    def __iter__(self) -> Iterator[str]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def nbytes(self, fqn: str) -> int:
        """Bytes of the full tensor ``fqn`` as stored."""
        entry = self.entries[fqn]
        return int(torch.Size(entry.size).numel()) * _itemsize(entry.properties.dtype)

    def read(self, fqns: Sequence[str]) -> dict[str, Tensor]:
        """Full plain tensors of ``fqns``, read in one DCP load (only their bytes); a packed
        tensor (a QLoRA base's NF4 shards) dequantized to its dtype."""
        packed = [fqn for fqn in fqns if self._packed(fqn)]
        tensors = {
            MODEL_PREFIX + fqn: torch.empty(
                tuple(self.entries[fqn].size), dtype=self.entries[fqn].properties.dtype
            )
            for fqn in fqns
            if fqn not in packed
        }
        try:
            with single_process_dcp():
                dcp.load(tensors, storage_reader=self.reader, no_dist=True)
        except (Exception, CheckpointException) as err:  # a missing or damaged payload file
            interrupted = _interruption(err)
            if interrupted is not None:  # a stop, not damage: DCP wraps it in its exception
                raise interrupted from None
            first = str(err).strip().splitlines()
            raise CheckpointError(
                f"reading tensors of {str(self.checkpoint)!r} failed: {type(err).__name__}: "
                f"{first[0] if first else ''}. The checkpoint is damaged; export an earlier one "
                "(`meshtrain checkpoints DIR` lists them with their status)."
            ) from err
        read = {key[len(MODEL_PREFIX) :]: tensor for key, tensor in tensors.items()}
        return read | {fqn: self._read_packed(fqn) for fqn in packed}

    def _chunks(self, fqn: str) -> list[tuple[tuple[int, ...], Any]]:
        """(offsets, storage) of each stored chunk of ``fqn``."""
        return [
            (tuple(index.offset or ()), info)
            for index, info in self.metadata.storage_data.items()
            if index.fqn == MODEL_PREFIX + fqn
        ]

    def _packed(self, fqn: str) -> bool:
        """Whether ``fqn`` is stored in fewer bytes than its elements take (a tensor subclass such
        as torchao's NF4, pickled whole, not a plain tensor's bytes)."""
        entry = self.entries[fqn]
        stored = sum(int(info.length) for _, info in self._chunks(fqn))
        return stored < int(torch.Size(entry.size).numel()) * _itemsize(entry.properties.dtype)

    def _read_packed(self, fqn: str) -> Tensor:
        """A packed tensor's chunks read one by one and dequantized into the full tensor."""
        entry = self.entries[fqn]
        full = torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
        register_nf4()  # NF4 chunks unpickle under weights_only once torchao knows them
        for offsets, info in self._chunks(fqn):
            path = self.checkpoint / info.relative_path
            try:
                with path.open("rb") as stream:
                    stream.seek(info.offset)
                    payload = stream.read(info.length)
                chunk = dequantize(torch.load(io.BytesIO(payload), weights_only=True))
            except Exception as err:  # a damaged payload, or an unknown packed format
                raise CheckpointError(
                    f"reading '{fqn}' from {str(path)!r} failed: {type(err).__name__}: "
                    f"{str(err).strip().splitlines()[0] if str(err).strip() else ''}. The "
                    "checkpoint is damaged (or its packed tensors need torchao: pip install "
                    "meshtrain[qlora]); export an earlier one."
                ) from err
            full[tuple(slice(o, o + n) for o, n in zip(offsets, chunk.shape, strict=True))] = chunk
        return full


def export_hf(
    checkpoint: str | Path,
    out_dir: str | Path,
    *,
    config: Mapping[str, Any],
    rename: Rename | None = None,
    transform: Transform | None = None,
    max_shard_size: int | str = "5GB",
    dtype: torch.dtype | None = None,
    copy_files: Sequence[Path] = (),
    trust_pickle: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> ExportReport:
    """Write the model tensors of the DCP ``checkpoint`` (a ``step_*`` directory) to
    ``out_dir`` as a transformers directory (see the module docstring): ``config`` is written as
    ``config.json`` (its ``dtype`` set to what was written), ``copy_files`` (e.g. the tokenizer's
    files) are copied beside it. ``out_dir`` must not exist or be empty. Shards hold at most
    ``max_shard_size`` bytes (``"5GB"``, ``"500MiB"`` or an int) unless one tensor is larger.
    ``progress(bytes_read, total_bytes)`` is called after each group of tensors is written.
    """
    checkpoint, out_dir = Path(checkpoint), Path(out_dir)
    limit = _shard_limit(max_shard_size)
    _check_out_dir(out_dir)
    source = CheckpointTensors(checkpoint, trust_pickle=trust_pickle)
    if not source.entries:
        raise CheckpointError(
            f"{str(checkpoint)!r} holds no model tensors ('{MODEL_PREFIX}*' keys): it was not "
            "written by Checkpointer.save. Export a meshtrain checkpoint."
        )
    remove_stale_exports(out_dir)
    scratch = out_dir.with_name(f"{out_dir.name}{TMP_MARKER}{uuid.uuid4().hex[:8]}")
    try:
        scratch.mkdir(parents=True)
        writer = _ShardWriter(scratch, limit)
        largest = _stream(source, writer, limit, transform, rename, dtype, progress)
        files = writer.finish()
        written_dtype = dtype or next(iter(source.entries.values())).properties.dtype
        text = json.dumps(
            {**config, "dtype": str(written_dtype).removeprefix("torch.")}, indent=2, sort_keys=True
        )
        (scratch / CONFIG_FILE).write_text(text + "\n", encoding="utf-8")
        for extra in copy_files:
            shutil.copy2(extra, scratch / Path(extra).name)
        if out_dir.exists():
            out_dir.rmdir()  # empty, checked above
        os.rename(scratch, out_dir)
    except BaseException as err:
        shutil.rmtree(scratch, ignore_errors=True)
        if isinstance(err, OSError) or type(err).__name__ == "SafetensorError":
            raise CheckpointError(_write_failure(out_dir, err)) from err
        raise
    return ExportReport(out_dir, files, len(writer.names), writer.total, largest, checkpoint)


def _interruption(err: BaseException) -> BaseException | None:
    """The KeyboardInterrupt (or other non-``Exception`` stop) DCP's exception carries, if any."""
    failures = getattr(err, "failures", None) or {}
    for failure in failures.values():
        inner = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(inner, BaseException) and not isinstance(inner, Exception):
            return inner
    cause = err.__cause__ or err.__context__
    if cause is not None and not isinstance(cause, Exception):
        return cause
    return None


def remove_stale_exports(out_dir: Path) -> list[Path]:
    """Remove the scratch folders (``OUT.tmp-*``) an export killed outright left beside
    ``out_dir``; return them."""
    stale = sorted(out_dir.parent.glob(f"{glob.escape(out_dir.name)}{TMP_MARKER}*"))
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return stale


def _write_failure(out_dir: Path, err: BaseException) -> str:
    """One line for an OS error (or safetensors' report of one) while writing ``out_dir``."""
    if isinstance(err, OSError):
        what = describe_os_error(err)
    else:  # safetensors wraps the OS error in its own text
        text = str(err).strip().splitlines()
        what = text[0] if text else type(err).__name__
        if "StorageFull" in what or "No space left" in what:
            what += "; the disk is full: free space or choose another --out"
    return (
        f"writing the export to {str(out_dir)!r} failed: {what}. Nothing was written there "
        "(its scratch folder was removed); the checkpoint is unchanged."
    )


def _stream(
    source: CheckpointTensors,
    writer: _ShardWriter,
    limit: int,
    transform: Transform | None,
    rename: Rename | None,
    dtype: torch.dtype | None,
    progress: Callable[[int, int], None] | None = None,
) -> int:
    """Read the checkpoint group by group and hand each output tensor to ``writer``; return the
    most bytes read at once."""
    keys = list(source.entries)
    largest, index, done = 0, 0, 0
    total = sum(source.nbytes(key) for key in keys)
    while index < len(keys):
        room = max(limit - writer.pending, 0)
        group, size = [keys[index]], source.nbytes(keys[index])
        index += 1
        while index < len(keys) and size + source.nbytes(keys[index]) <= room:
            size += source.nbytes(keys[index])
            group.append(keys[index])
            index += 1
        largest = max(largest, size)
        tensors = source.read(group)
        for fqn in group:
            tensor = tensors.pop(fqn)
            outputs = transform(fqn, tensor, source) if transform else [(fqn, tensor)]
            for name, value in outputs:
                for out_name, out in rename(name, value) if rename else [(name, value)]:
                    if dtype is not None and out.is_floating_point():
                        out = out.to(dtype)
                    writer.add(out_name, out.contiguous())
        done += size
        if progress is not None:
            progress(done, total)
    return largest


class _ShardWriter:
    """Fills shards up to ``limit`` bytes, writing each when the next tensor would overflow it;
    ``finish`` names them as transformers does and writes the index."""

    def __init__(self, directory: Path, limit: int) -> None:
        self.directory, self.limit = directory, limit
        self.current: dict[str, Tensor] = {}
        self.pending = 0
        self.total = 0
        self.shards: list[tuple[Path, list[str]]] = []
        self.names: set[str] = set()

    def add(self, name: str, tensor: Tensor) -> None:
        if name in self.names:
            raise CheckpointError(
                f"the export writes {name!r} twice: the transform or rename maps two checkpoint "
                "tensors to one name. Make them map to distinct names (or drop one)."
            )
        size = tensor.numel() * tensor.element_size()
        if self.current and self.pending + size > self.limit:
            self.flush()
        self.names.add(name)
        self.current[name] = tensor
        self.pending += size
        self.total += size

    def flush(self) -> None:
        if not self.current:
            return
        path = self.directory / f"shard-{len(self.shards):05d}.safetensors"
        save_file(self.current, str(path), metadata={"format": "pt"})
        self.shards.append((path, list(self.current)))
        self.current, self.pending = {}, 0

    def finish(self) -> tuple[str, ...]:
        self.flush()
        if len(self.shards) == 1:
            self.shards[0][0].rename(self.directory / SINGLE_FILE)
            return (SINGLE_FILE,)
        weight_map: dict[str, str] = {}
        files = []
        for number, (path, names) in enumerate(self.shards, start=1):
            name = f"model-{number:05d}-of-{len(self.shards):05d}.safetensors"
            path.rename(self.directory / name)
            files.append(name)
            weight_map.update(dict.fromkeys(names, name))
        index = {
            "metadata": {"total_size": self.total},
            "weight_map": dict(sorted(weight_map.items())),
        }
        (self.directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        return tuple(files)


def _shard_limit(max_shard_size: int | str) -> int:
    try:
        limit = parse_bytes(max_shard_size)
    except PlanError as err:
        raise CheckpointError(
            f"max shard size {max_shard_size!r} is not a size: write e.g. '5GB' or '500MiB'."
        ) from err
    if limit <= 0:
        raise CheckpointError(f"max shard size {max_shard_size!r} must be more than 0 bytes.")
    return limit


def _check_out_dir(out_dir: Path) -> None:
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise CheckpointError(
            f"{str(out_dir)!r} already exists and is not an empty directory; nothing was "
            "written. Choose a new --out directory or remove that one."
        )


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
