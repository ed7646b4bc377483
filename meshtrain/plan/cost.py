"""Analytic per-rank memory and data-parallel communication of a plan, per optimizer step.

Memory is the peak held per rank for fp32 master parameters, gradients and optimizer states:

======  ===========================  ===========================  ===========================
zero    parameters                   gradients                    optimizer states
======  ===========================  ===========================  ===========================
0       local (TP shard)             local                        local × states
1       local (gathered all step)    local (synced once)          shard × states
2       local (gathered fwd→bwd)     shard                        shard × states
3       shard                        shard                        shard × states
======  ===========================  ===========================  ===========================

"local" is the tensor-parallel shard a rank computes with; "shard" is its data-parallel slice.
With offload, parameters, gradients and optimizer states live on the host and the device figures
are zero. Data-parallel collectives follow FSDP2's schedule: one all-gather per unit in forward
(the root's parameters are not resharded after forward), one more per non-root unit in backward
under zero=3, one reduce-scatter per unit per gradient sync, and an all-reduce over the replicate
axis under HSDP. zero 0 and 1 sync gradients once per step; zero 2 and 3 on every micro-batch so
gradients stay sharded.

Example:
    >>> from meshtrain.plan.options import PlanOptions
    >>> PlanOptions(zero=1).optimizer_states
    2
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from meshtrain.plan.ir import Collective, FSDPUnit, Memory, ModuleStyle, ParamLayout
from meshtrain.plan.options import PlanOptions


def estimate_memory(layouts: Sequence[ParamLayout], options: PlanOptions) -> Memory:
    """Peak bytes per rank for parameters, gradients and optimizer states (see the table above)."""
    if options.offload:
        return Memory(0, 0, 0)
    local = sum(p.local_numel * p.element_bytes for p in layouts)
    shard = sum(p.shard_numel * p.element_bytes for p in layouts)
    params = shard if options.zero == 3 else local
    grads = shard if options.zero >= 2 else local
    states = (shard if options.zero >= 1 else local) * options.optimizer_states
    return Memory(params, grads, states)


def estimate_collectives(
    layouts: Sequence[ParamLayout],
    units: Sequence[FSDPUnit],
    data_axes: tuple[str, ...],
    options: PlanOptions,
) -> tuple[Collective, ...]:
    """Data-parallel collectives per optimizer step, per kind and axis, with payload bytes."""
    if not data_axes:
        return ()
    by_fqn = {p.fqn: p for p in layouts}
    unit_numel = [sum(by_fqn[fqn].local_numel for fqn in unit.params) for unit in units]
    param_bytes = getattr(torch, options.param_dtype).itemsize
    reduce_bytes = getattr(torch, options.reduce_dtype).itemsize
    micro = options.microbatches
    syncs = micro if options.zero >= 2 else 1
    n_units = len(units)
    total = sum(unit_numel)
    root = unit_numel[-1]
    if options.zero == 0:
        axis = "+".join(data_axes)
        return (
            Collective(
                "all_reduce",
                axis,
                n_units * syncs,
                total * reduce_bytes * syncs,
                "gradients, one per unit",
            ),
        )
    replicate_axis, shard_axis = data_axes if len(data_axes) == 2 else (None, data_axes[0])
    gathers = micro if options.zero >= 2 else 1
    result = [
        Collective(
            "all_gather",
            shard_axis,
            n_units * gathers,
            total * param_bytes * gathers,
            "parameters, one per unit in forward",
        )
    ]
    if options.zero == 3 and n_units > 1:
        result.append(
            Collective(
                "all_gather",
                shard_axis,
                (n_units - 1) * micro,
                (total - root) * param_bytes * micro,
                "parameters again in backward (non-root units are resharded after forward; the root is kept)",
            )
        )
    result.append(
        Collective(
            "reduce_scatter",
            shard_axis,
            n_units * syncs,
            total * reduce_bytes * syncs,
            "gradients, one per unit per sync",
        )
    )
    if replicate_axis is not None:
        shard_total = sum(p.shard_numel for p in layouts)
        result.append(
            Collective(
                "all_reduce",
                replicate_axis,
                n_units * syncs,
                shard_total * reduce_bytes * syncs,
                "HSDP: gradient shards across replicas",
            )
        )
    return tuple(result)


_COLWISE = ("colwise", "colwise_gathered", "loss_parallel_head")


def estimate_tp_collectives(
    styles: Sequence[ModuleStyle], tp_axis: str | None, options: PlanOptions
) -> tuple[Collective, ...]:
    """Tensor-parallel collectives per optimizer step (counts; payloads are activation-sized).

    Forward: one all-reduce per row-wise module and vocab-parallel embedding (partial sums), one
    all-gather per gathered output. Backward: one all-reduce per column-wise module (the input
    gradient is a partial sum), one all-gather per row-wise module whose input was sliced locally.
    The loss-parallel cross-entropy adds none. Measured against real steps in the tests.
    """
    if tp_axis is None or not styles:
        return ()
    micro = options.microbatches
    kinds = [style.style for style in styles]
    sliced_rowwise = kinds.count("rowwise_replicated_input")
    rows = [
        (
            "all_reduce",
            kinds.count("rowwise")
            + kinds.count("rowwise_replicated_input")
            + kinds.count("vocab_parallel_embedding"),
            "forward: partial sums of row-wise outputs",
        ),
        (
            "all_gather",
            kinds.count("colwise_gathered") + kinds.count("embedding_dim_parallel"),
            "forward: gathered column-wise outputs",
        ),
        (
            "all_reduce",
            sum(kinds.count(k) for k in _COLWISE),
            "backward: partial input gradients of column-wise modules",
        ),
        (
            "all_gather",
            sliced_rowwise,
            "backward: input gradients of row-wise modules fed a replicated input",
        ),
    ]
    return tuple(
        Collective(kind, tp_axis, count * micro, 0, f"{why} (activation-sized)")
        for kind, count, why in rows
        if count
    )
