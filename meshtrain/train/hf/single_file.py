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
from safetensors.torch import save_file
from torch import nn
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from meshtrain.errors import CheckpointError
from meshtrain.files import replaced_atomically
from meshtrain.train.checkpoint.files import (
    MODEL_PREFIX,
    RestrictedFileSystemReader,
    checkpoint_step,
    read_state_file,
    single_process_dcp,
)
from meshtrain.train.hf.load import load_hf

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
    """Copy a safetensors file's tensors into ``model``'s parameters of the same FQN, in place:
    :func:`~meshtrain.train.hf.load.load_hf` on one file (a full model, or one already planned
    and applied: each rank reads its slices). Values are cast to each parameter's dtype. With
    ``strict`` every parameter must be in the file and every tensor in the file must be a
    parameter; shapes must always match. Raises :class:`CheckpointError` naming the mismatched
    FQNs and shapes before changing anything.

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
    load_hf(file, model, strict=strict)
