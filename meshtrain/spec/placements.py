"""``P`` ⇄ DTensor placements (pure conversions; :func:`meshtrain.distribute` uses them to turn a
full tensor into a DTensor).

This is the one module that knows DTensor's private shard-order machinery. A dim sharded over
several axes is major-to-minor in the order the spec writes them; DTensor applies placements in
mesh-dim order. When the two orders agree, plain ``Shard(d)`` on each axis is exact. When an
axis comes later in the spec than an axis that follows it in the mesh, DTensor needs
``_StridedShard(d, split_factor=f)``, where ``f`` is the product of the sizes of the axes that
come earlier in the spec but later in the mesh. A wrong order is not an error in DTensor: the
full tensor comes back silently scrambled, so every permutation is tested against
:func:`meshtrain.spec.layout.shard_slices`.

Placements are expressed over ``mesh.device_axes`` (the axes larger than 1); size-1 axes carry
no placement because sharding over one rank is the identity.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

from torch.distributed.tensor import Partial, Placement, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from meshtrain.errors import SpecError
from meshtrain.spec.mesh import Mesh
from meshtrain.spec.partition import P, entry_axes


def to_placements(spec: P, mesh: Mesh, ndim: int) -> tuple[Placement, ...]:
    """The DTensor placements (one per ``mesh.device_axes``) that realise ``spec``.

    The shape is not needed for the conversion; validate it separately with ``validate_spec``.

    Example:
        >>> mesh = Mesh(("dp", "tp"), (2, 2))
        >>> to_placements(P("tp", None), mesh, 2)
        (Replicate(), Shard(dim=0))
        >>> to_placements(P(("tp", "dp")), mesh, 1)
        (_StridedShard(dim=0, sf=2), Shard(dim=0))
    """
    if len(spec) > ndim:
        raise SpecError(
            f"{spec!r} has {len(spec)} entries but the tensor has {ndim} dims; give at most one "
            "entry per dim.",
            spec=spec,
            mesh=mesh,
        )
    device_axes = mesh.device_axes
    order = {axis: i for i, axis in enumerate(mesh.axis_names)}
    placements: dict[str, Placement] = {}
    for dim, entry in enumerate(spec):
        axes = entry_axes(entry)
        for i, axis in enumerate(axes):
            if axis not in mesh:
                raise SpecError(
                    f"{spec!r}: axis '{axis}' is not in mesh {mesh}.", spec=spec, mesh=mesh
                )
            if axis not in device_axes:
                continue
            split_factor = math.prod(
                mesh.size(earlier) for earlier in axes[:i] if order[earlier] > order[axis]
            )
            placements[axis] = (
                Shard(dim) if split_factor == 1 else _StridedShard(dim, split_factor=split_factor)
            )
    for axis in spec.unreduced:
        if axis in device_axes:
            placements[axis] = Partial("sum")
    return tuple(placements.get(axis, Replicate()) for axis in device_axes)


def is_sharded(placement: Placement) -> bool:
    """True for ``Shard`` and ``_StridedShard`` (whose ``is_shard()`` answers False).

    Example:
        >>> is_sharded(_StridedShard(0, split_factor=2)), is_sharded(Replicate())
        (True, False)
    """
    return isinstance(placement, (Shard, _StridedShard))


def from_placements(placements: Sequence[Placement], mesh: Mesh) -> P:
    """The spec that ``placements`` (over ``mesh.device_axes``) realise; the inverse of ``to_placements``.

    Example:
        >>> from_placements((Shard(0), Shard(0)), Mesh(("dp", "tp"), (2, 2)))
        P(('dp', 'tp'))
    """
    device_axes = mesh.device_axes
    if len(placements) != len(device_axes):
        raise SpecError(
            f"{len(placements)} placements {tuple(placements)} do not match the {len(device_axes)} "
            f"device axes {device_axes} of mesh {mesh}.",
            mesh=mesh,
        )
    by_dim: dict[int, list[str]] = {}
    unreduced = []
    for axis, placement in zip(device_axes, placements):
        if isinstance(placement, (Shard, _StridedShard)):
            by_dim.setdefault(placement.dim, []).append(axis)
        elif isinstance(placement, Partial):
            if placement.reduce_op != "sum":
                raise SpecError(
                    f"Partial({placement.reduce_op!r}) on axis '{axis}' has no P equivalent: "
                    "unreduced axes hold partial sums.",
                    mesh=mesh,
                )
            unreduced.append(axis)
        elif not isinstance(placement, Replicate):
            raise SpecError(
                f"placement {placement!r} on axis '{axis}' has no P equivalent.", mesh=mesh
            )
    if any(dim < 0 for dim in by_dim):
        raise SpecError(
            f"placements {tuple(placements)} use negative dims; normalise them first.", mesh=mesh
        )
    entries: list[object] = [None] * (max(by_dim) + 1 if by_dim else 0)
    for dim, axes in by_dim.items():
        entries[dim] = _order_for(dim, axes, placements, mesh)
    return P(*entries, unreduced=unreduced)


def _order_for(
    dim: int, axes: list[str], placements: Sequence[Placement], mesh: Mesh
) -> tuple[str, ...]:
    """The spec order of ``axes`` on ``dim`` whose placements equal the given ones."""
    wanted = {axis: placements[mesh.device_axes.index(axis)] for axis in axes}
    for order in itertools.permutations(axes):
        got = to_placements(P(*([None] * dim), order), mesh, dim + 1)
        if all(got[mesh.device_axes.index(axis)] == wanted[axis] for axis in axes):
            return order
    raise SpecError(
        f"placements {tuple(wanted.values())} on dim {dim} over axes {axes} match no major-to-minor "
        f"order of those axes on mesh {mesh}; they cannot be written as a P.",
        mesh=mesh,
    )


def packed_placement(
    placements: Sequence[Placement], sizes: Sequence[int]
) -> tuple[int, int, int] | None:
    """``(mesh dim, tensor dim, parts)`` of a *packed* placement among ``placements`` (one per
    mesh dim of ``sizes``): a ``_StridedShard(d, split_factor=f)`` whose ``f`` is not the product
    of the later mesh dims splitting ``d`` — each of ``f`` packed parts of ``d`` split over its
    mesh dim alike, as transformers' ``packed_colwise`` lays out ``gate_up_proj`` (FSDP2's own
    strided shards are such a product). A rank's data is then ``f`` pieces of the whole, which
    torch 2.13's checkpointing and ``full_tensor`` do not handle.

    Example:
        >>> packed_placement((_StridedShard(1, split_factor=2),), (2,))
        (0, 1, 2)
        >>> packed_placement((_StridedShard(0, split_factor=2), Shard(0)), (2, 2)) is None
        True
    """
    split_dims = [p.dim if isinstance(p, (Shard, _StridedShard)) else None for p in placements]
    for index, placement in enumerate(placements):
        if not isinstance(placement, _StridedShard):
            continue
        later = math.prod(
            size
            for size, split in zip(sizes[index + 1 :], split_dims[index + 1 :])
            if split == placement.dim
        )
        if later != placement.split_factor:
            return index, placement.dim, int(placement.split_factor)
    return None


def unpacked_placements(
    placements: Sequence[Placement], mesh_dim: int, dim: int
) -> tuple[Placement, ...]:
    """The placements of the same data viewed with packed dim ``dim`` unflattened into
    ``(parts, size / parts)``: the packed placement a plain ``Shard(dim + 1)``, splits of later
    dims one dim later.

    Example:
        >>> unpacked_placements((Shard(0), _StridedShard(1, split_factor=2), Shard(2)), 1, 1)
        (Shard(dim=0), Shard(dim=2), Shard(dim=3))
    """
    result: list[Placement] = []
    for index, placement in enumerate(placements):
        if index == mesh_dim:
            result.append(Shard(dim + 1))
        elif isinstance(placement, _StridedShard) and placement.dim > dim:
            result.append(_StridedShard(placement.dim + 1, split_factor=placement.split_factor))
        elif isinstance(placement, Shard) and placement.dim > dim:
            result.append(Shard(placement.dim + 1))
        else:
            result.append(placement)
    return tuple(result)
