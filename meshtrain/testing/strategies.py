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
from typing import Any, Literal

from hypothesis import strategies as st
from torch import nn

from meshtrain.plan.options import CHECKPOINTING_MODES
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
    label: str = ""

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(repr(self))  # Hypothesis prints falsifying examples with this

    def __repr__(self) -> str:
        picked = self.label or ", ".join(
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


@dataclass(frozen=True)
class DebugLlama:
    """A picklable model factory for plan properties: the debug Llama with ``n_layers`` blocks.

    Example:
        >>> len(DebugLlama(n_layers=1)().layers)
        1
    """

    n_layers: int = 2

    def __call__(self) -> nn.Module:
        from meshtrain.models import LlamaConfig, build_llama

        return build_llama(LlamaConfig.preset("debug", n_layers=self.n_layers), seed=0)

    def __repr__(self) -> str:
        return f"DebugLlama(n_layers={self.n_layers})"


@dataclass(frozen=True)
class PlanCase:
    """A drawn plan: mesh, model size, rules and options, printed with only what is not default.

    ``harness_args()`` gives ``assert_equivalent``'s positional arguments and keyword options.
    """

    mesh_shape: tuple[tuple[str, int], ...]
    model_fn: DebugLlama
    rule_set: RuleSet
    options: tuple[tuple[str, object], ...]
    batch_size: int
    seq_len: int

    def plan_options(self) -> dict[str, object]:
        """``mt.plan`` keyword arguments, rules included."""
        return {"rules": self.rule_set.rules, **dict(self.options)}

    def harness_args(self) -> tuple[tuple[object, ...], dict[str, object]]:
        from meshtrain.testing.harness import TokenBatches

        embedding = self.model_fn().get_submodule("tok_embeddings")
        assert isinstance(embedding, nn.Embedding)
        batches = TokenBatches(
            embedding.num_embeddings, batch_size=self.batch_size, seq_len=self.seq_len
        )
        return (self.model_fn, dict(self.mesh_shape), self.plan_options()), {"batches": batches}

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(repr(self))

    def __repr__(self) -> str:
        mesh = ", ".join(f"{axis}: {size}" for axis, size in self.mesh_shape)
        options = "".join(f", {key}={value!r}" for key, value in self.options)
        return (
            f"PlanCase(mesh={{{mesh}}}, {self.model_fn!r}, {self.rule_set!r}{options}, "
            f"batch={self.batch_size}×{self.seq_len})"
        )


_DEFAULT_OPTIONS: dict[str, object] = {
    "zero": 3,
    "microbatches": 1,
    "pipeline": None,
    "activation_checkpointing": "none",
    "compile": False,
    "precision": "fp32",
    "grad_reduction": "mean",
}
_SCHEDULE_CHOICES = (
    ("GPipe", 1),
    ("1F1B", 1),
    ("Interleaved1F1B", 2),
    ("LoopedBFS", 2),
    ("InterleavedZeroBubble", 2),
    ("ZBVZeroBubble", 2),
)


@st.composite
def plan_cases(
    draw: st.DrawFn,
    world_size: int,
    *,
    max_layers: int = 4,
    compile_backends: Sequence[str] = ("aot_eager",),
    precisions: Sequence[str] = ("fp32", "bf16", "fp16"),
    grad_reductions: Sequence[str] = ("mean", "sum"),
) -> PlanCase:
    """Whole plans for the debug Llama on ``world_size`` ranks: mesh (dp, tp and pp, size-1 axes
    included), layer count, rules (:func:`rule_sets`, or the model's own logical rules), ZeRO
    stage, micro-batches or a pipeline schedule, activation checkpointing, compile, precision,
    data-parallel gradient reduction, and a batch that splits evenly.

    Every draw shrinks towards the simplest case: all ranks on dp, one layer, everything
    replicated, zero=3, no pipeline, no checkpointing, no compile, fp32, the smallest batch.
    Drawn plans need not be valid: ``mt.plan`` must then raise a ``MeshtrainError``.
    """
    sizes = {"dp": 1, "tp": 1, "pp": 1}
    for factor in _prime_factors(world_size):
        sizes[draw(st.sampled_from(("dp", "tp", "pp")))] *= factor
    options = dict(_DEFAULT_OPTIONS)
    n_stages, micro = 0, 1
    if sizes["pp"] > 1:
        schedule, per_rank = draw(st.sampled_from(_SCHEDULE_CHOICES))
        micro = sizes["pp"] * draw(st.integers(1, 2))
        from meshtrain.plan.pipeline.schedule import Pipeline

        options["pipeline"] = Pipeline(
            schedule=schedule, microbatches=micro, stages_per_rank=per_rank
        )
        n_stages = sizes["pp"] * per_rank
    n_layers = draw(st.integers(max(n_stages, 1), max(n_stages, max_layers)))
    model_fn = DebugLlama(n_layers)
    from meshtrain.models import LlamaConfig, build_llama

    meta = build_llama(LlamaConfig.preset("debug", n_layers=n_layers), device="meta")
    if draw(st.booleans()):  # the model's own logical rules (column-/row-wise pairs, TP-ready)
        from meshtrain.models import default_rules

        sequence_parallel = draw(st.booleans())
        rules = default_rules(sequence_parallel=sequence_parallel)
        rule_set = RuleSet(rules, (), sequence_parallel, label="llama default rules")
    else:
        rule_set = draw(rule_sets(meta))
    options["zero"] = draw(st.sampled_from((3, 0, 1, 2)))
    if options["pipeline"] is None:
        micro = draw(st.sampled_from((1, 2)))
        options["microbatches"] = micro
    options["activation_checkpointing"] = draw(st.sampled_from(CHECKPOINTING_MODES))
    backend = draw(st.sampled_from((None, *compile_backends)))
    options["compile"] = {"backend": backend} if backend else False
    options["precision"] = draw(st.sampled_from(tuple(precisions)))
    options["grad_reduction"] = draw(st.sampled_from(tuple(grad_reductions)))
    batch_size = sizes["dp"] * micro * draw(st.integers(1, 2))
    seq_len = draw(st.sampled_from((8, 16)))
    mesh_shape = tuple(
        (axis, sizes[axis]) for axis in ("pp", "dp", "tp") if axis != "pp" or sizes[axis] > 1
    )
    chosen = tuple((k, v) for k, v in options.items() if v != _DEFAULT_OPTIONS[k])
    return PlanCase(mesh_shape, model_fn, rule_set, chosen, batch_size, seq_len)
