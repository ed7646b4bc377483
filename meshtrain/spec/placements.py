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
