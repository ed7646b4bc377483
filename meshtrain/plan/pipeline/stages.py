"""Pipeline stage splitting: which module FQNs each (virtual) stage runs — pure, meta models work.

A model is a sequence of *units*: the parameterised modules before the repeated blocks (the
embedding), each repeated block (a child of the ``ModuleList``/``ModuleDict``, which may sit
anywhere: ``layers``, ``model.layers``, ``transformer.h``, ``encoder.layer``), and the
parameterised modules after them (final norm, output head). Stages are contiguous runs
of units; the units before the blocks always go to the first stage and those after to the last.
``split="auto"`` chooses the cut points that minimise the heaviest stage's work (parameter count,
so the embedding and the head weigh in); a list of FQNs gives the first block of every stage but
the first instead, and chooses the container on models with several. A Hugging Face model's
``base_model_pp_plan`` names its container. Parameter FQNs never change: a stage is the full
model with other units removed, so checkpoints do not depend on the stage layout.

Example:
    >>> from meshtrain.models import LlamaConfig, build_llama
    >>> model = build_llama(LlamaConfig.preset("debug", n_layers=4), device="meta")
    >>> [stage.blocks for stage in split_stages(model, 2)]
    [('layers.0', 'layers.1'), ('layers.2', 'layers.3')]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from meshtrain.errors import PlanError


@dataclass(frozen=True)
class Stage:
    """One pipeline stage: its index, the blocks it runs, and the root-level modules it keeps."""

    index: int
    blocks: tuple[str, ...]
    extras: tuple[str, ...]
    params: int

    @property
    def modules(self) -> tuple[str, ...]:
        """Every unit FQN this stage keeps, in model order."""
        return (*self.extras, *self.blocks) if self.index == 0 else (*self.blocks, *self.extras)


@dataclass(frozen=True)
class Units:
    """A model as pipeline units: modules before the block container, its blocks, modules after
    it, the container's FQN, and each unit's parameter count."""

    before: tuple[str, ...]
    blocks: tuple[str, ...]
    after: tuple[str, ...]
    container: str
    params: dict[str, int]


def split_stages(
    model: nn.Module, n_stages: int, *, split: str | Sequence[str] = "auto"
) -> tuple[Stage, ...]:
    """Cut ``model`` into ``n_stages`` contiguous stages (see the module docstring)."""
    units = units_of(model, split)
    blocks = units.blocks
    if n_stages < 1:
        raise PlanError(f"a pipeline needs at least 1 stage; got {n_stages}.")
    if len(blocks) < n_stages:
        raise PlanError(
            f"{type(model).__name__} has {len(blocks)} repeated blocks but the pipeline asks for "
            f"{n_stages} stages; every stage needs at least one block. Use at most {len(blocks)} "
            "stages (pp size × stages_per_rank), or a deeper model."
        )
    weight = [units.params[b] for b in blocks]
    weight[0] += sum(units.params[f] for f in units.before)
    weight[-1] += sum(units.params[f] for f in units.after)
    if isinstance(split, str):
        if split != "auto":
            raise PlanError(f"split={split!r}: use 'auto' or a list of block FQNs.")
        starts = _balanced_starts(weight, n_stages)
    else:
        starts = _given_starts(list(split), blocks, n_stages)
    bounds = [*starts, len(blocks)]
    stages = []
    for index in range(n_stages):
        chunk = blocks[bounds[index] : bounds[index + 1]]
        extras = units.before if index == 0 else ()
        extras += units.after if index == n_stages - 1 else ()
        params = sum(units.params[f] for f in (*chunk, *extras))
        stages.append(Stage(index, chunk, extras, params))
    return tuple(stages)


def units_of(model: nn.Module, split: str | Sequence[str] = "auto") -> Units:
    """The model as units: parameterised modules before the block container, its blocks, and
    parameterised modules after it, wherever the container sits (``layers``, ``model.layers``,
    ``transformer.h``, ``encoder.layer``)."""
    container_fqn = _container(model, split)
    container = model.get_submodule(container_fqn)
    blocks = tuple(f"{container_fqn}.{name}" for name, _ in container.named_children())
    counted: set[int] = set()

    def count(module: nn.Module) -> int:
        total = 0
        for param in module.parameters():
            if id(param) not in counted:  # tied weights count once, where first seen
                counted.add(id(param))
                total += param.numel()
        return total

    params = {fqn: count(block) for fqn, block in zip(blocks, container.children())}
    before, after = _around(model, container_fqn)
    for fqn in (*before, *after):
        params[fqn] = count(model.get_submodule(fqn))
    return Units(before, blocks, after, container_fqn, params)


def _container(model: nn.Module, split: str | Sequence[str]) -> str:
    """The ModuleList/ModuleDict of repeated blocks: the parent of explicit split points, else
    the one a Hugging Face ``base_model_pp_plan`` names, else the only one there is."""
    modules = dict(model.named_modules())
    if not isinstance(split, str) and split:
        parents = {fqn.rpartition(".")[0] for fqn in split}
        parent = next(iter(parents))
        if len(parents) == 1 and isinstance(modules.get(parent), (nn.ModuleList, nn.ModuleDict)):
            return parent
        raise PlanError(
            f"split={list(split)!r}: split points must be blocks of one ModuleList/ModuleDict "
            f"(e.g. 'layers.4'); their parents are {sorted(parents)}."
        )
    containers = [
        fqn
        for fqn, module in modules.items()
        if isinstance(module, (nn.ModuleList, nn.ModuleDict))
        and any(True for _ in module.parameters())
    ]
    named = _pp_plan_container(model, modules)
    if named is not None:
        return named
    outermost = [
        c for c in containers if not any(c.startswith(o + ".") for o in containers if o != c)
    ]
    if len(outermost) == 1:
        return outermost[0]
    raise PlanError(
        f"pipeline splitting needs one ModuleList/ModuleDict of repeated blocks; "
        f"{type(model).__name__} has {outermost or 'none'}. Pass split=[...] with the first "
        "block of every stage after the first (e.g. split=['layers.4']) to choose the container."
    )


def _pp_plan_container(model: nn.Module, modules: dict[str, nn.Module]) -> str | None:
    """The block container a Hugging Face model names in ``config.base_model_pp_plan``."""
    plan = getattr(getattr(model, "config", None), "base_model_pp_plan", None) or {}
    prefix = getattr(model, "base_model_prefix", "") or ""
    for name in plan:
        fqn = f"{prefix}.{name}" if prefix and f"{prefix}.{name}" in modules else name
        if isinstance(modules.get(fqn), (nn.ModuleList, nn.ModuleDict)):
            return fqn
    return None


def _around(model: nn.Module, container: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Parameterised modules before and after the container, walking the path from the root to
    it: at each level, the siblings registered before the path go first (outer levels first),
    those after it last (inner levels first). Parameters held directly by a module on the path
    belong to no unit and are a PlanError."""
    before: list[str] = []
    after: list[list[str]] = []
    node, prefix = model, ""
    for part in container.split("."):
        own = [name for name, _ in node.named_parameters(recurse=False)]
        if own:
            raise PlanError(
                f"'{prefix + '.' if prefix else ''}{own[0]}' is a parameter of "
                f"{type(node).__name__} '{prefix}' on the way to the blocks, so it belongs to no "
                "pipeline stage; move it into a submodule (e.g. an nn.Module holding it)."
            )
        level_after: list[str] = []
        seen = False
        for name, child in node.named_children():
            fqn = f"{prefix}.{name}" if prefix else name
            if name == part:
                seen = True
                continue
            if any(True for _ in child.parameters()):
                (level_after if seen else before).append(fqn)
        after.append(level_after)
        node, prefix = node.get_submodule(part), f"{prefix}.{part}" if prefix else part
    return tuple(before), tuple(fqn for level in reversed(after) for fqn in level)


def _balanced_starts(weight: list[int], n_stages: int) -> list[int]:
    """Start indices of ``n_stages`` contiguous groups minimising the heaviest group (exact DP)."""
    n = len(weight)
    prefix = [0]
    for w in weight:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # best[k][i]: minimal heaviest group splitting the first i blocks into k groups
    best = [[inf] * (n + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0
    for k in range(1, n_stages + 1):
        for i in range(k, n - (n_stages - k) + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    starts, i = [], n
    for k in range(n_stages, 0, -1):
        i = cut[k][i]
        starts.append(i)
    return starts[::-1]


def _given_starts(split: list[str], blocks: tuple[str, ...], n_stages: int) -> list[int]:
    if len(split) != n_stages - 1:
        raise PlanError(
            f"split={split!r} gives {len(split)} split points for {n_stages} stages; give "
            f"{n_stages - 1}: the first block of every stage after the first."
        )
    starts = [0]
    for fqn in split:
        if fqn not in blocks:
            raise PlanError(
                f"split point '{fqn}' is not a repeated block FQN; use names such as "
                f"{list(blocks[:3])} (a stage starts at a block)."
            )
        index = blocks.index(fqn)
        if index <= starts[-1]:
            raise PlanError(
                f"split point '{fqn}' does not come after the previous stage's first block "
                f"'{blocks[starts[-1]]}'; give split points in model order, one block apart at least."
            )
        starts.append(index)
    return starts
