"""Pipeline stage splitting: which module FQNs each (virtual) stage runs — pure, meta models work.

A model is a sequence of *units*: the root's parameterised children before the repeated blocks
(the embedding), each repeated block (a child of the ``ModuleList``/``ModuleDict``), and the
root's parameterised children after them (final norm, output head). Stages are contiguous runs
of units; the units before the blocks always go to the first stage and those after to the last.
``split="auto"`` chooses the cut points that minimise the heaviest stage's work (parameter count,
so the embedding and the head weigh in); a list of FQNs gives the first block of every stage but
the first instead. Parameter FQNs never change: a stage is the full model with other units
deleted, so checkpoints do not depend on the stage layout.

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
class _Units:
    before: tuple[str, ...]
    blocks: tuple[str, ...]
    after: tuple[str, ...]
    params: dict[str, int]


def split_stages(
    model: nn.Module, n_stages: int, *, split: str | Sequence[str] = "auto"
) -> tuple[Stage, ...]:
    """Cut ``model`` into ``n_stages`` contiguous stages (see the module docstring)."""
    units = _units(model)
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


def _units(model: nn.Module) -> _Units:
    containers = [
        (fqn, module)
        for fqn, module in model.named_modules()
        if isinstance(module, (nn.ModuleList, nn.ModuleDict))
    ]
    top = [(fqn, m) for fqn, m in containers if "." not in fqn]
    if len(top) != 1:
        raise PlanError(
            f"pipeline splitting needs exactly one ModuleList/ModuleDict of repeated blocks "
            f"directly under the root; {type(model).__name__} has "
            f"{[fqn for fqn, _ in top] or 'none'}. Give split points explicitly or restructure."
        )
    container_fqn, container = top[0]
    blocks = tuple(f"{container_fqn}.{name}" for name, _ in container.named_children())
    counted: set[int] = set()
    params: dict[str, int] = {}

    def count(module: nn.Module) -> int:
        total = 0
        for param in module.parameters():
            if id(param) not in counted:  # tied weights count once, where first seen
                counted.add(id(param))
                total += param.numel()
        return total

    before: list[str] = []
    after: list[str] = []
    seen_container = False
    for name, child in model.named_children():
        if name == container_fqn:
            seen_container = True
            for fqn, block in zip(blocks, container.children()):
                params[fqn] = count(block)
            continue
        if not any(True for _ in child.parameters()):
            continue
        params[name] = count(child)
        (after if seen_container else before).append(name)
    return _Units(tuple(before), blocks, tuple(after), params)


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
