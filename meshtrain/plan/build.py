"""The planning pipeline, one named step each: resolve the options against the mesh → infer the
layout (specs, axes, styles, units, compute policies) → cost it flat or pipelined → the Plan.

``mt.plan`` and ``strategy="auto"`` both run :func:`build_plan`; nothing here allocates
parameter memory or issues a collective, so a meta model on an abstract mesh of thousands of
ranks plans in seconds.

Example:
    >>> import meshtrain as mt
    >>> from meshtrain.models import LlamaConfig, build_llama, default_rules
    >>> model = build_llama(LlamaConfig.debug(), device="meta")
    >>> mesh = mt.make_mesh(dp=2, tp=2, world_size=4, abstract=True)
    >>> build_plan(model, mesh, default_rules(), PlanOptions(zero=2)).options.zero
    2
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from meshtrain.errors import PlanError
from meshtrain.plan.adapters import (
    check_nf4_shards,
    resolve_with_adapters,
    storage,
    trainable,
)
from meshtrain.plan.context.axis import (
    check_context,
    check_context_model,
    check_context_sequence_parallel,
    context_axis_of,
    param_axes,
)
from meshtrain.plan.context.cost import (
    context_collectives,
    context_costing,
    context_profile,
    local_seq_len,
)
from meshtrain.plan.cost import estimate_collectives, estimate_memory
from meshtrain.plan.decisions import pair_inputs_shared
from meshtrain.plan.experts.axis import expert_axis_of, expert_shards, plan_experts
from meshtrain.plan.experts.cost import (
    estimate_expert_collectives,
    expert_data_collectives,
    expert_notes,
)
from meshtrain.plan.experts.router_counts import count_collectives, counting_routers
from meshtrain.plan.experts.router_logits import refuse_router_logits
from meshtrain.plan.infer import (
    Inferred,
    check_sequence_length,
    describe_uneven,
    infer_axes,
    infer_layouts,
    infer_sequence_parallel,
    infer_units,
    shard_axes_of,
)
from meshtrain.plan.ir import (
    WHOLE_SEQUENCE,
    Collective,
    ExpertGroup,
    FSDPUnit,
    Memory,
    ModuleStyle,
    ParamLayout,
    PipelinePlan,
    Plan,
    TPStyle,
)
from meshtrain.plan.layers import tied_groups
from meshtrain.plan.memory.activations import ActivationProfile, trace_activations
from meshtrain.plan.options import CHECKPOINTING_MODES, PlanOptions
from meshtrain.plan.pipeline.cost import pipeline_costs
from meshtrain.plan.pipeline.schedule import check_pipeline_axis, plan_pipeline
from meshtrain.plan.policies import (
    block_fqns,
    plain_under_compile_note,
    resolve_compile_scope,
)
from meshtrain.plan.proof.refusals import batch_buffers as refuse_batch_buffers
from meshtrain.plan.proof.run import Proof, Scope, kept_as_notes, prove_plan
from meshtrain.plan.tensor.cost import estimate_tp_collectives, partial_grad_collectives
from meshtrain.plan.tensor.sequence import place_sequence_split
from meshtrain.plan.tensor.styles import infer_styles
from meshtrain.spec.mesh import Mesh
from meshtrain.spec.rules import Rules


def build_plan(model: nn.Module, mesh: Mesh, rules: Rules, options: PlanOptions) -> Plan:
    """The whole pipeline: :func:`resolve_options` → :func:`infer_layout` → :func:`cost_flat`
    or :func:`cost_pipelined` → :class:`Plan`."""
    expert_axis = expert_axis_of(resolve_with_adapters(rules, model, mesh), model)
    options = resolve_options(mesh, rules, options, expert_axis=expert_axis)
    layout = infer_layout(model, mesh, rules, options)
    refuse_router_logits(model, mesh, (*layout.data_axes, layout.expert_axis, layout.context_axis))
    pipeline_plan: PipelinePlan | None = None
    cost_layout, cost_options = context_costing(layout, mesh, options)
    ring_blocks: tuple[str, ...] | None = None
    if options.pipeline is None:
        memory, collectives, notes, estimates = cost_flat(cost_layout, cost_options)
    else:
        pipeline_plan, memory, collectives, notes, estimates = cost_pipelined(
            model, mesh, cost_layout, cost_options
        )
        busiest = pipeline_costs(pipeline_plan, mesh, cost_layout, cost_options).busiest
        ring_blocks = tuple(m for s in pipeline_plan.local_stages(busiest) for m in s.modules)
    collectives += _router_count_collectives(model, mesh, layout, options, ring_blocks)
    collectives += _buffer_collectives(model, mesh, layout)
    if layout.context_axis is not None and layout.profile is not None:
        collectives += context_collectives(
            layout.profile,
            options,
            axis=layout.context_axis,
            cp=mesh.size(layout.context_axis),
            checkpointed=options.checkpointed_blocks(layout.blocks),
            blocks=ring_blocks,
        )
    return Plan(
        **{
            **carried(layout),
            "mesh": mesh,
            "options": options,
            "activation_rules": rules.logical,
            "collectives": collectives,
            "memory": memory,
            "pipeline": pipeline_plan,
            "notes": notes,
            "activation_estimates": estimates,
        }
    )


def carried(layout: Inferred) -> dict[str, Any]:
    """The fields inference decided that the plan keeps as they are (a field of the same name
    on both :class:`Inferred` and :class:`Plan`): a new one needs no line here."""
    kept = {field.name for field in dataclasses.fields(Plan)}
    return {f.name: getattr(layout, f.name) for f in dataclasses.fields(layout) if f.name in kept}


def resolve_options(
    mesh: Mesh, rules: Rules, options: PlanOptions, *, expert_axis: str | None = None
) -> PlanOptions:
    """Options made concrete for ``mesh``: a pipeline's micro-batches (one per stage unless
    given) become the plan's, and ``global_batch`` fills in ``batch_size`` (sequences per
    micro-batch per batch rank: the data ranks and the ``expert_axis``'s, which splits the
    batch too)."""
    pipeline, microbatches = options.pipeline, options.microbatches
    if pipeline is not None:
        check_pipeline_axis(mesh, pipeline)
        if microbatches not in (1, pipeline.microbatches):
            raise PlanError(
                f"microbatches={microbatches} and Pipeline(microbatches={pipeline.microbatches}) "
                "disagree: a pipelined plan accumulates over its pipeline micro-batches. Give "
                "them once, in Pipeline(microbatches=...)."
            )
        n_stages = mesh.size(pipeline.axis) * pipeline.stages_per_rank
        microbatches = pipeline.microbatches or n_stages
    batch_size = _batch_size(mesh, rules, options, microbatches, expert_axis)
    return replace(options, microbatches=microbatches, batch_size=batch_size)


@dataclasses.dataclass(frozen=True)
class _Axes:
    """The axes a plan trains over: its data axes (all, and ``active``: those larger than 1),
    the tensor-parallel, context and expert axes."""

    data: tuple[str, ...]
    active: tuple[str, ...]
    tp: str | None
    context: str | None
    expert: str | None

    @property
    def beside(self) -> tuple[str, ...]:
        """The context and expert axes: ranks that hold other tokens beside the data axes."""
        return tuple(axis for axis in (self.context, self.expert) if axis)

    @property
    def reduced(self) -> tuple[str, ...]:
        """Every axis gradients are reduced over: the active data axes, then context and expert."""
        return self.active + self.beside


def infer_layout(model: nn.Module, mesh: Mesh, rules: Rules, options: PlanOptions) -> Inferred:
    """Specs resolved per parameter, the data and tensor-parallel axes, layouts, module styles,
    FSDP units and the compute policies (checkpointed blocks, compile scope, cast axes)."""
    resolution = resolve_with_adapters(rules, model, mesh)
    axes = _infer_axes(model, mesh, rules, options, resolution)
    experts, layouts, shard_axes = _sharded_layouts(model, mesh, options, resolution, axes)
    sequence_parallel = infer_sequence_parallel(rules, mesh, axes.data, axes.tp, axes.context)
    styles = infer_styles(model, resolution, axes.tp, options.loss_parallel, sequence_parallel)
    if sequence_parallel and options.seq_len is not None and axes.tp is not None:
        check_sequence_length(options.seq_len, axes.tp, mesh)
        if axes.context is not None:
            check_context_sequence_parallel(options.seq_len, axes.context, axes.tp, mesh)
    notes = _layout_notes(layouts, mesh, options, rules, axes, shard_axes, bool(experts))
    all_units = _decided(infer_units(model, options.fsdp_units), options)
    blocks = block_fqns(all_units)
    if sequence_parallel and axes.tp is not None:
        styles = place_sequence_split(
            model, styles, blocks, tp_size=mesh.size(axes.tp), seq_len=options.seq_len
        )
    cast_axes = _cast_axes(options, axes.data, axes.reduced, mesh)
    units = all_units if axes.reduced or cast_axes else ()
    compile_scope = _compile_scope(options, sequence_parallel, units, axes, notes)
    profile = _activation_profile(
        model, blocks, styles, options, mesh, axes.tp, sequence_parallel, axes.context
    )
    if isinstance(profile, str):
        notes.append(profile)
        profile = None
    tied = tied_groups(model)
    _check_tied(tied, blocks)
    batch_norms = _batch_norms(model, options)  # refusals in the order they always came
    scope = Scope(
        axes.tp,
        mesh.size(axes.tp) if axes.tp is not None else 1,
        sequence_parallel,
        data_parallel=bool(axes.reduced),
        context=axes.context is not None,
        resharded=tuple(u.fqn for u in units if u.fqn and u.decisions.reshard_after_forward),
        shared_inputs=pair_inputs_shared(compile_scope, options.activation_checkpointing),
    )
    proof = prove_plan(
        model, layouts, styles, blocks=blocks, unproven=options.unproven_shards, scope=scope
    )
    notes += proof.notes
    averaged = _averaged_buffers(proof, options, axes, notes)
    return Inferred(
        data_axes=axes.active,
        tp_axis=axes.tp,
        sequence_parallel=sequence_parallel,
        params=layouts,
        styles=styles,
        units=units,
        blocks=blocks,
        cast_axes=cast_axes,
        compile_scope=compile_scope,
        buffers=sum(b.numel() * b.element_size() for b in model.buffers()),
        profile=profile,
        notes=tuple(notes),
        tied=tied,
        batch_norms=batch_norms,
        partial_grads=proof.partial_grads,
        context_axis=axes.context,
        expert_axis=axes.expert,
        experts=experts,
        readers=proof.readers,
        fresh_outputs=proof.fresh_outputs,
        averaged_buffers=averaged,
    )


def _infer_axes(
    model: nn.Module, mesh: Mesh, rules: Rules, options: PlanOptions, resolution: Any
) -> _Axes:
    """Which mesh axis does what: pipeline and context from the options and rules, the expert
    axis from the experts' specs, then the data and tensor-parallel axes."""
    pipeline_axis = options.pipeline.axis if options.pipeline else None
    context_axis = context_axis_of(rules, mesh, rules.fsdp, pipeline_axis, param_axes(resolution))
    expert_axis = expert_axis_of(resolution, model)
    data_axes, tp_axis = infer_axes(
        resolution, rules.fsdp, pipeline_axis, context_axis, expert_axis
    )
    active = tuple(axis for axis in data_axes if mesh.size(axis) > 1)
    return _Axes(data_axes, active, tp_axis, context_axis, expert_axis)


def _sharded_layouts(
    model: nn.Module, mesh: Mesh, options: PlanOptions, resolution: Any, axes: _Axes
) -> tuple[tuple[ExpertGroup, ...], tuple[ParamLayout, ...], tuple[str, ...]]:
    """The expert groups, every parameter's layout (experts' FSDP shards included) and the axes
    FSDP shards over; context parallelism and NF4 shards checked on the way."""
    experts = (
        plan_experts(
            model,
            resolution,
            axes.expert,
            data_axes=axes.active,
            tp_axis=axes.tp,
            options=options,
            context_axis=axes.context,
        )
        if axes.expert
        else ()
    )
    if axes.context is not None:
        check_context(mesh, axes.context, options, data_axes=axes.active, tp_axis=axes.tp)
        check_context_model(model, axes.context)
    shard_axes = shard_axes_of(axes.active) + axes.beside
    element_bytes = {fqn: param.element_size() for fqn, param in model.named_parameters()}
    layouts = infer_layouts(
        resolution,
        shard_axes,
        options,
        element_bytes,
        trainable=trainable(model),
        storage=storage(model),
    )
    sharded = options.decisions.shard_params
    if experts and sharded:
        # the experts' FSDP ranks: the shard axis (HSDP: the second) and the context axis
        context = (axes.context,) if axes.context else ()
        efsdp = math.prod(mesh.size(a) for a in shard_axes_of(axes.active) + context)
        layouts = expert_shards(layouts, experts, efsdp)
    check_nf4_shards(layouts, math.prod(mesh.size(axis) for axis in shard_axes), sharded)
    return experts, layouts, shard_axes


def _layout_notes(
    layouts: tuple[ParamLayout, ...],
    mesh: Mesh,
    options: PlanOptions,
    rules: Rules,
    axes: _Axes,
    shard_axes: tuple[str, ...],
    has_experts: bool,
) -> list[str]:
    """The plan's notes so far: uneven shards, the rules' own, HSDP beside context or experts,
    no data-parallel wrapping."""
    sharded = options.decisions.shard_params
    notes = describe_uneven(layouts, mesh, shard_axes) if shard_axes and sharded else []
    notes += getattr(rules, "notes", ())
    if len(axes.active) == 2 and axes.beside:
        expert = axes.expert if has_experts else None
        notes.append(_hsdp_note(mesh, axes.active, axes.beside, expert))
    if not axes.reduced:
        notes.append("no data axis larger than 1: no data-parallel wrapping, no gradient reduction")
    return notes


def _compile_scope(
    options: PlanOptions,
    sequence_parallel: bool,
    units: tuple[FSDPUnit, ...],
    axes: _Axes,
    notes: list[str],
) -> str | None:
    """What ``torch.compile`` wraps (:func:`resolve_compile_scope`), noting what compiling under
    tensor parallelism changes."""
    pipeline = options.pipeline
    scope = resolve_compile_scope(
        options,
        sequence_parallel=sequence_parallel,
        wrapped=bool(units),
        tp_axis=axes.tp,
        split_backward_schedule=pipeline.schedule
        if pipeline and pipeline.splits_backward
        else None,
    )
    if scope is not None and axes.tp is not None:
        notes.append(plain_under_compile_note(axes.tp))
    return scope


def _averaged_buffers(
    proof: Proof, options: PlanOptions, axes: _Axes, notes: list[str]
) -> tuple[tuple[str, str], ...]:
    """The buffers averaged after the forward that writes them from the batch (a refusal kept
    as a note when the harness asks for notes)."""
    try:
        return _batch_buffers(proof, options, list(axes.reduced))
    except PlanError as refusal:
        if not kept_as_notes():
            raise
        notes.append(f"refused (kept as a note): {refusal}")
        return ()


def _batch_buffers(
    proof: Proof, options: PlanOptions, axes: list[str]
) -> tuple[tuple[str, str], ...]:
    """The buffers the forward writes from the batch: refused under data parallelism (each
    rank would update them from its own rows) unless averaged on request; nothing to do on one
    data rank."""
    if not proof.batch_buffers or not axes:
        return ()
    if options.batch_buffers == "refuse":
        raise refuse_batch_buffers(dict(proof.batch_buffers), axes)
    if proof.reread_buffers:
        buffer = proof.reread_buffers[0]
        raise PlanError(
            f"buffer '{buffer}' is written from the batch and read again in the same forward: "
            "averaging it over the data-parallel ranks after the forward cannot give the value "
            "one device reads there. Read it before updating it, or keep batch_buffers='refuse' "
            "and a model without such a buffer.",
            fqn=buffer,
        )
    if options.microbatches > 1:
        buffer = proof.batch_buffers[0][0]
        raise PlanError(
            f"buffer '{buffer}' is written from the batch in each forward, and with "
            f"{options.microbatches} micro-batches a step runs several forwards where one device "
            "runs one over the whole batch: averaging cannot make them agree. Use one "
            "micro-batch, or batch_buffers='refuse' and a model without such a buffer.",
            fqn=buffer,
        )
    return proof.batch_buffers


def cost_flat(
    layout: Inferred, options: PlanOptions
) -> tuple[Memory, tuple[Collective, ...], tuple[str, ...], tuple[tuple[str, int], ...]]:
    """Memory per rank, collectives per step, notes and activation estimates per checkpointing
    mode of a plan without a pipeline."""
    memory = estimate_memory(
        layout.params,
        layout.units,
        options,
        buffers=layout.buffers,
        sharded=bool(layout.data_axes or layout.context_axis or layout.expert_axis),
    )
    estimates: tuple[tuple[str, int], ...] = ()
    profile = layout.profile
    if profile is not None:
        checkpointed = options.checkpointed_blocks(layout.blocks)
        memory = replace(
            memory, activations=profile.peak(options.activation_checkpointing, checkpointed)
        )
        estimates = tuple(
            (mode, profile.peak(mode, layout.blocks if mode != "none" else ()))
            for mode in CHECKPOINTING_MODES
        )
    if layout.expert_axis is not None and layout.experts:  # experts units over the data axes
        collectives = expert_data_collectives(
            layout.params,
            layout.units,
            layout.data_axes,
            layout.expert_axis,
            layout.experts,
            options,
        )
    else:
        collectives = estimate_collectives(layout.params, layout.units, layout.data_axes, options)
    collectives += estimate_tp_collectives(
        layout.styles,
        layout.params,
        layout.tp_axis,
        options,
        sequence_parallel=layout.sequence_parallel,
        data_parallel=bool(layout.data_axes),
        tied=layout.tied,
        units=layout.units,
    )
    collectives += partial_grad_collectives(
        layout.partial_grads,
        layout.params,
        options,
        data_parallel=bool(layout.data_axes),
        units=layout.units,
    )
    notes = layout.notes
    if layout.expert_axis is not None and layout.experts:
        ep = layout.experts[0].num_experts // layout.experts[0].local_experts
        checkpointed = options.checkpointed_blocks(layout.blocks)
        collectives += estimate_expert_collectives(
            layout.experts, layout.params, layout.expert_axis, ep, options, checkpointed
        )
        notes += expert_notes(
            layout.experts, layout.params, layout.expert_axis, ep, options, checkpointed
        )
    return memory, collectives, notes, estimates


def cost_pipelined(
    model: nn.Module, mesh: Mesh, layout: Inferred, options: PlanOptions
) -> tuple[
    PipelinePlan, Memory, tuple[Collective, ...], tuple[str, ...], tuple[tuple[str, int], ...]
]:
    """The pipeline's stages and schedule (:func:`plan_pipeline`), then the busiest pipeline
    rank's memory, collectives and activation estimates (:func:`pipeline_costs`)."""
    pipeline = options.pipeline
    assert pipeline is not None
    tp_axis = layout.tp_axis
    seq_shards = mesh.size(tp_axis) if layout.sequence_parallel and tp_axis is not None else 1
    pipeline_plan = plan_pipeline(
        model,
        mesh,
        pipeline,
        options,
        seq_shards=seq_shards,
        resharded=bool(layout.data_axes)
        and any(u.decisions.reshard_after_forward for u in layout.units),
        param_bytes={p.fqn: p.bytes_at_rest for p in layout.params},
        activations=layout.profile,
        checkpointed=options.checkpointed_blocks(layout.blocks),
        trainable={p.fqn: p.trainable for p in layout.params},
    )
    costs = pipeline_costs(pipeline_plan, mesh, layout, options)
    note = (
        f"memory and collectives are the busiest pipeline rank's ({pipeline.axis} rank "
        f"{costs.busiest}); inside the schedule gradients are reduced once per step"
    )
    collectives, notes = costs.collectives, (*layout.notes, note)
    kept = {fqn for stage in pipeline_plan.local_stages(costs.busiest) for fqn in stage.params}
    groups = tuple(g for g in layout.experts if set(g.params) & kept)
    if layout.expert_axis is not None and groups:  # the busiest rank's MoE layers' all-to-alls
        ep, checkpointed = mesh.size(layout.expert_axis), options.checkpointed_blocks(layout.blocks)
        collectives += estimate_expert_collectives(
            groups, layout.params, layout.expert_axis, ep, options, checkpointed
        )
        notes += expert_notes(groups, layout.params, layout.expert_axis, ep, options, checkpointed)
    return pipeline_plan, costs.memory, collectives, notes, costs.estimates


def _router_count_collectives(
    model: nn.Module,
    mesh: Mesh,
    layout: Inferred,
    options: PlanOptions,
    modules: tuple[str, ...] | None,
) -> tuple[Collective, ...]:
    """The routers' count all-reduces over the token ranks (:mod:`meshtrain.plan.experts.router_counts`),
    of the busiest pipeline rank's ``modules`` when given."""
    routers = counting_routers(model)
    if modules is not None:
        routers = tuple(
            r for r in routers if any(r.fqn == m or r.fqn.startswith(m + ".") for m in modules)
        )
    axes = (*layout.data_axes, layout.expert_axis, layout.context_axis)
    return count_collectives(
        routers,
        axis=mesh.joined(tuple(a for a in axes if a is not None)),
        microbatches=options.microbatches,
        checkpointed=options.checkpointed_blocks(layout.blocks),
    )


def _buffer_collectives(model: nn.Module, mesh: Mesh, layout: Inferred) -> tuple[Collective, ...]:
    """One all-reduce per averaged buffer per forward over the token ranks (one micro-batch)."""
    if not layout.averaged_buffers:
        return ()
    buffers = dict(model.named_buffers())
    axes = (*layout.data_axes, layout.expert_axis, layout.context_axis)
    found = [buffers[fqn] for fqn, _ in layout.averaged_buffers if fqn in buffers]
    payload = sum(b.numel() * b.element_size() for b in found)
    return (
        Collective(
            "all_reduce",
            mesh.joined(tuple(a for a in axes if a is not None)),
            len(found),
            payload,
            "buffers written from the batch, averaged after each forward (batch_buffers='average')",
        ),
    )


def _hsdp_note(
    mesh: Mesh, active: tuple[str, ...], beside: tuple[str, ...], expert_axis: str | None
) -> str:
    """What HSDP beside an expert or context axis shards over: the parameters (outside the
    experts) over the shard axis and ``beside`` flattened, replicated over the replicate axis;
    the experts (over ``expert_axis``) over the shard axis, replicated over the replicate axis.

    Example:
        >>> _hsdp_note(Mesh(("rep", "dp", "ep"), (2, 2, 2)), ("rep", "dp"), ("ep",), "ep")
        "HSDP: parameters outside the experts replicated over 'rep' and sharded over 'dp+ep' (4 ranks); the experts sharded over 'ep', then FSDP-sharded over 'dp' and replicated over 'rep'"
    """
    replicate, shard = active
    flat = mesh.joined((shard, *beside))
    ways = math.prod(mesh.size(axis) for axis in (shard, *beside))
    what = "parameters outside the experts" if expert_axis else "parameters"
    note = f"HSDP: {what} replicated over '{replicate}' and sharded over '{flat}' ({ways} ranks)"
    if expert_axis:
        note += (
            f"; the experts sharded over '{expert_axis}', then FSDP-sharded over '{shard}' "
            f"and replicated over '{replicate}'"
        )
    return note


def _decided(units: tuple[FSDPUnit, ...], options: PlanOptions) -> tuple[FSDPUnit, ...]:
    """The units with what the ZeRO stage decides for each (:func:`fsdp_decisions`)."""
    return tuple(replace(u, decisions=options.unit_decisions(u.fqn)) for u in units)


def _batch_norms(model: nn.Module, options: PlanOptions) -> tuple[str, ...]:
    """The BatchNorm modules; refused when each forward sees a micro-batch, whose statistics are
    not the step's batch's (one device normalises the whole batch at once)."""
    found = tuple(
        fqn for fqn, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)
    )
    if found and options.microbatches > 1:
        where = "pipeline micro-batches" if options.pipeline is not None else "micro-batches"
        raise PlanError(
            f"BatchNorm {list(found[:3])} would compute its statistics over each of the "
            f"{options.microbatches} {where} of a step, not over the step's batch as one device "
            "does, so it would not train like one device. Use one micro-batch "
            "(microbatches=1, or Pipeline(microbatches=1)), or a normalisation without batch "
            "statistics (GroupNorm, LayerNorm).",
            fqn=found[0],
        )
    return found


def _check_tied(tied: tuple[tuple[str, ...], ...], blocks: tuple[str, ...]) -> None:
    """A tied parameter is gathered with one FSDP unit: every module using it must be in it."""
    for group in tied:
        owners = {
            max((b for b in blocks if fqn.startswith(b + ".")), key=len, default="")
            for fqn in group
        }
        if len(owners) > 1:
            raise PlanError(
                f"parameters {list(group)} are one tensor (tied weights) used in different FSDP "
                f"units {sorted(owners)} ('' is the root): FSDP2 gathers a parameter with one "
                "unit, so the other would compute with its shard. Untie them, or pass "
                "fsdp_units=[...] so that both modules fall into one unit.",
                fqn=group[1],
            )


def _cast_axes(
    options: PlanOptions, data_axes: tuple[str, ...], active_data: tuple[str, ...], mesh: Mesh
) -> tuple[str, ...]:
    """Size-1 data axes that carry FSDP2's mixed-precision policy when no data axis is > 1."""
    if options.precision == "fp32" or active_data:
        return ()
    carriers = tuple(axis for axis in data_axes if axis in mesh.device_axes)
    if not carriers:
        raise PlanError(
            f"precision={options.precision!r} is lowered through FSDP2's mixed-precision policy "
            f"over a data axis, and mesh {mesh} has no data axis larger than 1 among the rules' "
            f"fsdp axes {list(data_axes)} (tensor or pipeline parallelism alone; a size-1 axis "
            "carries it only on a single device). Add data parallelism (a data axis ≥ 2; zero=0 "
            "replicates like DDP) or train this mesh in fp32.",
            mesh=mesh,
        )
    return carriers


#: styles whose modules compute on tensor-parallel shards (parents of column-/row-wise pairs,
#: column-wise layers and a loss-parallel head)
_TP_REGION_STYLES = frozenset(
    {TPStyle.PREPARE_INPUT, TPStyle.COLWISE, TPStyle.LOSS_PARALLEL_HEAD, TPStyle.ROWWISE}
)


def _activation_profile(
    model: nn.Module,
    blocks: tuple[str, ...],
    styles: tuple[ModuleStyle, ...],
    options: PlanOptions,
    mesh: Mesh,
    tp_axis: str | None,
    sequence_parallel: bool,
    context_axis: str | None = None,
) -> ActivationProfile | str | None:
    """The traced activation profile, None without batch_size/seq_len, or why tracing failed;
    under context parallelism traced on a rank's share of each sequence
    (:mod:`meshtrain.plan.context.cost`)."""
    if options.batch_size is None or options.seq_len is None:
        return None
    tp_modules = [s.fqn for s in styles if s.style in _TP_REGION_STYLES]
    whole = [s.fqn for s in styles if s.style in WHOLE_SEQUENCE]
    cp = mesh.size(context_axis) if context_axis is not None else 1
    try:
        profile = trace_activations(
            model,
            blocks,
            batch_size=options.batch_size,
            seq_len=local_seq_len(options.seq_len, cp) or options.seq_len,
            dtype=getattr(torch, options.param_dtype),
            tp_modules=tp_modules,
            whole_modules=whole,
            tp_size=mesh.size(tp_axis) if tp_axis is not None else 1,
            sequence_parallel=sequence_parallel,
        )
        return context_profile(profile, cp, options.context_method)
    except Exception as error:  # the model's own forward: report, do not fail planning
        return (
            "activation memory not estimated: the forward on a fake "
            f"[{options.batch_size}, {options.seq_len}] token batch failed "
            f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''})"
        )


def _batch_size(
    mesh: Mesh, rules: Rules, options: PlanOptions, microbatches: int, expert_axis: str | None
) -> int | None:
    """Sequences per micro-batch per batch rank, from ``global_batch`` when given."""
    global_batch, batch_size = options.global_batch, options.batch_size
    if global_batch is None:
        return batch_size
    data_ranks = 1
    for axis in (*rules.fsdp, *((expert_axis,) if expert_axis else ())):
        data_ranks *= mesh.size(axis) if axis in mesh.axis_names else 1
    per_step = data_ranks * microbatches
    if global_batch % per_step:
        what = "pipeline micro-batches" if options.pipeline is not None else "micro-batches"
        raise PlanError(
            f"global_batch={global_batch} does not split into {data_ranks} data-parallel ranks × "
            f"{microbatches} {what} on mesh {mesh}: each micro-batch needs a whole number of "
            f"sequences. Use a multiple of {per_step} (e.g. {per_step * max(1, global_batch // per_step)})"
            f" or change microbatches.",
            mesh=mesh,
        )
    derived = global_batch // per_step
    if batch_size is not None and batch_size != derived:
        raise PlanError(
            f"batch_size={batch_size} (sequences per micro-batch per data-parallel rank) "
            f"disagrees with global_batch={global_batch} / ({data_ranks} ranks × {microbatches} "
            f"micro-batches) = {derived}; give one of them."
        )
    return derived
