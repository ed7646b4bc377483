"""The costs of a pipelined plan: its busiest pipeline rank's memory, collectives per step
(point-to-point sends, data- and tensor-parallel collectives of its stages, the step's scalar
sums) and activations per checkpointing mode.

Example:
    >>> import meshtrain as mt
    >>> from meshtrain.models import LlamaConfig, build_llama, default_rules
    >>> model = build_llama(LlamaConfig.preset("debug", n_layers=4), device="meta")
    >>> mesh = mt.make_mesh(pp=2, dp=2, tp=1, world_size=4, abstract=True)
    >>> plan = mt.plan(model, mesh, default_rules(), pipeline=mt.Pipeline(microbatches=4))
    >>> plan.collectives[0].kind
    'send/recv'
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from meshtrain.plan.cost import estimate_collectives, estimate_memory, pipeline_step_scalars
from meshtrain.plan.infer import Inferred
from meshtrain.plan.ir import Collective, FSDPUnit, Memory, PipelinePlan, StagePlan
from meshtrain.plan.options import CHECKPOINTING_MODES, PlanOptions
from meshtrain.plan.tensor.cost import estimate_tp_collectives, partial_grad_collectives
from meshtrain.spec.mesh import Mesh


@dataclass(frozen=True)
class PipelineCosts:
    """What :func:`pipeline_costs` returns."""

    memory: Memory
    collectives: tuple[Collective, ...]
    busiest: int
    estimates: tuple[tuple[str, int], ...]


def pipeline_costs(
    pipeline: PipelinePlan, mesh: Mesh, inferred: Inferred, options: PlanOptions
) -> PipelineCosts:
    """The busiest pipeline rank: its memory, its collectives per step (the step's two scalar
    sums included), its pipeline rank and its activations per checkpointing mode.

    Each stage is wrapped like a model of its own: its blocks are units, the rest of its
    parameters (embedding, norm, head) its root unit. Every rank keeps the model's buffers.
    """
    ranks = sorted({s.rank for s in pipeline.stages})
    memory, busiest = max(
        ((_rank_memory(pipeline, rank, inferred, options), rank) for rank in ranks),
        key=lambda pair: pair[0].total,
    )
    stages = pipeline.local_stages(busiest)
    collectives = (
        *_rank_collectives(pipeline, stages, inferred, options),
        *pipeline_step_scalars(mesh, pipeline.axis, inferred.data_axes),
    )
    estimates: tuple[tuple[str, int], ...] = ()
    profile, blocks = inferred.profile, inferred.blocks
    if profile is not None:  # per mode, for the busiest rank's stages and micro-batches
        estimates = tuple(
            (
                mode,
                sum(
                    profile.peak(
                        mode, blocks if mode != "none" else (), stage.modules, stage.in_flight
                    )
                    for stage in stages
                ),
            )
            for mode in CHECKPOINTING_MODES
        )
    return PipelineCosts(memory, collectives, busiest, estimates)


def _rank_memory(
    pipeline: PipelinePlan, rank: int, inferred: Inferred, options: PlanOptions
) -> Memory:
    """One pipeline rank's memory: its stages' parameters as units, their activations."""
    by_fqn = {layout.fqn: layout for layout in inferred.params}
    stages = pipeline.local_stages(rank)
    memory = estimate_memory(
        [by_fqn[fqn] for s in stages for fqn in s.params],
        _stage_units(stages, inferred.units),
        options,
        buffers=inferred.buffers,
        sharded=bool(inferred.data_axes),
    )
    return replace(memory, activations=sum(s.activation_bytes for s in stages))


def _rank_collectives(
    pipeline: PipelinePlan,
    stages: Sequence[StagePlan],
    inferred: Inferred,
    options: PlanOptions,
) -> tuple[Collective, ...]:
    """Sends to the neighbouring stages, and the data- and tensor-parallel collectives of the
    given stages of one pipeline rank."""
    by_fqn = {layout.fqn: layout for layout in inferred.params}
    modules = tuple(module for stage in stages for module in stage.modules)
    local_styles = tuple(
        style
        for style in inferred.styles
        if any(style.fqn == m or style.fqn.startswith(m + ".") for m in modules)
    )
    back = " where a stage before them trains" if pipeline.frozen_crossings else ""
    send = Collective(
        "send/recv",
        pipeline.axis,
        pipeline.p2p_count,
        pipeline.p2p_bytes,
        f"activations to the next stage, their gradients back{back} (per pipeline rank pair)",
    )
    data_parallel: list[Collective] = []
    for stage in stages:
        data_parallel += estimate_collectives(
            [by_fqn[fqn] for fqn in stage.params],
            _stage_units((stage,), inferred.units),
            inferred.data_axes,
            options,
            pipelined=True,
            block_gathers=stage.zero3_gathers,
        )
    tensor_parallel = estimate_tp_collectives(
        local_styles,
        inferred.params,
        inferred.tp_axis,
        options,
        sequence_parallel=inferred.sequence_parallel,
        data_parallel=bool(inferred.data_axes),
        pipelined=True,
        tied=inferred.tied,
        units=inferred.units,
    )
    held = {fqn for stage in stages for fqn in stage.params}
    tensor_parallel += partial_grad_collectives(
        [grad for grad in inferred.partial_grads if grad.param in held],
        inferred.params,
        options,
        data_parallel=bool(inferred.data_axes),
        pipelined=True,
        units=inferred.units,
    )
    return (send, *_merged(data_parallel), *tensor_parallel)


def _merged(collectives: Sequence[Collective]) -> tuple[Collective, ...]:
    """Rows of the same kind, axis and reason summed (one rank's stages together)."""
    rows: dict[tuple[str, str, str], Collective] = {}
    for c in collectives:
        key = (c.kind, c.axis, c.why)
        old = rows.get(key)
        rows[key] = (
            c if old is None else replace(old, count=old.count + c.count, bytes=old.bytes + c.bytes)
        )
    return tuple(rows.values())


def _stage_units(stages: Sequence[StagePlan], units: tuple[FSDPUnit, ...]) -> tuple[FSDPUnit, ...]:
    """The FSDP units of one pipeline rank: its stages' blocks, then one root per stage (with
    the model's root unit's decisions)."""
    if not units:
        return ()
    root = units[-1].decisions
    result: list[FSDPUnit] = []
    for stage in stages:
        blocks = [u for u in units if u.fqn and u.fqn in stage.modules]
        owned = {fqn for unit in blocks for fqn in unit.params}
        result += blocks
        kept = tuple(fqn for fqn in stage.params if fqn not in owned)
        result.append(FSDPUnit("", kept, root))
    return tuple(result)
