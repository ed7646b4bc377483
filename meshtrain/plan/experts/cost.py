"""Expert parallelism costed: one rank's expert memory and its all-to-all traffic per step.

Pure arithmetic over explicit arguments (no model, no process group), so that a 671B mixture of
experts on 2,048 abstract ranks is sized in microseconds.

**Memory.** An MoE layer's expert weights (``gate_up_proj`` [E, 2I, H] and ``down_proj``
[E, H, I]) are split over the expert axis on dim 0 (each ``ep`` rank keeps ``E / ep`` experts)
and, under ZeRO ≥ 1, over the data axes not in ``ep`` (``efsdp`` ranks: torchtitan's name):
master copy, gradient and optimizer states are ``numel / (ep · efsdp)`` elements each (ZeRO 0:
``numel / ep``). A step gathers each layer's local experts over ``efsdp`` in the parameter
dtype (bf16 under mixed precision), the same rules the rest of the plan follows
(:mod:`meshtrain.plan.cost`).

**All-to-all.** A micro-batch gives each rank ``T`` tokens (its sequences × their length); each
token goes to ``k`` experts, so a rank dispatches ``T · k`` rows of width ``H`` (in the compute
dtype) to the ranks that hold their experts, and the combine sends the same rows back. Per MoE
layer and micro-batch: forward dispatch + combine, and backward their two gradients (all-to-alls
of the same sizes, reversed); a checkpointed block repeats its forward pair in backward (the
selective policy keeps matmul and attention outputs only, so both modes recompute them).

The *payload* of one all-to-all is the larger of a rank's send and receive buffers (rows kept on
the rank included), which is what :class:`~meshtrain.testing.CollectiveCounter` measures; a rank
sends ``(ep − 1) / ep`` of it to other ranks under uniform routing.

Two routings are costed:

- ``uniform``: every rank sends and receives ``T · k`` rows, ``T · k / ep`` to each rank;
- ``worst``: the bound the balance settings allow. Routing is dropless (no capacity factor, no
  token dropped), and neither the auxiliary loss nor bias balancing *bounds* the load of a
  step, so without a stated ``max_load`` the worst case is every rank sending all of its rows
  that can land on one rank to that rank: ``ep · T · min(k, E / ep)`` rows received there (a
  token's ``k`` experts are distinct, so at most ``E / ep`` of them live on one rank). With
  ``max_load = f`` (an observed or enforced bound on the busiest rank's rows over the mean), the
  busiest rank receives ``min(f · T · k, that bound)`` rows.

Example:
    >>> layer = ExpertLayer.swiglu("layers.3.moe.experts", num_experts=8, top_k=2, hidden=64, inter=32)
    >>> rows_per_rank(layer, tokens=128, ep=4), rows_per_rank(layer, tokens=128, ep=4, routing="worst")
    (256, 1024)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

from meshtrain.errors import PlanError
from meshtrain.plan.cost import estimate_collectives
from meshtrain.plan.decisions import fsdp_decisions
from meshtrain.plan.ir import Collective, ExpertGroup, FSDPUnit, Memory, ParamLayout
from meshtrain.plan.memory.sizes import format_bytes
from meshtrain.plan.options import PlanOptions

Routing = Literal["uniform", "worst"]
_INDEX_BYTES = 8  # int64 tokens per expert


@dataclass(frozen=True)
class ExpertLayer:
    """One MoE layer as costing sees it: its experts module, ``num_experts`` experts, ``top_k``
    of them per token, tokens of width ``hidden``, and the global ``shapes`` of its expert
    weights (experts on dim 0).

    Example:
        >>> ExpertLayer.swiglu("moe.experts", num_experts=256, top_k=8, hidden=7168, inter=2048).numel
        11274289152
    """

    fqn: str
    num_experts: int
    top_k: int
    hidden: int
    shapes: tuple[tuple[int, ...], ...]

    @classmethod
    def swiglu(
        cls, fqn: str, *, num_experts: int, top_k: int, hidden: int, inter: int
    ) -> ExpertLayer:
        """Fused SwiGLU experts: ``gate_up_proj`` [E, 2·inter, hidden], ``down_proj`` [E, hidden, inter]."""
        shapes = ((num_experts, 2 * inter, hidden), (num_experts, hidden, inter))
        return cls(fqn, num_experts, top_k, hidden, shapes)

    @property
    def inter(self) -> int:
        """One expert's hidden width, for SwiGLU experts (3 · inter · hidden weights each)."""
        return self.numel // (self.num_experts * 3 * self.hidden)

    @property
    def numel(self) -> int:
        """Elements of the layer's expert weights (all experts)."""
        return sum(math.prod(shape) for shape in self.shapes)

    def local_shapes(self, ep: int) -> tuple[tuple[int, ...], ...]:
        """The weights' shapes on one of ``ep`` ranks (dim 0 split)."""
        local = self.local_experts(ep)
        return tuple((local, *shape[1:]) for shape in self.shapes)

    def local_experts(self, ep: int) -> int:
        """Experts each of ``ep`` ranks holds; a PlanError naming the layer when they do not
        split evenly."""
        if ep < 1 or self.num_experts % ep:
            raise PlanError(
                f"experts module '{self.fqn}' has {self.num_experts} experts, which do not split "
                f"over an expert axis of {ep} ranks. Use an ep size that divides "
                f"{self.num_experts}.",
                fqn=self.fqn,
            )
        return self.num_experts // ep


def rows_per_rank(
    layer: ExpertLayer,
    *,
    tokens: int,
    ep: int,
    routing: Routing = "uniform",
    max_load: float | None = None,
) -> int:
    """Rows in the busiest rank's larger all-to-all buffer, per all-to-all, for ``tokens``
    tokens per rank (see the module docstring for the two routings).

    Example:
        >>> layer = ExpertLayer.swiglu("e", num_experts=256, top_k=8, hidden=1, inter=1)
        >>> [rows_per_rank(layer, tokens=100, ep=ep, routing="worst") for ep in (1, 8, 64)]
        [800, 6400, 25600]
    """
    sent = tokens * layer.top_k
    if routing == "uniform":
        return sent
    if routing != "worst":
        raise PlanError(f"routing {routing!r} is not costed: use 'uniform' or 'worst'.")
    received = ep * tokens * min(layer.top_k, layer.local_experts(ep))
    if max_load is not None:
        if max_load < 1:
            raise PlanError(
                f"max_load={max_load} is below 1: it bounds the busiest rank's rows over the "
                "mean, which is at least 1. Give a factor ≥ 1, or None for the dropless bound."
            )
        received = min(received, math.ceil(max_load * sent))
    return max(sent, received)


def all_to_all_collectives(
    layers: Sequence[ExpertLayer],
    *,
    axis: str,
    ep: int,
    tokens: int,
    microbatches: int = 1,
    activation_bytes: int = 4,
    recomputed: int = 0,
    routing: Routing = "uniform",
    max_load: float | None = None,
) -> tuple[Collective, ...]:
    """The all-to-alls of one optimizer step over ``axis`` (``ep`` ranks), for one rank, as the
    lowering (:mod:`meshtrain.lower.experts.parallel`) issues them per MoE layer and micro-batch:
    in forward the tokens per expert (``E`` int64: each rank's rows for every expert), the
    tokens and the results back; in backward the gradients of the tokens and of the results.
    ``recomputed`` of the layers sit in checkpointed blocks and repeat their forward three in
    backward. ``tokens``: tokens per rank per micro-batch;
    ``activation_bytes``: bytes per element of the dispatched rows (the compute dtype).

    Example:
        >>> layer = ExpertLayer.swiglu("e", num_experts=8, top_k=2, hidden=64, inter=32)
        >>> [(c.count, c.bytes) for c in all_to_all_collectives([layer], axis="ep", ep=2, tokens=16)]
        [(2, 16384), (1, 64), (2, 16384)]
    """
    if ep <= 1 or not layers:
        return ()

    def rows(layer: ExpertLayer) -> int:
        return rows_per_rank(layer, tokens=tokens, ep=ep, routing=routing, max_load=max_load)

    def pair(layer: ExpertLayer) -> int:  # tokens out and results back, one micro-batch
        return 2 * rows(layer) * layer.hidden * activation_bytes

    def routing_data(layer: ExpertLayer) -> int:  # the tokens per expert, int64
        return _INDEX_BYTES * layer.num_experts

    n, how, again = len(layers) * microbatches, f"{routing} routing", layers[:recomputed]
    tokens_forward = sum(pair(layer) for layer in layers) * microbatches
    routed = sum(routing_data(layer) for layer in layers) * microbatches
    result = [
        Collective(
            "all_to_all",
            axis,
            2 * n,
            tokens_forward,
            f"tokens to their experts and the results back, forward, {how}",
        ),
        Collective("all_to_all", axis, n, routed, "tokens per expert (int64), forward"),
        Collective(
            "all_to_all",
            axis,
            2 * n,
            tokens_forward,
            f"gradients of the results and of the tokens, backward, {how}",
        ),
    ]
    if recomputed:
        repeated = sum(pair(layer) + routing_data(layer) for layer in again) * microbatches
        result.append(
            Collective(
                "all_to_all",
                axis,
                3 * recomputed * microbatches,
                repeated,
                f"the forward's three again, recomputing checkpointed blocks, {how}",
            )
        )
    return tuple(result)


def expert_memory(
    layers: Sequence[ExpertLayer],
    *,
    ep: int,
    efsdp: int,
    zero: int,
    optimizer_states: int,
    param_bytes: int,
    element_bytes: int = 4,
    reduce_bytes: int = 4,
    shard_dim: int = 0,
) -> Memory:
    """One rank's bytes for the experts of ``layers``: master copy, gradient and optimizer
    states (``optimizer_states`` per parameter), each its ``1 / (ep · efsdp)`` share where the
    ZeRO stage shards it at rest (:func:`fsdp_decisions`), else the ``1 / ep`` share, in the
    parameters' ``element_bytes``; during a step, the largest layer's local experts gathered twice (the one computing and the one prefetched) in
    ``param_bytes`` and one layer's unsharded gradient in ``reduce_bytes`` — the peaks
    :mod:`meshtrain.plan.cost` gives an FSDP unit. FSDP2 splits dim ``shard_dim`` of each
    local weight ([E / ep, 2I, H] and [E / ep, H, I]) into ``efsdp`` chunks padded to the
    largest, so dim 0 with fewer local experts than ``efsdp`` ranks pads: shard dim 1 then.

    Example:
        >>> layer = ExpertLayer.swiglu("e", num_experts=8, top_k=2, hidden=64, inter=32)
        >>> expert_memory([layer], ep=4, efsdp=2, zero=3, optimizer_states=2, param_bytes=4).params
        24576
        >>> expert_memory([layer], ep=4, efsdp=4, zero=3, optimizer_states=2, param_bytes=4).params
        24576
    """
    decided = fsdp_decisions(zero)
    ways = efsdp if decided.wrapper == "fully_shard" else 1
    shard = sum(
        _fsdp_shard(shape, shard_dim, ways) for layer in layers for shape in layer.local_shapes(ep)
    )
    local = [sum(math.prod(shape) for shape in layer.local_shapes(ep)) for layer in layers]
    whole = sum(local)

    def at_rest(sharded: bool) -> int:
        return (shard if sharded else whole) * element_bytes

    cast = param_bytes != element_bytes
    gathered = 2 * max(local, default=0) * param_bytes if ways > 1 or cast else 0
    unsharded = max(local, default=0) * reduce_bytes if ways > 1 else 0
    return Memory(
        params=at_rest(decided.shard_params),
        grads=at_rest(decided.shard_grads),
        optimizer_states=at_rest(decided.shard_optimizer_states) * optimizer_states,
        gathered_params=gathered,
        unsharded_grads=unsharded,
    )


def moe_working_set(
    layer: ExpertLayer,
    *,
    tokens: int,
    ep: int,
    activation_bytes: int,
    routing: Routing = "uniform",
    max_load: float | None = None,
) -> int:
    """Bytes one MoE layer's dispatch keeps for backward on the busiest rank, per micro-batch:
    the rank's ``T · k`` rows sorted for sending, the results received back and their weighted
    products (3 × ``T · k · H``), and for the ``R`` rows it receives (:func:`rows_per_rank`)
    their tokens, the experts' gate-up output, its SwiGLU and the down projection
    (``R · (2H + 3I)``), in the compute dtype. The router's scores and indices are left out
    (``T · E`` fp32: 4 MiB for 4096 tokens of 256 experts).

    Example:
        >>> layer = ExpertLayer.swiglu("e", num_experts=8, top_k=2, hidden=64, inter=32)
        >>> moe_working_set(layer, tokens=16, ep=2, activation_bytes=2)
        26624
    """
    sent = tokens * layer.top_k
    received = rows_per_rank(layer, tokens=tokens, ep=ep, routing=routing, max_load=max_load)
    return activation_bytes * (
        3 * sent * layer.hidden + received * (2 * layer.hidden + 3 * layer.inter)
    )


def expert_layers(
    groups: Sequence[ExpertGroup], params: Sequence[ParamLayout]
) -> tuple[ExpertLayer, ...]:
    """The plan's expert groups as :class:`ExpertLayer` s: their weights' global shapes from the
    layouts, the token width from ``down_proj`` [E, H, I] (dim 1) or else ``gate_up_proj``
    [E, 2I, H] (dim 2), the last dim of the first weight otherwise.

    Example:
        >>> from meshtrain.spec.partition import P
        >>> layout = ParamLayout("moe.experts.down_proj", (8, 64, 16), P("ep"), "", (4, 64, 16), (4, 64, 16))
        >>> expert_layers([ExpertGroup("moe.experts", 8, 4, (layout.fqn,), 2)], [layout])[0].hidden
        64
    """
    shapes = {p.fqn: p.shape for p in params}
    layers = []
    for group in groups:
        named = {fqn: shapes[fqn] for fqn in group.params}
        down = [shape for fqn, shape in named.items() if fqn.endswith("down_proj")]
        gate_up = [shape for fqn, shape in named.items() if fqn.endswith("gate_up_proj")]
        first = next(iter(named.values()))
        hidden = down[0][1] if down else gate_up[0][2] if gate_up else first[-1]
        layers.append(
            ExpertLayer(group.fqn, group.num_experts, group.top_k, hidden, tuple(named.values()))
        )
    return tuple(layers)


def estimate_expert_collectives(
    groups: Sequence[ExpertGroup],
    params: Sequence[ParamLayout],
    axis: str,
    ep: int,
    options: PlanOptions,
    checkpointed: Sequence[str] = (),
    *,
    routing: Routing = "uniform",
    max_load: float | None = None,
) -> tuple[Collective, ...]:
    """A plan's token all-to-alls per step (:func:`all_to_all_collectives`): its
    ``batch_size × seq_len`` tokens per rank and micro-batch, its micro-batches, rows in the
    compute dtype, the groups inside ``checkpointed`` blocks recomputed. Without a batch size
    the counts are given and the bytes are 0; a group of unknown top-k is left out."""
    layers = [layer for layer in expert_layers(groups, params) if layer.top_k]
    inside = [any(layer.fqn.startswith(block + ".") for block in checkpointed) for layer in layers]
    ordered = [layer for layer, flag in zip(layers, inside) if flag]
    ordered += [layer for layer, flag in zip(layers, inside) if not flag]
    tokens = (options.batch_size or 0) * (options.seq_len or 0)
    return all_to_all_collectives(
        ordered,
        axis=axis,
        ep=ep,
        tokens=tokens,
        microbatches=options.microbatches,
        activation_bytes=_itemsize(options.param_dtype),
        recomputed=sum(inside),
        routing=routing,
        max_load=max_load,
    )


def expert_notes(
    groups: Sequence[ExpertGroup],
    params: Sequence[ParamLayout],
    axis: str,
    ep: int,
    options: PlanOptions,
    checkpointed: Sequence[str] = (),
) -> tuple[str, ...]:
    """What the plan's notes say of the experts' traffic: the all-to-alls are sized for uniform
    routing; the dropless worst case per step and one layer's dispatch working set beside it."""
    notes = []
    unknown = [group.fqn for group in groups if not group.top_k]
    if unknown:
        notes.append(
            f"all-to-alls of experts modules {unknown[:3]} not sized: their top-k is unknown (no "
            "top_k or num_experts_per_tok on the module or the model's config)"
        )
    layers = [layer for layer in expert_layers(groups, params) if layer.top_k]
    tokens = (options.batch_size or 0) * (options.seq_len or 0)
    if not layers or not tokens:
        return tuple(notes)

    def per_step(routing: Routing) -> int:
        rows = estimate_expert_collectives(
            groups, params, axis, ep, options, checkpointed, routing=routing
        )
        return sum(c.bytes for c in rows)

    dtype = _itemsize(options.param_dtype)
    working = [
        max(
            moe_working_set(layer, tokens=tokens, ep=ep, activation_bytes=dtype, routing=routing)
            for layer in layers
        )
        for routing in ("uniform", "worst")
    ]
    notes.append(
        f"expert all-to-alls over '{axis}' are sized for uniform routing "
        f"({format_bytes(per_step('uniform'))} per step on each rank); routing is dropless and "
        "balancing bounds no single step, so the busiest rank's worst case (every rank sending it "
        f"all the rows its experts can take) is {format_bytes(per_step('worst'))} per step; one "
        f"MoE layer's dispatch working set is {format_bytes(working[0])} (uniform: in the "
        f"activation estimate) to {format_bytes(working[1])} (worst: beyond it) per micro-batch"
    )
    return tuple(notes)


def expert_data_collectives(
    params: Sequence[ParamLayout],
    units: Sequence[FSDPUnit],
    data_axes: tuple[str, ...],
    expert_axis: str,
    groups: Sequence[ExpertGroup],
    options: PlanOptions,
) -> tuple[Collective, ...]:
    """The data-parallel collectives of an expert-parallel plan, as the lowering wraps it: each
    experts module is an FSDP unit of its own over the data axes (none when they are all of
    size 1: its weights stay expert-sharded), every other unit (its experts taken out) over the
    data axes and the expert axis as one group (``"dp+ep"``). Under HSDP (two data axes) the
    experts shard over the second and all-reduce over the first, and the other units shard over
    the second and the expert axis together (``"dp+ep"``) and all-reduce over the first.

    Example:
        >>> from meshtrain.spec.partition import P
        >>> w = ParamLayout("b.experts.w", (4, 2, 2), P("ep"), "", (2, 2, 2), (1, 2, 2))
        >>> n = ParamLayout("b.norm", (2,), P(), "", (2,), (1,))
        >>> rows = expert_data_collectives([w, n], [FSDPUnit("b", (w.fqn, n.fqn))], ("dp",), "ep",
        ...                                [ExpertGroup("b.experts", 4, 2, (w.fqn,), 1)], PlanOptions())
        >>> sorted({(c.kind, c.axis) for c in rows})
        [('all_gather', 'dp'), ('all_gather', 'dp+ep'), ('reduce_scatter', 'dp'), ('reduce_scatter', 'dp+ep')]
    """
    expert = {fqn for group in groups for fqn in group.params}
    decided = options.decisions
    own = tuple(FSDPUnit(group.fqn, group.params, decided) for group in groups)
    rest = tuple(replace(u, params=tuple(p for p in u.params if p not in expert)) for u in units)
    replicate = data_axes[:-1]  # HSDP: the replicate axis stays a dim of its own
    shard = "+".join((*data_axes[len(replicate) :], expert_axis))
    rows = estimate_collectives(params, rest, (*replicate, shard), options)
    return rows + (estimate_collectives(params, own, data_axes, options) if data_axes else ())


def _itemsize(dtype: str) -> int:
    return {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]


def _fsdp_shard(shape: tuple[int, ...], dim: int, ways: int) -> int:
    """Elements of one FSDP2 shard of ``shape`` split ``ways`` ways on ``dim`` (padded)."""
    return math.prod(shape) // shape[dim] * -(-shape[dim] // ways)


__all__ = [
    "ExpertLayer",
    "Routing",
    "all_to_all_collectives",
    "estimate_expert_collectives",
    "expert_data_collectives",
    "expert_layers",
    "expert_memory",
    "expert_notes",
    "moe_working_set",
    "rows_per_rank",
]
