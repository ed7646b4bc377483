"""Checking a spec against a shape and a mesh, and the reference answer for who holds what.

Policy on uneven sizes: **rejected**. A dim sharded over axes whose sizes multiply to ``k`` must
be divisible by ``k``, as in JAX. DTensor would accept uneven sizes with ``torch.chunk`` semantics
(trailing ranks hold smaller or empty shards), but that makes local shapes rank-dependent,
interacts badly with multi-axis shard orders and costs padding in every collective; a precise
error at plan time is cheaper than a surprise at step 10,000. (FSDP's own sharding over the data
axes is separate and pads as FSDP2 does.)

The functions here are pure: they need no process group and allocate nothing, so they run on
abstract meshes of any size.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from meshtrain.errors import SpecError, did_you_mean, format_shape
from meshtrain.spec.mesh import Mesh
from meshtrain.spec.partition import P, entry_axes


@dataclass(frozen=True)
class Subject:
    """What an error is about: the tensor, its spec, the mesh and the rule that chose the spec."""

    spec: P
    shape: tuple[int, ...]
    mesh: Mesh
    fqn: str | None = None
    rule: str | None = None

    def describe(self) -> str:
        """The common opening of every spec error."""
        what = f"parameter '{self.fqn}'" if self.fqn else "a tensor"
        via = f" (from rule {self.rule})" if self.rule else ""
        return (
            f"{what} (shape {format_shape(self.shape)}) cannot take {self.spec!r}{via} "
            f"on mesh {self.mesh}"
        )

    def error(self, reason: str) -> SpecError:
        """A :class:`SpecError` that carries every field of the subject."""
        return SpecError(
            f"{self.describe()}: {reason}",
            fqn=self.fqn,
            spec=self.spec,
            shape=self.shape,
            mesh=self.mesh,
            rule=self.rule,
        )


def validate_spec(
    spec: P,
    shape: Sequence[int],
    mesh: Mesh,
    *,
    fqn: str | None = None,
    rule: str | None = None,
) -> None:
    """Raise :class:`SpecError` unless ``spec`` is a valid even layout of ``shape`` on ``mesh``.

    Checks, in order: spec longer than the rank, unknown axis, an axis used twice (in two dims,
    twice in one dim, or both sharded and unreduced), and divisibility of every sharded dim.

    Example:
        >>> validate_spec(P("tp", None), (8, 4), Mesh(("dp", "tp"), (2, 2)))
        >>> validate_spec(P("tp"), (3, 4), Mesh(("tp",), (2,)), fqn="w")
        Traceback (most recent call last):
        ...
        meshtrain.errors.SpecError: parameter 'w' (shape 3×4) cannot take P('tp') on mesh {tp: 2}: dim 0 (3) is not divisible by tp=2. Use a tp size that divides 3, shard another dim, or pad the parameter to a multiple of 2.
    """
    subject = Subject(spec, tuple(int(size) for size in shape), mesh, fqn, rule)
    if len(spec) > len(shape):
        raise subject.error(
            f"the spec has {len(spec)} entries but the tensor has {len(shape)} dims. "
            f"Give at most one entry per dim, e.g. {P(*spec.entries[: len(shape)])!r}."
        )
    seen: dict[str, str] = {}
    uses = [(axis, f"dim {dim}") for dim, entry in enumerate(spec) for axis in entry_axes(entry)]
    uses += [(axis, "unreduced") for axis in sorted(spec.unreduced)]
    for axis, where in uses:
        if axis not in mesh:
            raise subject.error(
                f"axis '{axis}' is not in the mesh{did_you_mean(axis, mesh.axis_names, 'axes')}. "
                "Name an existing axis, or add it to make_mesh (size 1 is allowed)."
            )
        if axis in seen:
            raise subject.error(
                f"axis '{axis}' is used twice ({seen[axis]} and {where}); a spec can map every "
                "mesh axis to at most one dimension. Remove one of the uses."
            )
        seen[axis] = where
    for dim, entry in enumerate(spec):
        axes = entry_axes(entry)
        ways = math.prod(mesh.size(axis) for axis in axes)
        if shape[dim] % ways:
            over = "×".join(f"{axis}={mesh.size(axis)}" for axis in axes)
            if len(axes) > 1:
                over, fix = f"{over} = {ways}", f"Use sizes whose product divides {shape[dim]}"
            else:
                fix = f"Use a {axes[0]} size that divides {shape[dim]}"
            raise subject.error(
                f"dim {dim} ({shape[dim]}) is not divisible by {over}. {fix}, shard another dim, "
                f"or pad the parameter to a multiple of {ways}."
            )


def local_shape(spec: P, shape: Sequence[int], mesh: Mesh) -> tuple[int, ...]:
    """The shape every rank holds (the same on all ranks: sizes are even by policy).

    Example:
        >>> local_shape(P(("dp", "tp"), None), (8, 6), Mesh(("dp", "tp"), (2, 2)))
        (2, 6)
    """
    validate_spec(spec, shape, mesh)
    padded = spec.padded(len(shape))
    return tuple(
        size // math.prod(mesh.size(axis) for axis in entry_axes(entry))
        for size, entry in zip(shape, padded)
    )


def shard_slices(spec: P, shape: Sequence[int], mesh: Mesh, rank: int) -> tuple[slice, ...]:
    """The reference answer: which slice of the full tensor ``rank`` holds under ``spec``.

    A dim sharded over ``(a, b)`` is cut into ``size(a) * size(b)`` equal chunks, and the rank
    with coordinates ``(i, j)`` holds chunk ``i * size(b) + j`` (major to minor, in the order the
    spec writes the axes, whatever the mesh order). DTensor placements are tested against this.

    Example:
        >>> mesh = Mesh(("dp", "tp"), (2, 2))
        >>> shard_slices(P(("tp", "dp")), (8,), mesh, rank=1)  # dp=0, tp=1 -> chunk 1*2+0 = 2
        (slice(4, 6, None),)
    """
    validate_spec(spec, shape, mesh)
    coords = mesh.coordinates(rank)
    slices = []
    for size, entry in zip(shape, spec.padded(len(shape))):
        chunk_index, chunks = 0, 1
        for axis in entry_axes(entry):
            chunk_index = chunk_index * mesh.size(axis) + coords[axis]
            chunks *= mesh.size(axis)
        chunk = size // chunks
        slices.append(slice(chunk_index * chunk, (chunk_index + 1) * chunk))
    return tuple(slices)
