"""Named device meshes: ``make_mesh(dp=-1, tp=2)``.

A :class:`Mesh` is a description — ordered axis names and sizes and the device type — and
nothing else: making one never starts a process or creates a process group
(:func:`meshtrain.init_distributed` starts the runtime; lowering binds a mesh to a
``DeviceMesh`` over it when a plan is applied). Planning only ever needs the description, so an
*abstract* mesh (``abstract=True``: planning only, never bound) can describe 16,384 ranks on a
laptop.

Ranks are laid out row-major over the axes in the order given (the last axis varies fastest),
exactly as ``init_device_mesh`` lays them out: put the axis whose traffic is heaviest (usually
``tp``) last so that its groups are neighbouring ranks, i.e. inside a node.

Size-1 axes are allowed and cost nothing: the bound ``DeviceMesh`` spans the axes larger than 1
only, so no process group is created for an axis that cannot communicate. Specs may still name
size-1 axes; sharding over them is a no-op.
"""

from __future__ import annotations

import itertools
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from meshtrain.errors import MeshError, did_you_mean

_AXIS_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass(frozen=True)
class Mesh:
    """Ordered named axes and their sizes on one device type. ``abstract`` marks a mesh made for
    planning only (lowering refuses to bind it to processes); it does not take part in equality.

    Example:
        >>> mesh = Mesh(("dp", "tp"), (2, 4))
        >>> mesh
        Mesh({dp: 2, tp: 4})
        >>> mesh.world_size, mesh.size("tp"), mesh.coordinates(5)
        (8, 4, {'dp': 1, 'tp': 1})
    """

    axis_names: tuple[str, ...]
    axis_sizes: tuple[int, ...]
    device_type: str = "cpu"
    abstract: bool = field(default=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        _check_axes(self.axis_names, self.axis_sizes)
        for name, size in zip(self.axis_names, self.axis_sizes):
            if size < 1:
                raise MeshError(
                    f"mesh axis '{name}' has size {size} in {_format_axes(self.axis_names, self.axis_sizes)}: "
                    "a built mesh needs every size ≥ 1 (use make_mesh to resolve -1)."
                )

    @property
    def shape(self) -> dict[str, int]:
        """Axis name → size, in mesh order."""
        return dict(zip(self.axis_names, self.axis_sizes))

    @property
    def world_size(self) -> int:
        """Number of ranks the mesh spans."""
        return math.prod(self.axis_sizes)

    @property
    def is_abstract(self) -> bool:
        """True for a mesh made for planning only (``make_mesh(..., abstract=True)``)."""
        return self.abstract

    @property
    def device_axes(self) -> tuple[str, ...]:
        """The axes a bound ``DeviceMesh`` spans: those larger than 1 (or the first, at world 1)."""
        axes = tuple(name for name, size in zip(self.axis_names, self.axis_sizes) if size > 1)
        return axes or self.axis_names[:1]

    def size(self, axis: str) -> int:
        """Size of one axis; :class:`MeshError` naming the known axes if it does not exist."""
        if axis not in self.axis_names:
            raise MeshError(
                f"mesh {self} has no axis '{axis}'{did_you_mean(axis, self.axis_names, 'axes')}."
            )
        return self.axis_sizes[self.axis_names.index(axis)]

    def coordinates(self, rank: int) -> dict[str, int]:
        """Coordinates of ``rank`` along every axis (row-major, last axis fastest)."""
        if not 0 <= rank < self.world_size:
            raise MeshError(f"rank {rank} is outside mesh {self} of {self.world_size} ranks.")
        coords: dict[str, int] = {}
        for name, size in zip(reversed(self.axis_names), reversed(self.axis_sizes)):
            rank, coords[name] = divmod(rank, size)
        return {name: coords[name] for name in self.axis_names}

    def span(self, axis: str) -> int:
        """How many consecutive ranks one group along ``axis`` spans (its size × the sizes of the
        axes after it): a group lies inside a node of ``n`` ranks when its span is at most ``n``.

        Example:
            >>> Mesh(("dp", "tp"), (4, 8)).span("tp"), Mesh(("dp", "tp"), (4, 8)).span("dp")
            (8, 32)
        """
        return math.prod(self.axis_sizes[self.axis_names.index(axis) :]) if axis in self else 1

    def joined(self, axes: tuple[str, ...] | list[str]) -> str:
        """The name of the group spanning ``axes`` together: the axes larger than 1, in mesh
        order, joined by ``+`` (the axis names collectives, plans and counters use).

        Example:
            >>> Mesh(("pp", "dp", "tp"), (2, 4, 1)).joined(("tp", "dp", "pp"))
            'pp+dp'
        """
        return "+".join(a for a, n in zip(self.axis_names, self.axis_sizes) if a in axes and n > 1)

    def group_ranks(self, rank: int, axes: tuple[str, ...] | list[str]) -> tuple[int, ...]:
        """The ranks that share ``rank``'s coordinates on every axis outside ``axes``: its group
        over ``axes`` together.

        Example:
            >>> Mesh(("pp", "dp", "tp"), (2, 2, 2)).group_ranks(1, ("pp", "dp"))
            (1, 3, 5, 7)
        """
        mine = self.coordinates(rank)
        ranges = [
            range(size) if name in axes else (mine[name],)
            for name, size in zip(self.axis_names, self.axis_sizes)
        ]
        ranks = []
        for coords in itertools.product(*ranges):
            flat = 0
            for coord, size in zip(coords, self.axis_sizes):
                flat = flat * size + coord
            ranks.append(flat)
        return tuple(ranks)

    def __contains__(self, axis: object) -> bool:
        return axis in self.axis_names

    def __str__(self) -> str:
        return _format_axes(self.axis_names, self.axis_sizes)

    def __repr__(self) -> str:
        return f"Mesh({self})"

    def to_json(self) -> dict[str, object]:
        """JSON-friendly form (the device mesh is not serialised: rebuild it with make_mesh)."""
        return {"axes": self.shape, "device_type": self.device_type}


def make_mesh(
    axes: Mapping[str, int] | None = None,
    /,
    *,
    world_size: int | None = None,
    abstract: bool = False,
    device_type: str | None = None,
    **axis_sizes: int,
) -> Mesh:
    """Describe a named mesh; one axis may be ``-1`` and absorbs the ranks the others leave.

    The world size comes from ``world_size``, else the initialised process group, else the
    torchrun environment (``WORLD_SIZE``), else 1. Nothing is started: validation is pure, so a
    bad mesh is an error on every rank rather than a hang. ``abstract=True`` marks the mesh as
    planning only (a cluster that is not this one); a mesh made without it is bound to the
    running ranks (:func:`meshtrain.init_distributed`) when a plan on it is applied.
    ``device_type`` defaults to ``"cuda"`` where CUDA is available, else ``"cpu"``.

    Example:
        >>> make_mesh(dp=-1, tp=2, world_size=8, abstract=True)
        Mesh({dp: 4, tp: 2})
        >>> make_mesh({"pp": 2, "dp": -1, "tp": 8}, world_size=16384, abstract=True)
        Mesh({pp: 2, dp: 1024, tp: 8})
    """
    requested = _merge_axes(axes, axis_sizes)
    names = tuple(requested)
    world, source = _world_size(world_size)
    sizes = _resolve_sizes(names, tuple(requested.values()), world, source)
    device_type = device_type or _default_device_type()
    return Mesh(names, sizes, device_type, abstract=abstract)


def _merge_axes(axes: Mapping[str, int] | None, axis_sizes: Mapping[str, int]) -> dict[str, int]:
    merged: dict[str, int] = {}
    for source in (axes or {}), axis_sizes:
        for name, size in source.items():
            if name in merged:
                raise MeshError(f"mesh axis '{name}' is given twice; name each axis once.")
            merged[name] = size
    if not merged:
        raise MeshError("make_mesh needs at least one axis, e.g. make_mesh(dp=-1).")
    _check_axes(tuple(merged), tuple(merged.values()))
    return merged


def _check_axes(names: tuple[str, ...], sizes: tuple[int, ...]) -> None:
    if len(names) != len(sizes) or len(set(names)) != len(names):
        raise MeshError(
            f"mesh axes {names} and sizes {sizes} must pair up one to one with unique names."
        )
    for name, size in zip(names, sizes):
        if not isinstance(name, str) or not _AXIS_NAME.fullmatch(name):
            raise MeshError(
                f"mesh axis name {name!r} is not an identifier; use names like 'dp', 'tp', 'pp'."
            )
        if isinstance(size, bool) or not isinstance(size, int) or (size < 1 and size != -1):
            raise MeshError(
                f"mesh axis '{name}' has size {size!r} in {_format_axes(names, sizes)}: sizes are positive integers, "
                "or -1 for the one axis that takes the remaining ranks."
            )


def _resolve_sizes(
    names: tuple[str, ...], sizes: tuple[int, ...], world: int, source: str
) -> tuple[int, ...]:
    requested = _format_axes(names, sizes)
    free = [name for name, size in zip(names, sizes) if size == -1]
    fixed = math.prod(size for size in sizes if size != -1)
    if len(free) > 1:
        raise MeshError(
            f"mesh {requested} has -1 on axes {free}: at most one axis can take the remaining ranks. "
            "Give the others explicit sizes."
        )
    if free:
        if world % fixed:
            raise MeshError(
                f"mesh {requested} cannot fill a world of {world} ranks ({source}): the fixed axes multiply to "
                f"{fixed}, which does not divide {world}. Use sizes whose product divides {world}."
            )
        return tuple(world // fixed if size == -1 else size for size in sizes)
    if fixed != world:
        launch = (
            f" Launch {fixed} ranks with `torchrun --nproc_per_node {fixed} ...`, or plan without "
            f"processes with world_size={fixed}, abstract=True."
            if source == _NO_LAUNCHER
            else ""
        )
        raise MeshError(
            f"mesh {requested} spans {fixed} ranks but the world has {world} ({source}). Make the "
            f"sizes multiply to {world}, or write -1 for one axis to absorb the remainder "
            f"(e.g. {names[0]}=-1).{launch}"
        )
    return sizes


_NO_LAUNCHER = "no process group and no torchrun environment, so one rank"


def _world_size(explicit: int | None) -> tuple[int, str]:
    """The world size and where it came from (for error messages)."""
    if explicit is not None:
        if isinstance(explicit, bool) or not isinstance(explicit, int) or explicit < 1:
            raise MeshError(f"world_size={explicit!r} must be a positive integer.")
        return explicit, "world_size argument"
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), "initialised process group"
    env = os.environ.get("WORLD_SIZE")
    if env is None:
        return 1, _NO_LAUNCHER
    if not env.isdigit() or int(env) < 1:
        raise MeshError(f"WORLD_SIZE={env!r} in the environment is not a positive integer.")
    return int(env), "WORLD_SIZE from the launcher"


def _default_device_type() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _format_axes(names: tuple[str, ...], sizes: tuple[int, ...]) -> str:
    return "{" + ", ".join(f"{name}: {size}" for name, size in zip(names, sizes)) + "}"
