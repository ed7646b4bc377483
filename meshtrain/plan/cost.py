"""Analytic per-rank memory and data-parallel communication of a plan, per optimizer step.

Memory per rank comes in two parts. *At rest* — what a rank holds between steps, checked byte for
byte against real runs (``tests/test_memory_spmd.py``): master parameters, gradients and
optimizer states in the parameters' own dtype (fp32 unless the model was built otherwise), plus
buffers. *Transient* — what lives only during a step: the gathered compute copies of parameters,
unsharded gradients before their reduce-scatter, and activations.

======  ====================  ==============  ================  ===================================
zero    parameters (master)   gradients       optimizer states  gathered compute copies (param dtype)
======  ====================  ==============  ================  ===================================
0       local (TP shard)      local           local × states    local when cast to bf16/fp16, else 0
1       shard                 shard           shard × states    local (all units, whole step)
2       shard                 shard           shard × states    local (all units, forward→backward)
3       shard                 shard           shard × states    root + 2 × largest block (prefetch)
======  ====================  ==============  ================  ===================================

"local" is the tensor-parallel shard a rank computes with; "shard" is its data-parallel slice
(dim 0 padded as FSDP2 pads). Unsharded gradients (in the reduce dtype): the largest unit's
while its reduce-scatter runs, and every unit's under zero 1 with micro-batches (accumulated
whole until the step's one reduce-scatter). Without a data axis larger than 1 nothing is wrapped
and everything is local. With offload, master parameters, gradients and optimizer states live on
the host and count 0 on the device; with ``offload_optimizer`` only the optimizer states do.
Frozen parameters (``requires_grad=False``: a LoRA base) have no gradient, no optimizer state,
no unsharded gradient and no gradient collective; a unit with only frozen parameters issues no
reduce-scatter (FSDP2 reduces the parameters that have gradients). NF4 weights (QLoRA) count
their 4-bit storage at rest and when gathered. Data-parallel collectives follow FSDP2's schedule: one
all-gather per unit in forward (the root's parameters are not resharded after forward), one more
per non-root unit in backward under zero=3, one reduce-scatter per unit per gradient sync, and an
all-reduce over the replicate axis under HSDP. zero 0 and 1 sync gradients once per step; zero 2
and 3 on every micro-batch so gradients stay sharded. What each stage means is decided once, by
:func:`~meshtrain.plan.decisions.fsdp_decisions`, and read here off the units' decisions.
Tensor-parallel collectives are :mod:`~meshtrain.plan.tensor.cost`'s (one cost per style).

Example:
    >>> from meshtrain.plan.options import PlanOptions
    >>> PlanOptions(zero=1).optimizer_states
    2
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from meshtrain.plan.ir import Collective, FSDPUnit, Memory, ParamLayout
from meshtrain.plan.options import PlanOptions
from meshtrain.plan.tensor.cost import estimate_tp_collectives
from meshtrain.spec.mesh import Mesh


def estimate_memory(
    layouts: Sequence[ParamLayout],
    units: Sequence[FSDPUnit],
    options: PlanOptions,
    *,
    buffers: int = 0,
    sharded: bool = True,
) -> Memory:
    """Bytes per rank: at rest and transient (see the table above), activations left at 0.

    ``units`` are the FSDP units over ``layouts`` (empty: nothing is wrapped); ``sharded``:
    the units shard over a data axis larger than 1 (False when FSDP2 only carries the
    mixed-precision policy over size-1 axes).
    """
    decided = units[-1].decisions if units else None  # only reshard-after-forward differs
    shards = decided is not None and sharded and decided.shard_params
    at_rest = sum(p.bytes_of(p.shard_numel if shards else p.local_numel) for p in layouts)
    trained = sum(
        (p.shard_numel if shards else p.local_numel) * p.element_bytes
        for p in layouts
        if p.trainable
    )
    states = trained * options.optimizer_states
    host = decided is not None and decided.offload
    param_bytes = getattr(torch, options.param_dtype).itemsize
    reduce_bytes = getattr(torch, options.reduce_dtype).itemsize
    gathered_by_unit = _unit_bytes(layouts, units, param_bytes)
    grads_by_unit = _unit_numel(layouts, units, trainable_only=True)
    gathered = unsharded = 0
    if decided is not None and (decided.shard_params or options.precision != "fp32"):
        gathered = _gathered_peak(units, gathered_by_unit)
    if decided is not None and decided.shard_grads:
        whole = not decided.sync_every_microbatch and options.microbatches > 1
        unsharded = (sum(grads_by_unit) if whole else max(grads_by_unit, default=0)) * reduce_bytes
    return Memory(
        params=0 if host else at_rest,
        grads=0 if host else trained,
        optimizer_states=0 if host or options.offload_optimizer else states,
        gathered_params=gathered,
        unsharded_grads=unsharded,
        buffers=buffers,
    )


def _gathered_peak(units: Sequence[FSDPUnit], gathered_by_unit: Sequence[int]) -> int:
    """Gathered compute copies at their peak: every unit kept gathered after forward (the root;
    all under zero 1 and 2), plus two of those resharded after forward (the one computing and the
    one prefetched), the largest."""
    kept = sum(
        n for unit, n in zip(units, gathered_by_unit) if not unit.decisions.reshard_after_forward
    )
    resharded = [
        n for unit, n in zip(units, gathered_by_unit) if unit.decisions.reshard_after_forward
    ]
    return kept + 2 * max(resharded, default=0)


def _unit_numel(
    layouts: Sequence[ParamLayout], units: Sequence[FSDPUnit], *, trainable_only: bool = False
) -> list[int]:
    """Local (tensor-parallel shard) elements of each unit's own parameters (the trainable ones
    only: those that have gradients)."""
    by_fqn = {p.fqn: p for p in layouts}
    return [
        sum(
            by_fqn[fqn].local_numel
            for fqn in unit.params
            if fqn in by_fqn and (by_fqn[fqn].trainable or not trainable_only)
        )
        for unit in units
    ]


def _unit_bytes(
    layouts: Sequence[ParamLayout], units: Sequence[FSDPUnit], param_bytes: int
) -> list[int]:
    """Bytes of each unit's gathered compute copies: ``param_bytes`` per element, an NF4 weight
    in its 4-bit storage (FSDP2 all-gathers the NF4 tensor's codes and scales)."""
    by_fqn = {p.fqn: p for p in layouts}
    return [
        sum(
            by_fqn[fqn].bytes_of(by_fqn[fqn].local_numel)
            if by_fqn[fqn].storage
            else by_fqn[fqn].local_numel * param_bytes
            for fqn in unit.params
            if fqn in by_fqn
        )
        for unit in units
    ]


def estimate_collectives(
    layouts: Sequence[ParamLayout],
    units: Sequence[FSDPUnit],
    data_axes: tuple[str, ...],
    options: PlanOptions,
    *,
    pipelined: bool = False,
    block_gathers: tuple[int, int] = (1, 1),
) -> tuple[Collective, ...]:
    """Data-parallel collectives per optimizer step, per kind and axis, with payload bytes.

    ``pipelined``: inside a pipeline schedule, which syncs gradients (and reshards after
    backward) on a stage's last backward only, whatever the ZeRO stage; ``units`` are then one
    stage's (its blocks, its root last) and under zero=3 ``block_gathers`` says how often the
    blocks are gathered in forward and in backward
    (``StagePlan.zero3_gathers``, from :func:`~meshtrain.plan.pipeline.schedule.resharded_gathers`).
    """
    if not data_axes or not units:
        return ()
    decided = units[-1].decisions  # the root's: only reshard-after-forward differs between units
    reduce_bytes = getattr(torch, options.reduce_dtype).itemsize
    grads = _unit_numel(layouts, units, trainable_only=True)
    reducing = sum(1 for n in grads if n)  # frozen units reduce nothing
    syncs = options.microbatches if decided.sync_every_microbatch and not pipelined else 1
    grad_bytes = sum(grads) * reduce_bytes * syncs
    if decided.grad_sync == "all_reduce":
        return (
            Collective(
                "all_reduce",
                "+".join(data_axes),
                reducing * syncs,
                grad_bytes,
                "gradients, one per unit with trainable parameters",
            ),
        )
    replicate_axis, shard_axis = data_axes if len(data_axes) == 2 else (None, data_axes[0])
    result = list(_parameter_gathers(layouts, units, shard_axis, options, pipelined, block_gathers))
    result.append(
        Collective(
            "reduce_scatter",
            shard_axis,
            reducing * syncs,
            grad_bytes,
            "gradients, one per unit with trainable parameters per sync",
        )
    )
    if replicate_axis is not None:
        owned = {fqn for unit in units for fqn in unit.params}
        shard_total = sum(p.shard_numel for p in layouts if p.trainable and p.fqn in owned)
        result.append(
            Collective(
                "all_reduce",
                replicate_axis,
                reducing * syncs,
                shard_total * reduce_bytes * syncs,
                "HSDP: gradient shards across replicas",
            )
        )
    return tuple(result)


def _parameter_gathers(
    layouts: Sequence[ParamLayout],
    units: Sequence[FSDPUnit],
    axis: str,
    options: PlanOptions,
    pipelined: bool,
    block_gathers: tuple[int, int],
) -> tuple[Collective, ...]:
    """The all-gathers of sharded units: each unit once per forward (every micro-batch where
    parameters are resharded after backward; once per step where they stay gathered across
    micro-batches or a pipeline schedule holds them), and units resharded after forward again in
    backward. A pipeline stage's resharded blocks follow its schedule (``block_gathers``)."""
    gathered = _unit_bytes(layouts, units, getattr(torch, options.param_dtype).itemsize)
    resharded = [n for unit, n in zip(units, gathered) if unit.decisions.reshard_after_forward]
    micro = options.microbatches
    if pipelined and resharded:
        forward, backward = block_gathers
        root = sum(gathered) - sum(resharded)
        return _stage_zero3(axis, len(units), sum(resharded), root, forward, backward)
    regathered = not (pipelined or units[-1].decisions.gathered_across_microbatches)
    gathers = micro if regathered else 1
    rows = [
        Collective(
            "all_gather",
            axis,
            len(units) * gathers,
            sum(gathered) * gathers,
            "parameters, one per unit in forward",
        )
    ]
    if resharded:
        rows.append(
            Collective(
                "all_gather",
                axis,
                len(resharded) * micro,
                sum(resharded) * micro,
                "parameters again in backward (non-root units are resharded after forward; the root is kept)",
            )
        )
    return tuple(rows)


def pipeline_step_scalars(
    mesh: Mesh, pipeline_axis: str, data_axes: Sequence[str]
) -> tuple[Collective, ...]:
    """The two scalar sums a pipelined step makes besides its schedule's traffic: its loss tokens
    over the data-parallel ranks (the loss is divided by the global count) and its loss over the
    pipeline and data-parallel ranks (every rank returns the global loss). One all-reduce each,
    of one float32, over the axes together (a data axis given as a group, ``"dp+cp"``, counts
    each of its axes).

    Example:
        >>> [(c.axis, c.count, c.bytes) for c in pipeline_step_scalars(
        ...     Mesh(("pp", "dp"), (2, 4)), "pp", ("dp",))]
        [('dp', 1, 4), ('pp+dp', 1, 4)]
        >>> [c.axis for c in pipeline_step_scalars(
        ...     Mesh(("pp", "rep", "dp", "cp"), (2, 2, 2, 2)), "pp", ("rep", "dp+cp"))]
        ['rep+dp+cp', 'pp+rep+dp+cp']
    """
    scalar = torch.float32.itemsize
    axes = tuple(axis for group in data_axes for axis in group.split("+"))  # "dp+cp": both
    tokens = mesh.joined(axes)
    rows = [Collective("all_reduce", tokens, 1, scalar, "the step's loss tokens")] if tokens else []
    rows.append(
        Collective(
            "all_reduce",
            mesh.joined((pipeline_axis, *axes)),
            1,
            scalar,
            "the step's loss, returned on every rank",
        )
    )
    return tuple(rows)


def _stage_zero3(
    axis: str, n_units: int, blocks: int, root: int, forward: int, backward: int
) -> tuple[Collective, ...]:
    """A pipeline stage's parameter all-gathers under zero=3 (see ``estimate_collectives``);
    ``blocks`` and ``root`` are the bytes they gather."""
    n_blocks = n_units - 1
    return (
        Collective(
            "all_gather",
            axis,
            n_blocks * forward + 1,
            blocks * forward + root,
            "parameters in forward: the stage's root once, its blocks whenever resharded",
        ),
        Collective(
            "all_gather",
            axis,
            n_blocks * backward,
            blocks * backward,
            "parameters in backward: blocks resharded since their last backward",
        ),
    )


__all__ = [
    "estimate_collectives",
    "estimate_memory",
    "estimate_tp_collectives",
    "pipeline_step_scalars",
]
