"""Single-file safetensors for inference and for starting a run: export a checkpoint's model
tensors, and load such a file into a full (not yet distributed) model.

Why safetensors: one file any runtime can read, holding tensors and a string header only, so
opening one never runs code (unlike a pickle). Export runs offline in one process without a
process group: DCP reads every shard into full tensors sized from the checkpoint's metadata.
Loading follows "initialise on full tensors, then distribute": call it before ``plan.apply``.

Example::

    export_safetensors(latest_checkpoint("runs/ckpt"), Path("model.safetensors"), dtype=torch.bfloat16)
    model = build_llama(config)                       # full tensors, one process or every rank
    load_safetensors(Path("model.safetensors"), model)
    applied = plan.apply(model)
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.tensor import DTensor

from meshtrain.errors import CheckpointError, format_shape
from meshtrain.train.atomic import replaced_atomically
from meshtrain.train.checkpoint_files import (
    MODEL_PREFIX,
    RestrictedFileSystemReader,
    canonical_fqn,
    checkpoint_step,
    format_names,
    read_state_file,
    single_process_dcp,
)

__all__ = ["SAFETENSORS_FORMAT", "export_safetensors", "load_safetensors"]

SAFETENSORS_FORMAT = "meshtrain-safetensors-1"


def export_safetensors(
    checkpoint: str | Path,
    out_file: str | Path,
    *,
    dtype: torch.dtype | None = None,
    trust_pickle: bool = False,
) -> Path:
    """Write the checkpoint's parameters, full and under their model FQNs, to one safetensors
    file; return its path. Optimizer state is left out.

    ``dtype`` casts floating-point tensors (e.g. ``torch.bfloat16`` for inference). The header
    carries ``format`` ('pt'), ``meshtrain_format``, ``step`` and ``source`` (the checkpoint).
    Runs in this process alone (no collectives, any process group is ignored); the file appears
    whole or not at all. ``trust_pickle`` as in :func:`~meshtrain.train.checkpoint.load_checkpoint`.
    """
    checkpoint, out_file = Path(checkpoint), Path(out_file)
    state = read_state_file(checkpoint)
    reader = RestrictedFileSystemReader(checkpoint, trust_pickle=trust_pickle)
    metadata = reader.read_metadata()
    tensors = {
        key: torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
        for key, entry in metadata.state_dict_metadata.items()
        if key.startswith(MODEL_PREFIX) and isinstance(entry, TensorStorageMetadata)
    }
    if not tensors:
        raise CheckpointError(
            f"{str(checkpoint)!r} holds no model tensors ('{MODEL_PREFIX}*' keys): it was not "
            "written by Checkpointer.save. Export a meshtrain checkpoint."
        )
    try:
        with single_process_dcp():
            dcp.load(tensors, storage_reader=reader, no_dist=True)
    except (Exception, CheckpointException) as err:  # a missing or damaged payload file
        raise CheckpointError(
            f"reading the tensors of {str(checkpoint)!r} failed: {type(err).__name__}: "
            f"{str(err).strip().splitlines()[0] if str(err).strip() else ''}. The checkpoint is "
            "damaged; export an earlier one (`meshtrain checkpoints DIR` lists them with their "
            "status)."
        ) from err
    named = {}
    for key, tensor in tensors.items():
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        named[key[len(MODEL_PREFIX) :]] = tensor.contiguous()
    header = {
        "format": "pt",
        "meshtrain_format": SAFETENSORS_FORMAT,
        "step": str(state.get("step", checkpoint_step(checkpoint))),
        "source": str(checkpoint.resolve()),
    }
    out_file.parent.mkdir(parents=True, exist_ok=True)
    with replaced_atomically(out_file) as scratch:
        save_file(named, str(scratch), metadata=header)
    return out_file


def load_safetensors(file: str | Path, model: nn.Module, *, strict: bool = True) -> None:
    """Copy a safetensors file's tensors into ``model``'s parameters of the same FQN, in place.

    ``model`` holds full tensors (call before ``plan.apply``); values are cast to each
    parameter's dtype. With ``strict`` every parameter must be in the file and every tensor in
    the file must be a parameter; shapes must always match. Raises :class:`CheckpointError`
    naming the mismatched FQNs and shapes before changing anything.

    Example:
        >>> import tempfile
        >>> from safetensors.torch import save_file
        >>> path = Path(tempfile.mkdtemp()) / "linear.safetensors"
        >>> save_file({"weight": torch.ones(2, 3), "bias": torch.zeros(2)}, str(path))
        >>> model = nn.Linear(3, 2)
        >>> load_safetensors(path, model)
        >>> model.weight.detach().sum().item()
        6.0
    """
    file = Path(file)
    targets: dict[str, nn.Parameter] = {}
    for fqn, param in model.named_parameters():
        if isinstance(param, DTensor):
            raise CheckpointError(
                f"parameter {fqn!r} is already a DTensor: load_safetensors fills a full model. "
                "Call it before plan.apply (initialise on full tensors, then distribute)."
            )
        if param.is_meta:
            raise CheckpointError(
                f"parameter {fqn!r} is on the meta device and cannot be filled: materialise the "
                "model first (model.to_empty(device='cpu'))."
            )
        targets[canonical_fqn(fqn)] = param
    if not file.is_file():
        raise CheckpointError(f"safetensors file {str(file)!r} does not exist: check the path.")
    with safe_open(str(file), framework="pt", device="cpu") as handle:
        names = set(handle.keys())
        shapes = {name: tuple(handle.get_slice(name).get_shape()) for name in names}
        problems = []
        missing = sorted(set(targets) - names)
        unexpected = sorted(names - set(targets))
        if strict and missing:
            problems.append(f"parameters missing from the file: {format_names(missing)}")
        if strict and unexpected:
            problems.append(f"tensors in the file that the model lacks: {format_names(unexpected)}")
        for name in sorted(names & set(targets)):
            if shapes[name] != tuple(targets[name].shape):
                problems.append(
                    f"{name!r} is {format_shape(shapes[name])} in the file but "
                    f"{format_shape(tuple(targets[name].shape))} in the model"
                )
        if problems:
            raise CheckpointError(
                f"cannot load {str(file)!r} into {type(model).__name__}:\n"
                + "\n".join(f"  - {problem}" for problem in problems)
                + "\nBuild the model with the configuration that was exported"
                + (" (or pass strict=False to skip missing and extra names)." if strict else ".")
            )
        with torch.no_grad():
            for name in sorted(names & set(targets)):
                targets[name].copy_(handle.get_tensor(name))
