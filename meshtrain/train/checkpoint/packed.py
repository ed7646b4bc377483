"""Packed shards in checkpoints: a DTensor split in parts of one dim, alike (transformers'
``packed_colwise``: ``_StridedShard(d, split_factor=f)`` with no other split of ``d`` after it,
as tensor parallelism inside the experts lays out ``gate_up_proj``), holds on each rank ``f``
pieces of the global tensor, not one. DCP (torch 2.13) describes a DTensor's local data by one
chunk, so it refuses such a tensor ("overlapping chunks"). :func:`checkpoint_view` gives DCP an
object that describes the ``f`` pieces as chunks of the global tensor, each a view of the local
data: saved, the checkpoint holds the global tensor as any other (any mesh loads it); loaded,
DCP writes each piece in place.

Example (the targets of ``dcp.save`` / ``dcp.load``)::

    state_dict = {fqn: checkpoint_view(tensor) for fqn, tensor in state_dict.items()}
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from meshtrain.spec.placements import packed_placement, unpacked_placements


def packed_dim(tensor: torch.Tensor) -> tuple[int, int, int] | None:
    """``(mesh dim, tensor dim, parts)`` of ``tensor``'s packed placement, if it is a DTensor
    with one (:func:`~meshtrain.spec.placements.packed_placement`)."""
    if not isinstance(tensor, DTensor):
        return None
    return packed_placement(tensor.placements, tuple(tensor.device_mesh.shape))


def checkpoint_view(tensor: Any) -> Any:
    """``tensor`` as DCP can save and load it: a :class:`PackedShards` for a packed DTensor,
    anything else unchanged."""
    found = packed_dim(tensor) if isinstance(tensor, torch.Tensor) else None
    return PackedShards(tensor, *found) if found is not None else tensor


class PackedShards:
    """A packed DTensor described to DCP by its pieces (see module doc)."""

    def __init__(self, tensor: DTensor, mesh_dim: int, dim: int, parts: int) -> None:
        self.tensor, self.dim, self.parts = tensor, dim, parts
        shape = list(tensor.shape)
        if shape[dim] % parts:
            raise ValueError(f"dim {dim} of {shape} does not split into {parts} packed parts")
        self.part = shape[dim] // parts
        viewed = [*shape[:dim], parts, self.part, *shape[dim + 1 :]]
        placements = unpacked_placements(tensor.placements, mesh_dim, dim)
        sizes, offsets = compute_local_shape_and_global_offset(
            torch.Size(viewed), tensor.device_mesh, placements
        )
        self.local_size, self.local_offset = sizes[dim + 1], offsets[dim + 1]
        self.sizes, self.offsets = list(sizes), list(offsets)

    @property
    def shape(self) -> torch.Size:
        return self.tensor.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.tensor.dtype

    def size(self) -> torch.Size:
        return self.tensor.size()

    def _pieces(self) -> list[tuple[torch.Size, torch.Size, torch.Tensor]]:
        """Per part: its chunk's offsets and sizes in the global tensor, and the local view."""
        local = self.tensor.to_local()
        unflat = local.unflatten(self.dim, (self.parts, self.local_size))
        pieces = []
        for part in range(self.parts):
            offsets = [
                *self.offsets[: self.dim],
                part * self.part + self.local_offset,
                *self.offsets[self.dim + 2 :],
            ]
            sizes = [*self.sizes[: self.dim], self.local_size, *self.sizes[self.dim + 2 :]]
            pieces.append((torch.Size(offsets), torch.Size(sizes), unflat.select(self.dim, part)))
        return pieces

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        return [
            WriteItem(
                index=MetadataIndex(fqn, offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
                    properties=TensorProperties.create_from_tensor(self.tensor.to_local()),
                    size=self.tensor.size(),
                ),
            )
            for offsets, sizes, _ in self._pieces()
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=o, sizes=s) for o, s, _ in self._pieces()]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        for offsets, _, piece in self._pieces():
            if index.offset is None or offsets == index.offset:
                return piece
        raise ValueError(f"no packed piece at offset {index.offset} for {index.fqn!r}")


class PackedSavePlanner(DefaultSavePlanner):
    """DCP's default save planner that also finds the pieces of :class:`PackedShards`."""

    def lookup_object(self, index: MetadataIndex) -> Any:
        found = self.state_dict.get(index.fqn)
        if isinstance(found, PackedShards):
            return found.__get_tensor_shard__(index)
        return super().lookup_object(index)


class PackedLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner that also writes into the pieces of :class:`PackedShards`
    (kept as they are through the default set-up, which drops objects it does not know)."""

    def set_up_planner(
        self, state_dict: dict[str, Any], metadata: Any = None, is_coordinator: bool = False
    ) -> None:
        packed = {
            fqn: value for fqn, value in state_dict.items() if isinstance(value, PackedShards)
        }
        super().set_up_planner(state_dict, metadata, is_coordinator)  # sets them to None
        state_dict.update(packed)
        self.state_dict.update(packed)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        found = self.state_dict.get(index.fqn)
        if isinstance(found, PackedShards):
            return found.__get_tensor_shard__(index)
        return super().lookup_tensor(index)
