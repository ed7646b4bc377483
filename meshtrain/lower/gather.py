"""The whole value of a tensor that may be a DTensor: what a test, a metric or a report reads
after a step.

Example:
    >>> import torch
    >>> full_tensor(torch.ones(2))
    tensor([1., 1.])
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from meshtrain.spec.placements import packed_placement, unpacked_placements

__all__ = ["full_tensor"]


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` whole: a DTensor gathered from its shards (``DTensor.full_tensor()``, a
    collective every rank of its mesh must call), any other tensor as it is. A packed DTensor
    (:func:`~meshtrain.spec.placements.packed_placement`: the experts' ``gate_up_proj`` split
    inside over tp), which torch 2.13 cannot gather beside other splits, is gathered as the view
    with its packed dim unflattened, where the packing is a plain split."""
    if not isinstance(tensor, DTensor):
        return tensor
    packed = packed_placement(tensor.placements, tuple(tensor.device_mesh.shape))
    if packed is None:
        return tensor.full_tensor()
    mesh_dim, dim, parts = packed
    shape = list(tensor.shape)
    viewed = [*shape[:dim], parts, shape[dim] // parts, *shape[dim + 1 :]]
    local = tensor.to_local().unflatten(dim, (parts, -1))
    unpacked = DTensor.from_local(
        local,
        tensor.device_mesh,
        unpacked_placements(tensor.placements, mesh_dim, dim),
        run_check=False,
        shape=torch.Size(viewed),
        stride=_contiguous_strides(viewed),
    )
    return unpacked.full_tensor().flatten(dim, dim + 1)


def _contiguous_strides(shape: list[int]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))
