"""Numerical contracts: how closely a plan must train like one device, and why that close.

A plan changes *where* arithmetic happens; whether that changes the result depends on whether it
changes the order of any reduction or the places where values are rounded:

* ``bitwise`` — no reduction changes order (activation checkpointing, ``aot_eager`` compile,
  a pipeline with one micro-batch, tensor-parallel axes nothing is sharded over): losses,
  gradients, parameters and optimizer states are identical bit for bit.
* ``reduction-order`` — fp32 throughout, but some sums are taken in another order: the
  data-parallel gradient sum (each rank sums its own samples first), micro-batch accumulation,
  tensor-parallel partial products, sequence-parallel norm gradients, inductor's fused kernels.
* ``approximate`` — a low-precision policy rounds partial results that one device rounds as a
  whole (see :func:`contract_for` for the sites).

The per-step relative bound (:attr:`Contract.tolerance`, against each tensor's largest magnitude)
for the loss, the global gradient norm and every gradient is, with ε the fp32 machine epsilon::

    2 · ε · depth · Σ levels(r)        levels(r) = ⌈log₂ ways(r)⌉ + 1

summed over the reorderings ``r``: re-associating a sum into ``ways`` partial sums adds at most
``⌈log₂ ways⌉`` roundings of the combined sum plus one inside the parts, each ≤ ε of the
magnitudes involved; a perturbation introduced in one block reaches the loss through the
``depth`` = blocks + 2 (input and head) layers without growing (residual, normalised blocks),
once forward and once backward (the 2). ``approximate`` (bf16/fp16) adds, for every compared
quantity, ``4 × max(ρ, u · scale)``: ``ρ`` the one-device reference's own low-precision error of
that quantity, measured each step against the same step run in fp32
(:mod:`meshtrain.testing.rounding`), and ``u`` the compute dtype's unit roundoff (bf16 2⁻⁸,
fp16 2⁻¹¹). The rounding sites the plan adds (each rank's gradient, tensor-parallel partial
products, pipeline casts: :attr:`Contract.rounding_sites`) are listed, not modelled: what they
do to a tensor depends on every op upstream of it, which the measurement sees and a model per
op type does not.

Parameters and optimizer states are compared after every step from the same starting point
(the harness copies the plan's values into the reference after each step); their element-wise
bounds follow from the gradient bound through the optimizer's update rule
(:mod:`meshtrain.testing.updates`).

Example:
    >>> c = Contract("reduction-order", (Reordering("data-parallel gradient sum", 2),), depth=4)
    >>> round(c.tolerance / EPS_FP32)
    16
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch

from meshtrain.plan.ir import Plan

Level = Literal["bitwise", "reduction-order", "approximate"]
EPS_FP32 = float(torch.finfo(torch.float32).eps)
UNIT_ROUNDOFF = {"bf16": 2.0**-8, "fp16": 2.0**-11, "fp32": 0.0}
#: The multiple of the one-device reference's own low-precision error a plan may add
#: (:func:`meshtrain.testing.rounding.rounding_bound` says why 4).
ROUNDING_FACTOR = 4.0


@dataclass(frozen=True)
class Reordering:
    """One reduction the plan takes in another order than one device: what, over how many parts."""

    what: str
    ways: int
    chained: int = 0

    @property
    def levels(self) -> int:
        """Extra roundings a value picks up: ⌈log₂ ways⌉ combining the parts, one inside them;
        ``chained`` > 0: the parts are combined one after another with that many roundings per
        combination, ``chained · (ways − 1) + 1``."""
        if self.chained:
            return self.chained * (self.ways - 1) + 1
        return math.ceil(math.log2(self.ways)) + 1


@dataclass(frozen=True)
class Contract:
    """A plan's numerical contract against the single-device reference (see the module doc)."""

    level: Level
    reorderings: tuple[Reordering, ...] = ()
    depth: int = 1
    precision: str = "fp32"
    rounding_sites: tuple[Reordering, ...] = ()

    @property
    def tolerance(self) -> float:
        """Relative bound per step for the loss, the gradient norm and each gradient from the
        reductions taken in another order (fp32 arithmetic); an ``approximate`` contract adds
        a multiple of the one-device reference's own measured rounding (:attr:`unit`)."""
        if self.level == "bitwise":
            return 0.0
        levels = sum(r.levels for r in self.reorderings)
        return 2 * EPS_FP32 * self.depth * levels

    @property
    def unit(self) -> float:
        """The compute dtype's unit roundoff under an ``approximate`` contract, else 0."""
        return UNIT_ROUNDOFF[self.precision] if self.level == "approximate" else 0.0

    def describe(self) -> str:
        """One paragraph: the level, what changes order or rounding, and the bound it gives."""
        if self.level == "bitwise":
            return "bitwise: no reduction changes order; every value must be identical."
        parts = [f"{r.what} ({r.ways} ways, {r.levels} levels)" for r in self.reorderings] or [
            "none"
        ]
        text = (
            f"{self.level}: reordered reductions: {'; '.join(parts)}; depth {self.depth}; "
            f"per-step relative bound {self.tolerance:.2e}"
        )
        if self.level == "approximate":
            sites = "; ".join(f"{s.what} ({s.ways} ways)" for s in self.rounding_sites)
            text += (
                f", plus {ROUNDING_FACTOR:g}× the one-device reference's own {self.precision} "
                f"error (measured against fp32, per tensor); rounded apart from one device: "
                f"{sites or 'none'}"
            )
        return text + "."

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (for the report)."""
        return {
            "level": self.level,
            "tolerance": self.tolerance,
            "depth": self.depth,
            "precision": self.precision,
            "reorderings": [{"what": r.what, "ways": r.ways} for r in self.reorderings],
            "rounding_sites": [{"what": s.what, "ways": s.ways} for s in self.rounding_sites],
        }


def expert_reordering(ways: int) -> Reordering:
    """Expert parallelism's reordering: each expert multiplies the rows its rank received (every
    expert rank's tokens, concatenated in rank order) where one device multiplies the global
    batch's, and sums its weight gradient over them in that order; the combine adds each token's
    ``k`` weighted expert outputs in ascending expert order from zero, as one device does (no
    reordering), and routing is the model's own.

    Example:
        >>> expert_reordering(4).levels
        3
    """
    return Reordering(
        "expert-parallel token dispatch: each expert's rows and weight-gradient sum "
        "taken over the tokens of its expert ranks",
        ways,
    )


def context_reordering(ways: int) -> Reordering:
    """Context parallelism's attention over ``ways`` ranks: each query row's softmax and its
    weighted sum of values are merged from the ranks' key blocks one after another (log-sum-exp:
    each merge rescales the running and the incoming partial results by ``exp`` of their maxima's
    difference and adds them, three roundings), where one device's SDPA kernel takes the row at
    once; the keys' and values' gradients are summed over the ranks' query blocks likewise.
    Whatever the merge order (ring or all-gather), it is at most this chain.

    Example:
        >>> context_reordering(4).levels
        10
    """
    return Reordering(
        "context-parallel attention: log-sum-exp merge of each row over the key "
        "blocks of the context ranks, key/value gradients over their query blocks",
        ways,
        chained=3,
    )


def contract_for(plan: Plan, *, statistics_size: int | None = None) -> Contract:
    """The contract ``plan`` promises against one device running the same precision policy.

    ``statistics_size``: the elements each BatchNorm channel sums over per step (batch ×
    spatial positions); data-parallel BatchNorm computes its statistics from sums taken in
    another order than one device's fused kernel, over all of them (default: the data-parallel
    ranks only, which undercounts).

    Example:
        >>> import meshtrain as mt
        >>> from meshtrain.models import LlamaConfig, build_llama, default_rules
        >>> model = build_llama(LlamaConfig.debug(), device="meta")
        >>> mesh = mt.make_mesh(dp=2, tp=2, world_size=4, abstract=True)
        >>> contract_for(mt.plan(model, mesh, default_rules())).level
        'reduction-order'
    """
    mesh, options = plan.mesh, plan.options
    reorderings: list[Reordering] = []
    data_ways = math.prod(mesh.size(axis) for axis in plan.token_axes)
    if data_ways > 1:
        reorderings.append(Reordering("data-parallel gradient and loss sum", data_ways))
    if plan.context_axis:
        reorderings.append(context_reordering(mesh.size(plan.context_axis)))
    if plan.experts and plan.expert_axis:
        reorderings.append(expert_reordering(mesh.size(plan.expert_axis)))
    if data_ways > 1 and plan.batch_norms:
        ways = max(statistics_size or data_ways, data_ways)
        reorderings.append(Reordering("BatchNorm statistics summed over data-parallel ranks", ways))
    micro = plan.pipeline.microbatches if plan.pipeline else options.microbatches
    if micro > 1:
        reorderings.append(Reordering("micro-batch gradient accumulation", micro))
    tp_ways = mesh.size(plan.tp_axis) if plan.tp_axis else 1
    tp_used = tp_ways > 1 and any(
        plan.tp_axis in layout.spec.axes for layout in plan.params if plan.tp_axis
    )
    if tp_used:
        reorderings.append(Reordering("tensor-parallel partial products", tp_ways))
    if plan.sequence_parallel and tp_ways > 1:
        reorderings.append(Reordering("sequence-parallel norm-weight gradient sum", tp_ways))
    if options.compile and options.compile_backend == "inductor":
        widest = max((max(layout.shape, default=1) for layout in plan.params), default=2)
        reorderings.append(
            Reordering("inductor kernels (fused norms, softmax and reductions)", max(widest, 2))
        )
    depth = max(len(plan.blocks), 1) + 2
    if options.precision != "fp32":
        sites = []
        if data_ways > 1:
            sites.append(
                Reordering("each rank's gradient, before the data-parallel sum", data_ways)
            )
        if micro > 1:
            sites.append(Reordering("each micro-batch's gradient, before accumulation", micro))
        if tp_used:
            sites.append(Reordering("tensor-parallel partial products, before their sum", tp_ways))
        if plan.pipeline is not None:
            stages = len(plan.pipeline.stages)
            sites.append(Reordering("casts per pipeline stage instead of per block", stages))
        if sites or reorderings:
            return Contract(
                "approximate", tuple(reorderings), depth, options.precision, tuple(sites)
            )
        # one device under the same policy rounds exactly where the plan does
        return Contract("bitwise", depth=depth, precision=options.precision)
    if not reorderings:
        return Contract("bitwise", depth=depth)
    return Contract("reduction-order", tuple(reorderings), depth)
