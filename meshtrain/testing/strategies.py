"""Hypothesis strategies for meshes, specs and shapes that shrink to small readable cases.

Shrinking goes towards fewer axes, all ranks on the first axis, unsharded dims, and the smallest
shapes, so a failing property ends at the simplest mesh and spec that still fail.

Example:
    >>> from hypothesis import given
    >>> @given(meshes(world_size=4))
    ... def test_world(mesh):
    ...     assert mesh.world_size == 4
    >>> test_world()
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from hypothesis import strategies as st
from torch import nn

from meshtrain.spec.mesh import Mesh
from meshtrain.spec.partition import P, entry_axes
from meshtrain.spec.rules import Rules

AXIS_NAMES = ("dp", "tp", "pp", "cp")
InvalidKind = Literal["unknown_axis", "axis_twice", "too_long", "not_divisible"]
INVALID_KINDS: tuple[InvalidKind, ...] = ("unknown_axis", "axis_twice", "too_long", "not_divisible")


def _prime_factors(number: int) -> list[int]:
    factors, divisor = [], 2
    while number > 1:
        while number % divisor == 0:
            factors.append(divisor)
            number //= divisor
        divisor += 1
    return factors


@st.composite
def meshes(
    draw: st.DrawFn,
    world_size: int,
    *,
    max_axes: int = 3,
    names: Sequence[str] = AXIS_NAMES,
) -> Mesh:
    """Abstract meshes over exactly ``world_size`` ranks, size-1 axes included."""
    n_axes = draw(st.integers(1, min(max_axes, len(names))))
    chosen = draw(st.permutations(list(names)))[:n_axes]
    sizes = [1] * n_axes
    for factor in _prime_factors(world_size):
        sizes[draw(st.integers(0, n_axes - 1))] *= factor
    return Mesh(tuple(chosen), tuple(sizes))


@st.composite
def specs(draw: st.DrawFn, mesh: Mesh, ndim: int) -> P:
    """Specs for a rank-``ndim`` tensor that use each mesh axis at most once (any order)."""
    by_dim: dict[int, list[str]] = {}
    for axis in mesh.axis_names:
        dim = draw(st.sampled_from([None, *range(ndim)]))
        if dim is not None:
            by_dim.setdefault(dim, []).append(axis)
    entries: list[object] = [None] * ndim
    for dim, axes in by_dim.items():
        entries[dim] = tuple(draw(st.permutations(axes)))
    trailing = draw(st.integers(0, ndim))  # how many trailing entries to write out
    while len(entries) > trailing and entries[-1] is None:
        entries.pop()
    return P(*entries)


@st.composite
def shapes_for(
    draw: st.DrawFn, spec: P, mesh: Mesh, ndim: int, *, max_multiple: int = 3
) -> tuple[int, ...]:
    """Shapes that ``spec`` divides evenly on ``mesh``."""
    padded = spec.padded(ndim)
    return tuple(
        math.prod(mesh.size(axis) for axis in entry_axes(entry))
        * draw(st.integers(1, max_multiple))
        for entry in padded
    )


@st.composite
def sharded_shapes(draw: st.DrawFn, mesh: Mesh, *, max_ndim: int = 3) -> tuple[tuple[int, ...], P]:
    """A (shape, valid spec) pair on ``mesh``."""
    ndim = draw(st.integers(1, max_ndim))
    spec = draw(specs(mesh, ndim))
    return draw(shapes_for(spec, mesh, ndim)), spec


@st.composite
def invalid_specs(draw: st.DrawFn, mesh: Mesh) -> tuple[tuple[int, ...], P, InvalidKind]:
    """A (shape, spec, kind) triple where ``spec`` is invalid for ``shape`` on ``mesh``.

    ``not_divisible`` needs an axis larger than 1; on a mesh without one another kind is drawn.
    """
    shape, spec = draw(sharded_shapes(mesh))
    kinds = [k for k in INVALID_KINDS if k != "not_divisible" or max(mesh.axis_sizes) > 1]
    kind = draw(st.sampled_from(kinds))
    entries = list(spec.padded(len(shape)).entries)
    if kind == "too_long":
        return shape, P(*entries, *([None] * draw(st.integers(1, 2)))), kind
    if kind == "unknown_axis":
        unknown = "unknown_" + "_".join(mesh.axis_names)  # never one of the mesh's own names
        dim = draw(st.integers(0, len(shape) - 1))
        entries[dim] = (*entry_axes(entries[dim]), unknown)
        return shape, P(*entries), kind
    if kind == "axis_twice":
        axis = draw(st.sampled_from(mesh.axis_names))
        first, second = draw(st.permutations(range(len(shape) + 1)))[:2]
        cleaned = [tuple(a for a in entry_axes(e) if a != axis) or None for e in entries]
        cleaned.append(None)  # a spare dim so two distinct positions always exist
        shape = (*shape, 1)
        cleaned[first] = (*entry_axes(cleaned[first]), axis)
        cleaned[second] = (*entry_axes(cleaned[second]), axis)
        return shape, P(*cleaned), kind
    axis = draw(st.sampled_from([a for a, s in zip(mesh.axis_names, mesh.axis_sizes) if s > 1]))
    dim = draw(st.integers(0, len(shape) - 1))
    entries = [tuple(a for a in entry_axes(e) if a != axis) or None for e in entries]
    ways = math.prod(mesh.size(a) for a in entry_axes(entries[dim])) * mesh.size(axis)
    entries[dim] = (*entry_axes(entries[dim]), axis)
    bad_size = ways * draw(st.integers(1, 3)) + draw(st.integers(1, ways - 1))
    return (*shape[:dim], bad_size, *shape[dim + 1 :]), P(*entries), kind


#: What a drawn rule does to one module's parameters; the ``bad_*`` kinds make invalid plans.
ModuleChoice = Literal[
    "replicated", "colwise", "rowwise", "bad_data_axis", "bad_unknown_axis", "bad_norm_sharded"
]
_VALID_CHOICES: tuple[ModuleChoice, ...] = ("replicated", "colwise", "rowwise")


@dataclass(frozen=True)
class RuleSet:
    """A drawn rule set: the rules, and per module what was chosen (for readable failures)."""

    rules: Rules
    choices: tuple[tuple[str, ModuleChoice], ...]
    sequence_parallel: bool

    def __repr__(self) -> str:
        picked = ", ".join(
            f"{fqn}={choice}" for fqn, choice in self.choices if choice != "replicated"
        )
        return f"RuleSet(sp={self.sequence_parallel}, {picked or 'all replicated'})"


@st.composite
def rule_sets(
    draw: st.DrawFn,
    model: nn.Module,
    *,
    tp: str = "tp",
    data: str = "dp",
    invalid: bool = False,
) -> RuleSet:
    """Regex rule sets for ``model``: each Linear/Embedding replicated, column- or row-wise over
    ``tp`` (biases following their weight), norms replicated, and sequence parallelism on or off.

    With ``invalid=True`` some modules may instead name the data axis, an unknown axis, or shard
    a norm — the misconfigurations ``mt.plan`` must reject with a ``MeshtrainError``. Shrinks
    towards everything replicated and sequence parallelism off.
    """
    bad: tuple[ModuleChoice, ...] = (
        ("bad_data_axis", "bad_unknown_axis", "bad_norm_sharded") if invalid else ()
    )
    patterns: list[tuple[str, P]] = []
    choices: list[tuple[str, ModuleChoice]] = []
    for fqn, module in model.named_modules():
        own = [name for name, _ in module.named_parameters(recurse=False)]
        if not own:
            continue
        shardable = isinstance(module, (nn.Linear, nn.Embedding))
        options = _VALID_CHOICES if shardable else ("replicated",)
        options += tuple(b for b in bad if b != "bad_norm_sharded" or not shardable)
        choice = draw(st.sampled_from(options))
        choices.append((fqn, choice))
        for name in own:
            patterns.append(
                (re.escape(f"{fqn}.{name}" if fqn else name), _spec(choice, name, tp, data))
            )
    sequence_parallel = draw(st.booleans())
    logical = (("seq", tp),) if sequence_parallel else ()
    return RuleSet(Rules(patterns, logical=logical, fsdp=data), tuple(choices), sequence_parallel)


def _spec(choice: ModuleChoice, name: str, tp: str, data: str) -> P:
    weight = name == "weight"
    if choice == "colwise" or choice == "bad_norm_sharded":
        return P(tp)
    if choice == "rowwise":
        return P(None, tp) if weight else P()
    if choice == "bad_data_axis":
        return P(data)
    if choice == "bad_unknown_axis":
        return P("no_such_axis")
    return P()
