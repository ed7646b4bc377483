"""Load a safetensors checkpoint (a ``transformers`` model directory or one file) into a model
that may already be planned and applied, each rank reading only the slices it holds.

For a DTensor parameter the global indices this rank holds along each dim are read off its
device mesh and placements (``Shard``, FSDP2's ``_StridedShard`` under tensor parallelism,
``Replicate``; uneven shards included) by splitting a small index probe exactly as DTensor splits
data (``distribute_tensor`` with ``src_data_rank=None``: local, no collective). The indices are
grouped into contiguous runs and each run is read with ``safe_open(...).get_slice(name)[...]``,
so a rank reads its share of each tensor and nothing else; values are cast to the parameter's
dtype. A plain tensor is read whole (it is the rank's). An NF4 (QLoRA) base weight is read the
same way and quantized shard by shard around the whole weight's scale mean (its shards' scale
sums added up over the ranks that shard it: one small all-reduce per weight), so each rank
holds exactly its shard of the weight quantized whole. Names may be mapped (``sources``: model
FQN → checkpoint name and an optional row order, e.g. meshtrain's Llama from transformers'
names with the rotary permutation, :func:`meshtrain.models.llama_hf.hf_sources`).

Every problem (missing, unexpected or mis-shaped keys, meta parameters) is found from the
headers before any tensor is read, agreed across ranks, and raised on every rank alike as one
:class:`CheckpointError` naming the keys and the files.

Example:
    >>> import tempfile
    >>> from safetensors.torch import save_file
    >>> from torch import nn
    >>> path = Path(tempfile.mkdtemp()) / "linear.safetensors"
    >>> save_file({"weight": torch.ones(2, 3), "bias": torch.zeros(2)}, str(path))
    >>> load_hf(path, nn.Linear(3, 2)).tensors
    2
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from meshtrain.adapters.nf4 import is_nf4, scale_mean, scale_sums, write_nf4
from meshtrain.errors import CheckpointError, format_shape
from meshtrain.lower.materialise import held
from meshtrain.train.checkpoint.files import canonical_fqn, format_names
from meshtrain.train.checkpoint.packed import packed_dim
from meshtrain.train.hf.experts import ExpertPiece, expert_pieces, fill_pieces, renamed
from meshtrain.train.hf.files import WeightFiles, weight_files

__all__ = ["LoadReport", "Sources", "load_hf", "local_indices"]

#: model FQN → (checkpoint tensor name, row order: the checkpoint row each model row reads, or None)
Sources = Mapping[str, tuple[str, Tensor | None]]


@dataclass(frozen=True)
class LoadReport:
    """What one rank loaded: tensors filled, bytes of tensor data it read (its slices) and bytes
    in the checkpoint's files."""

    tensors: int
    bytes_read: int
    checkpoint_bytes: int


@dataclass(frozen=True)
class _Target:
    fqn: str
    tensor: Tensor  # the parameter or buffer
    local: Tensor  # this rank's part of it (the tensor itself when not a DTensor)
    name: str  # in the checkpoint
    indices: list[Tensor]  # per dim, the checkpoint indices of the local elements
    pieces: tuple[ExpertPiece, ...] = ()  # a fused expert weight stored per expert (experts.py)


def load_hf(
    path: str | Path,
    model: nn.Module | Sequence[nn.Module],
    *,
    sources: Sources | None = None,
    strict: bool = True,
    exclude: Collection[str] = (),
    progress: Callable[[int, int], None] | None = None,
) -> LoadReport:
    """Fill ``model``'s parameters and persistent buffers, in place, from the checkpoint at
    ``path`` (see the module docstring); call on every rank alike, before or after
    ``mt.apply``.

    ``model`` may be a list of modules whose FQNs are the full model's (a pipeline's stages on
    this rank: ``PipelinedModel.modules``). ``sources`` maps model FQNs to checkpoint names
    (default: the same names; a tied parameter may come from any of its names). With ``strict``
    (default) every model tensor must be in the checkpoint and every checkpoint tensor must be
    used; shapes must always match. ``exclude``: model FQNs no checkpoint holds (LoRA adapters on
    a pretrained base), left as they are. ``progress(tensors_done, tensors)`` is called after
    each tensor this rank fills (a progress bar), from 0 to the total.
    """
    weights = weight_files(path)
    modules = [model] if isinstance(model, nn.Module) else list(model)
    targets, aliases = _model_tensors(modules)
    targets = {fqn: tensor for fqn, tensor in targets.items() if fqn not in exclude}
    problems: list[str] = []
    pieced: set[str] = set()  # per-expert checkpoint tensors a fused weight reads (or would)
    plan = _plan(weights, targets, aliases, sources, problems, pieced, strict=strict)
    claimed = {source[0] for source in (sources or {}).values()} if sources else set(targets)
    claimed |= {target.name for target in plan} | pieced
    gathered = _all_gather((problems, sorted(claimed & set(weights.files))))
    used = {name for _, names in gathered for name in names}
    used |= {alias for alias in aliases if sources is None}
    problems = sorted({problem for rank_problems, _ in gathered for problem in rank_problems})
    unexpected = sorted(set(weights.files) - used)
    if strict and unexpected:
        files = sorted({weights.where(name) for name in unexpected})
        problems.append(
            f"{len(unexpected)} tensor(s) in the checkpoint that the model lacks: "
            f"{format_names(unexpected)} (in {', '.join(files[:3])})"
        )
    if problems:
        raise CheckpointError(
            f"cannot load {str(weights.source)!r} into {type(modules[0]).__name__}:\n"
            + "\n".join(f"  - {problem}" for problem in problems)
            + "\nBuild the model from the checkpoint's own config.json (in a recipe: "
            '[model] hf = "DIR", or a Llama whose [model] keys match it), or point init_from at '
            "the checkpoint this model was made for"
            + (" (load_hf(..., strict=False) skips missing and extra names)." if strict else ".")
        )
    read = 0
    handles: dict[Path, Any] = {}
    if progress is not None:
        progress(0, len(plan))
    with contextlib.ExitStack() as stack, torch.no_grad():

        def read_slice(name: str, indices: list[Tensor]) -> tuple[Tensor, int]:
            file = weights.files[name]
            if file not in handles:
                handles[file] = stack.enter_context(safe_open(str(file), "pt", device="cpu"))
            return _read(handles[file].get_slice(name), indices)

        for done, target in enumerate(plan, start=1):
            read += _fill(target, read_slice)
            if progress is not None:
                progress(done, len(plan))
    return LoadReport(len(plan), read, weights.total_bytes())


def _model_tensors(modules: list[nn.Module]) -> tuple[dict[str, Tensor], dict[str, str]]:
    """Canonical FQN → parameter or persistent buffer; and each tied alias → its primary FQN."""
    targets: dict[str, Tensor] = {}
    aliases: dict[str, str] = {}
    primary: dict[int, str] = {}
    named = itertools.chain.from_iterable(
        itertools.chain(
            module.named_parameters(remove_duplicate=False), _persistent_buffers(module)
        )
        for module in modules
    )
    for fqn, tensor in named:
        fqn = canonical_fqn(fqn)
        if id(tensor) in primary:
            aliases[fqn] = primary[id(tensor)]
            continue
        primary[id(tensor)] = fqn
        targets[fqn] = tensor
    return targets, aliases


def _persistent_buffers(model: nn.Module) -> list[tuple[str, Tensor]]:
    found = []
    for prefix, module in model.named_modules():
        for name, buffer in module.named_buffers(recurse=False):
            if buffer is not None and name not in module._non_persistent_buffers_set:
                found.append((f"{prefix}.{name}" if prefix else name, buffer))
    return found


def _plan(
    weights: WeightFiles,
    targets: dict[str, Tensor],
    aliases: dict[str, str],
    sources: Sources | None,
    problems: list[str],
    pieced: set[str],
    *,
    strict: bool,
) -> list[_Target]:
    """What each model tensor reads, and the problems found on the way (from headers only);
    the per-expert tensors fused weights read are added to ``pieced``."""
    plan: list[_Target] = []
    missing: list[str] = []
    for fqn, tensor in targets.items():
        if sources is not None and fqn in sources:
            name, rows = sources[fqn]
        elif sources is not None:
            problems.append(f"{fqn!r} has no source name in the mapping given to load_hf")
            continue
        else:
            names = [fqn, *(alias for alias, main in aliases.items() if main == fqn)]
            name, rows = next((n for n in names if n in weights.files), fqn), None
        name = name if name in weights.files else renamed(name, weights.shapes) or name
        if name not in weights.files and not tensor.is_meta and rows is None:
            pieces = expert_pieces(name, tuple(tensor.shape), weights.shapes)
            if pieces is not None:
                pieced.update(piece.name for piece in pieces)
                plan.extend(_pieced(fqn, tensor, name, pieces, weights, problems, missing))
                continue
        if tensor.is_meta:
            problems.append(
                f"{fqn!r} is on the meta device: materialise the model first "
                "(mt.materialise(model, device=...)), then load"
            )
        elif name not in weights.files:
            missing.append(name)
        elif weights.shapes[name] != tuple(tensor.shape):
            problems.append(
                f"{name!r} is {format_shape(weights.shapes[name])} in {weights.where(name)} but "
                f"{fqn!r} is {format_shape(tuple(tensor.shape))} in the model"
            )
        else:
            try:
                indices = _checkpoint_indices(fqn, tensor, rows)
            except CheckpointError as err:
                problems.append(err.message)
                continue
            plan.append(_Target(fqn, tensor, held(tensor), name, indices))
    if missing and strict:
        where = weights.index.name if weights.index is not None else weights.where(None)
        problems.append(
            f"{len(missing)} tensor(s) the model needs are not in the checkpoint ({where}): "
            f"{format_names(sorted(missing))}"
        )
    return plan


def _pieced(
    fqn: str,
    tensor: Tensor,
    name: str,
    pieces: tuple[ExpertPiece, ...],
    weights: WeightFiles,
    problems: list[str],
    missing: list[str],
) -> list[_Target]:
    """The target of a fused expert weight read from its per-expert pieces (none on a problem,
    which is recorded: pieces missing or mis-shaped)."""
    absent = [piece.name for piece in pieces if piece.name not in weights.files]
    missing.extend(absent)
    cols = tuple(tensor.shape)[2]
    misshaped = [
        f"{piece.name!r} is {format_shape(weights.shapes[piece.name])} in "
        f"{weights.where(piece.name)} but {fqn!r} {format_shape(tuple(tensor.shape))} needs "
        f"{format_shape((piece.rows, cols))} per expert (fused as {name!r})"
        for piece in pieces
        if piece.name not in absent and weights.shapes[piece.name] != (piece.rows, cols)
    ]
    problems.extend(misshaped)
    if absent or misshaped:
        return []
    try:
        indices = _checkpoint_indices(fqn, tensor, None)
    except CheckpointError as err:
        problems.append(err.message)
        return []
    return [_Target(fqn, tensor, held(tensor), name, indices, pieces)]


def _checkpoint_indices(fqn: str, tensor: Tensor, rows: Tensor | None) -> list[Tensor]:
    """Per dim, the checkpoint indices of the elements this rank holds of ``tensor``."""
    if isinstance(tensor, DTensor):
        indices = local_indices(tensor)
        local_shape = tuple(tensor.to_local().shape)
        if tuple(len(index) for index in indices) != local_shape:
            raise CheckpointError(
                f"{fqn!r}: its placements {tensor.placements} on mesh "
                f"{tuple(tensor.device_mesh.shape)} give a local shape "
                f"{format_shape([len(index) for index in indices])}, but this rank holds "
                f"{format_shape(local_shape)}: this layout cannot be read slice by slice. Load "
                "before applying the plan (load_hf on the full model)"
            )
    else:
        indices = [torch.arange(size) for size in tensor.shape]
    if rows is not None and indices:
        indices = [rows[indices[0]], *indices[1:]]
    return indices


def _fill(target: _Target, read_slice: Callable[[str, list[Tensor]], tuple[Tensor, int]]) -> int:
    """Copy this rank's part of ``target`` from the checkpoint (its tensor, or its per-expert
    pieces); bytes read."""
    if target.pieces:
        return fill_pieces(target.local, target.indices, target.pieces, read_slice)
    data, read = read_slice(target.name, target.indices)
    if is_nf4(target.local):
        write_nf4(target.local, data, _whole_scale_mean(target.tensor, data, target.local.dtype))
    else:
        target.local.copy_(data)
    return read


def _whole_scale_mean(tensor: Tensor, local: Tensor, dtype: torch.dtype) -> Tensor:
    """The NF4 scale mean of the whole weight whose part ``local`` this rank read: the parts'
    scale sums added up over each mesh dim that shards ``tensor``."""
    sums = scale_sums(local.to(dtype))
    if isinstance(tensor, DTensor):
        mesh = tensor.device_mesh
        sums = sums.to(mesh.device_type)
        for dim, placement in enumerate(tensor.placements):
            if isinstance(placement, Shard | _StridedShard) and mesh.size(dim) > 1:
                dist.all_reduce(sums, group=mesh.get_group(dim))
    return scale_mean(sums.cpu(), dtype)


def local_indices(tensor: DTensor) -> list[Tensor]:
    """For each dim of ``tensor``, the global indices of the elements this rank holds, in the
    order its local tensor holds them (DTensor's own split of an index probe; no collective).

    Example::

        local_indices(param)  # Shard(0) over 2 ranks of an 8×4 weight: [tensor([0..3]), tensor([0..3])] on rank 0
    """
    placements = tensor.placements
    if any(not isinstance(p, Shard | _StridedShard | Replicate) for p in placements):
        raise CheckpointError(
            f"a tensor with placements {placements} cannot be loaded slice by slice (a parameter "
            "is sharded or replicated, never partial); load before applying the plan"
        )
    shape = tuple(tensor.shape)
    splits = [1] * len(shape)
    packed = packed_dim(tensor)  # each rank holds several pieces of that dim
    for index, (placement, size) in enumerate(
        zip(placements, tensor.device_mesh.shape, strict=True)
    ):
        if isinstance(placement, Shard | _StridedShard):  # FSDP2 under TP: _StridedShard
            splits[placement.dim] *= size * (packed[2] if packed and packed[0] == index else 1)
    indices = []
    for dim, size in enumerate(shape):
        probe_shape = [size if other == dim else splits[other] for other in range(len(shape))]
        view = [-1 if other == dim else 1 for other in range(len(shape))]
        probe = torch.arange(size).view(view).expand(probe_shape).contiguous()
        local = distribute_tensor(
            probe.to(tensor.device_mesh.device_type),
            tensor.device_mesh,
            placements,
            src_data_rank=None,
        ).to_local()
        flat = local.movedim(dim, 0).reshape(local.shape[dim], -1)
        indices.append(flat[:, 0].cpu() if flat.shape[1] else flat.new_zeros(0).cpu())
    return indices


def _read(stored: Any, indices: list[Tensor]) -> tuple[Tensor, int]:
    """The elements at ``indices`` (one index tensor per dim) of a safetensors slice, reading
    each contiguous run once; and the bytes read."""
    if not indices:  # a scalar
        value = stored[()]
        return value, value.element_size()
    unique, inverse = zip(
        *(torch.unique(index, return_inverse=True) for index in indices), strict=True
    )
    runs = [_runs(values) for values in unique]
    read = 0
    blocks: dict[tuple[int, ...], Tensor] = {}
    for combo in itertools.product(*(range(len(dim_runs)) for dim_runs in runs)):
        block = stored[tuple(slice(*runs[dim][k]) for dim, k in enumerate(combo))]
        read += block.numel() * block.element_size()
        blocks[combo] = block
    data = _assemble(blocks, [len(dim_runs) for dim_runs in runs])
    for dim, order in enumerate(inverse):
        if not torch.equal(order, torch.arange(len(order))):
            data = data.index_select(dim, order)
    return data, read


def _runs(values: Tensor) -> list[tuple[int, int]]:
    """Sorted unique indices as ``(start, stop)`` runs of consecutive values."""
    if values.numel() == 0:
        return [(0, 0)]
    breaks = (torch.nonzero(values[1:] != values[:-1] + 1).flatten() + 1).tolist()
    starts = [0, *breaks]
    stops = [*breaks, values.numel()]
    return [(int(values[a]), int(values[b - 1]) + 1) for a, b in zip(starts, stops, strict=True)]


def _assemble(blocks: dict[tuple[int, ...], Tensor], counts: list[int], dim: int = 0) -> Tensor:
    """Concatenate a grid of blocks (one per combination of runs) back into one tensor."""
    if len(counts) == 1:
        return torch.cat([blocks[(k,)] for k in range(counts[0])], dim=dim)
    parts = [
        _assemble(
            {key[1:]: block for key, block in blocks.items() if key[0] == k}, counts[1:], dim + 1
        )
        for k in range(counts[0])
    ]
    return torch.cat(parts, dim=dim)


def _all_gather(value: Any) -> list[Any]:
    if not (dist.is_available() and dist.is_initialized()):
        return [value]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered
