"""``mt.plan``: resolve specs, infer the parallel layout, cost it — no collectives, no memory.

Example:
    >>> import meshtrain as mt
    >>> from meshtrain.models import LlamaConfig, build_llama, default_rules
    >>> model = build_llama(LlamaConfig.llama3_8b(), device="meta")
    >>> mesh = mt.make_mesh(dp=-1, tp=8, world_size=1024, abstract=True)
    >>> plan = mt.plan(model, mesh, default_rules(), zero=3)
    >>> plan.tp_axis, plan.data_axes, len(plan.units)
    ('tp', ('dp',), 33)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from meshtrain.plan.activations import ActivationProfile, trace_activations
from meshtrain.plan.cost import (
    estimate_collectives,
    estimate_memory,
    estimate_tp_collectives,
    pipeline_step_scalars,
)
from meshtrain.plan.infer import (
    check_sequence_length,
    describe_uneven,
    infer_axes,
    infer_layouts,
    infer_sequence_parallel,
    infer_styles,
    infer_units,
    shard_axes_of,
)
from meshtrain.plan.ir import (
    Collective,
    FSDPUnit,
    Memory,
    ModuleStyle,
    ParamLayout,
    PipelinePlan,
    Plan,
    StagePlan,
)
from meshtrain.plan.options import PlanOptions, Precision
from meshtrain.plan.pipeline import Pipeline, check_pipeline_axis, plan_pipeline
from meshtrain.plan.policies import (
    block_fqns,
    parse_checkpointing,
    parse_compile,
    resolve_compile_scope,
)
from meshtrain.spec.errors import PlanError
from meshtrain.spec.mesh import Mesh
from meshtrain.spec.rules import Rules


def plan(
    model: nn.Module,
    mesh: Mesh,
    rules: Rules,
    *,
    zero: int = 3,
    offload: bool = False,
    precision: Precision = "fp32",
    reduce_precision: Precision = "fp32",
    optimizer: str = "adamw",
    loss_parallel: bool = True,
    microbatches: int = 1,
    batch_size: int | None = None,
    seq_len: int | None = None,
    fsdp_units: Sequence[str] | None = None,
    pipeline: Pipeline | None = None,
    global_batch: int | None = None,
    activation_checkpointing: str | Mapping[str, Any] = "none",
    compile: bool | Mapping[str, Any] = False,
    strategy: str = "manual",
    device_memory: int | str | None = None,
    node_size: int = 8,
) -> Plan:
    """Compile ``rules`` for ``model`` on ``mesh`` into a :class:`Plan` (pure; meta models work).

    ``batch_size`` (sequences per micro-batch per data-parallel rank) and ``seq_len`` are optional;
    given, they size the activation collectives in ``explain()``, and under sequence parallelism
    ``seq_len`` must divide by the tensor-parallel size.

    ``fsdp_units`` overrides the detected repeated blocks that FSDP wraps one by one.

    ``pipeline`` (a :class:`~meshtrain.plan.pipeline.Pipeline`) lays stages along a mesh axis;
    its micro-batches are then the plan's (leave ``microbatches`` at 1). ``global_batch``
    (sequences per optimizer step over all data-parallel ranks) must divide into data-parallel
    ranks × micro-batches; it fills in ``batch_size`` when that is not given.

    ``activation_checkpointing``: 'none', 'full' (recompute each block in backward), 'selective'
    (keep matmul and attention outputs, recompute the rest) or ``{"every": k}`` (every k-th block,
    full; add ``"mode": "selective"`` for selective). ``compile``: True or a dict with
    ``backend`` ('inductor'), ``fullgraph`` (False) and ``scope`` ('auto': each block, or the whole
    model where torch cannot compile blocks; 'block'; 'model'). ``precision`` 'bf16'/'fp16' casts
    parameters for compute through FSDP2's mixed-precision policy (a data axis of size 1 is
    enough); fp16 also needs :class:`~meshtrain.train.LossScaler`.

    ``strategy="auto"`` chooses the mesh's pp/dp/tp degrees (over ``mesh.world_size`` ranks in
    nodes of ``node_size``), the ZeRO stage (``zero`` is ignored), gradient accumulation or
    pipeline micro-batches and checkpointing so that the plan fits ``device_memory`` (bytes or
    "80GiB") at the least modelled step overhead (:mod:`meshtrain.plan.auto`); it needs
    ``global_batch`` and ``seq_len``, and ``rules`` over the axes ``dp`` and ``tp``. The returned
    plan's mesh is the chosen one (built for real when ``mesh`` was) and ``explain()`` says why.
    """
    if strategy == "auto":
        return _auto(model, mesh, rules, locals())
    if strategy != "manual":
        raise PlanError(f"strategy={strategy!r} is not one of 'manual' or 'auto'.")
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
    batch_size = _batch_size(mesh, rules, microbatches, batch_size, global_batch, pipeline)
    checkpoint_mode, checkpoint_every = parse_checkpointing(activation_checkpointing)
    options = PlanOptions(
        activation_checkpointing=checkpoint_mode,  # type: ignore[arg-type]
        checkpoint_every=checkpoint_every,
        **parse_compile(compile),
        zero=zero,
        offload=offload,
        precision=precision,
        reduce_precision=reduce_precision,
        optimizer=optimizer,
        loss_parallel=loss_parallel,
        microbatches=microbatches,
        batch_size=batch_size,
        seq_len=seq_len,
    )
    resolution = rules.resolve(model, mesh)
    data_axes, tp_axis = infer_axes(
        resolution, rules.fsdp, pipeline.axis if pipeline is not None else None
    )
    active_data = tuple(axis for axis in data_axes if mesh.size(axis) > 1)
    shard_axes = shard_axes_of(active_data)
    element_bytes = {fqn: param.element_size() for fqn, param in model.named_parameters()}
    layouts = infer_layouts(resolution, shard_axes, options, element_bytes)
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    sequence_parallel = infer_sequence_parallel(rules, mesh, data_axes, tp_axis)
    styles = infer_styles(model, resolution, tp_axis, options.loss_parallel, sequence_parallel)
    if sequence_parallel and seq_len is not None and tp_axis is not None:
        check_sequence_length(seq_len, tp_axis, mesh)
    notes = describe_uneven(layouts, mesh, shard_axes) if shard_axes and zero >= 1 else []
    if not active_data:
        notes.append("no data axis larger than 1: no data-parallel wrapping, no gradient reduction")
    all_units = infer_units(model, fsdp_units)
    blocks = block_fqns(all_units)
    cast_axes = _cast_axes(options, data_axes, active_data, mesh)
    units = all_units if active_data or cast_axes else ()
    checkpointed = options.checkpointed_blocks(blocks)
    compile_scope = resolve_compile_scope(
        options,
        sequence_parallel=sequence_parallel,
        wrapped=bool(units),
        tp_axis=tp_axis,
        split_backward_schedule=(
            pipeline.schedule if pipeline is not None and pipeline.splits_backward else None
        ),
    )
    profile = _activation_profile(model, blocks, styles, options, mesh, tp_axis, sequence_parallel)
    estimates: tuple[tuple[str, int], ...] = ()
    if isinstance(profile, str):
        notes.append(profile)
        profile = None
    elif profile is not None:
        estimates = tuple(
            (mode, profile.peak(mode, blocks if mode != "none" else ()))
            for mode in ("none", "full", "selective")
        )
    pipeline_plan = None
    if pipeline is None:
        memory = estimate_memory(
            layouts, units, options, buffers=buffers, sharded=bool(active_data)
        )
        if profile is not None:
            memory = replace(
                memory,
                activations=profile.peak(options.activation_checkpointing, checkpointed),
            )
        collectives = estimate_collectives(layouts, units, active_data, options)
        collectives += estimate_tp_collectives(
            styles,
            layouts,
            tp_axis,
            options,
            sequence_parallel=sequence_parallel,
            data_parallel=bool(active_data),
        )
    else:
        seq_shards = mesh.size(tp_axis) if sequence_parallel and tp_axis is not None else 1
        pipeline_plan = plan_pipeline(
            model,
            mesh,
            pipeline,
            options,
            seq_shards=seq_shards,
            resharded=bool(active_data) and zero == 3,
            param_bytes={p.fqn: p.bytes_at_rest for p in layouts},
            activations=profile,
            checkpointed=checkpointed,
        )
        memory, collectives, busiest = _pipeline_costs(
            pipeline_plan,
            layouts,
            units,
            options,
            buffers=buffers,
            data_axes=active_data,
            styles=styles,
            tp_axis=tp_axis,
            sequence_parallel=sequence_parallel,
        )
        collectives = (*collectives, *pipeline_step_scalars(mesh, pipeline.axis, active_data))
        notes.append(
            f"memory and collectives are the busiest pipeline rank's ({pipeline.axis} rank "
            f"{busiest}); inside the schedule gradients are reduced once per step"
        )
        if profile is not None:  # per mode, for the busiest rank's stages and micro-batches
            local = pipeline_plan.local_stages(busiest)
            estimates = tuple(
                (mode, sum(profile.peak(mode, blocks if mode != "none" else (), stage.modules,
                                        stage.in_flight) for stage in local))
                for mode, _ in estimates
            )  # fmt: skip
    return Plan(
        mesh=mesh,
        options=options,
        data_axes=active_data,
        tp_axis=tp_axis,
        sequence_parallel=sequence_parallel,
        activation_rules=rules.logical,
        params=layouts,
        styles=styles,
        units=units,
        collectives=collectives,
        memory=memory,
        pipeline=pipeline_plan,
        notes=tuple(notes),
        blocks=blocks,
        compile_scope=compile_scope,
        cast_axes=cast_axes,
        activation_estimates=estimates,
    )


def _auto(model: nn.Module, mesh: Mesh, rules: Rules, given: dict[str, Any]) -> Plan:
    """``strategy="auto"``: check what auto chooses was left alone, then search."""
    from meshtrain.plan.auto import choose_plan
    from meshtrain.plan.footprint import parse_bytes

    chosen = {"pipeline": None, "microbatches": 1, "activation_checkpointing": "none",
              "batch_size": None}  # fmt: skip
    clashes = [
        f"{name}={given[name]!r}" for name, default in chosen.items() if given[name] != default
    ]
    missing = [name for name in ("device_memory", "global_batch", "seq_len") if given[name] is None]
    if clashes or missing:
        raise PlanError(
            f"strategy='auto' on mesh {mesh}: "
            + (f"it chooses {', '.join(clashes)} itself — leave them out; " if clashes else "")
            + (f"it needs {', '.join(missing)}." if missing else ""),
            mesh=mesh,
        )
    shared = ("offload", "precision", "reduce_precision", "optimizer", "loss_parallel",
              "fsdp_units", "compile")  # fmt: skip
    return choose_plan(
        model, mesh.world_size, rules, device_memory=parse_bytes(given["device_memory"]),
        global_batch=given["global_batch"], seq_len=given["seq_len"],
        node_size=given["node_size"], device_type=mesh.device_type,
        real_mesh=not mesh.is_abstract, **{name: given[name] for name in shared},
    ).plan  # fmt: skip


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


def _activation_profile(
    model: nn.Module,
    blocks: tuple[str, ...],
    styles: tuple[ModuleStyle, ...],
    options: PlanOptions,
    mesh: Mesh,
    tp_axis: str | None,
    sequence_parallel: bool,
) -> ActivationProfile | str | None:
    """The traced activation profile, None without batch_size/seq_len, or why tracing failed."""
    if options.batch_size is None or options.seq_len is None:
        return None
    tp_modules = [s.fqn for s in styles if s.style in _TP_REGION_STYLES]
    try:
        return trace_activations(
            model,
            blocks,
            batch_size=options.batch_size,
            seq_len=options.seq_len,
            dtype=getattr(torch, options.param_dtype),
            tp_modules=tp_modules,
            tp_size=mesh.size(tp_axis) if tp_axis is not None else 1,
            sequence_parallel=sequence_parallel,
        )
    except Exception as error:  # the model's own forward: report, do not fail planning
        return (
            "activation memory not estimated: the forward on a fake "
            f"[{options.batch_size}, {options.seq_len}] token batch failed "
            f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''})"
        )


#: styles whose modules compute on tensor-parallel shards (parents of column-/row-wise pairs,
#: column-wise layers and a loss-parallel head)
_TP_REGION_STYLES = frozenset({"prepare_input", "colwise", "loss_parallel_head", "rowwise"})


def _pipeline_costs(
    pipeline: PipelinePlan,
    layouts: tuple[ParamLayout, ...],
    units: tuple[FSDPUnit, ...],
    options: PlanOptions,
    *,
    buffers: int,
    data_axes: tuple[str, ...],
    styles: tuple[ModuleStyle, ...],
    tp_axis: str | None,
    sequence_parallel: bool,
) -> tuple[Memory, tuple[Collective, ...], int]:
    """The busiest pipeline rank: its memory, its collectives per step, and its pipeline rank.

    Each stage is wrapped like a model of its own: its blocks are units, the rest of its
    parameters (embedding, norm, head) its root unit. Every rank keeps the model's buffers.
    """
    by_fqn = {layout.fqn: layout for layout in layouts}

    def rank_layouts(rank: int) -> list[ParamLayout]:
        return [by_fqn[fqn] for s in pipeline.local_stages(rank) for fqn in s.params]

    def rank_memory(rank: int) -> Memory:
        stages = pipeline.local_stages(rank)
        memory = estimate_memory(
            rank_layouts(rank),
            _stage_units(stages, units),
            options,
            buffers=buffers,
            sharded=bool(data_axes),
        )
        return replace(memory, activations=sum(s.activation_bytes for s in stages))

    ranks = sorted({s.rank for s in pipeline.stages})
    memory, busiest = max(
        ((rank_memory(rank), rank) for rank in ranks),
        key=lambda pair: pair[0].total,
    )
    stages = pipeline.local_stages(busiest)
    modules = tuple(module for stage in stages for module in stage.modules)
    local_styles = tuple(
        style
        for style in styles
        if any(style.fqn == m or style.fqn.startswith(m + ".") for m in modules)
    )
    send = Collective(
        "send/recv",
        pipeline.axis,
        pipeline.p2p_count,
        pipeline.p2p_bytes,
        "activations to the next stage, their gradients back (per pipeline rank pair)",
    )
    data_parallel: list[Collective] = []
    for stage in stages:
        data_parallel += estimate_collectives(
            [by_fqn[fqn] for fqn in stage.params], _stage_units((stage,), units), data_axes,
            options, pipelined=True, block_gathers=stage.zero3_gathers,
        )  # fmt: skip
    collectives = (
        send,
        *_merged(data_parallel),
        *estimate_tp_collectives(
            local_styles,
            layouts,
            tp_axis,
            options,
            sequence_parallel=sequence_parallel,
            data_parallel=bool(data_axes),
            pipelined=True,
        ),
    )
    return memory, collectives, busiest


def _merged(collectives: Sequence[Collective]) -> tuple[Collective, ...]:
    """Rows of the same kind, axis and reason summed (one rank's stages together)."""
    rows: dict[tuple[str, str, str], Collective] = {}
    for c in collectives:
        key = (c.kind, c.axis, c.why)
        old = rows.get(key)
        rows[key] = c if old is None else replace(old, count=old.count + c.count,
                                                   bytes=old.bytes + c.bytes)  # fmt: skip
    return tuple(rows.values())


def _stage_units(stages: Sequence[StagePlan], units: tuple[FSDPUnit, ...]) -> tuple[FSDPUnit, ...]:
    """The FSDP units of one pipeline rank: its stages' blocks, then one root per stage."""
    if not units:
        return ()
    result: list[FSDPUnit] = []
    for stage in stages:
        blocks = [u for u in units if u.fqn and u.fqn in stage.modules]
        owned = {fqn for unit in blocks for fqn in unit.params}
        result += blocks
        result.append(FSDPUnit("", tuple(fqn for fqn in stage.params if fqn not in owned)))
    return tuple(result)


def _batch_size(
    mesh: Mesh,
    rules: Rules,
    microbatches: int,
    batch_size: int | None,
    global_batch: int | None,
    pipeline: Pipeline | None,
) -> int | None:
    """Sequences per micro-batch per data-parallel rank, from ``global_batch`` when given."""
    if global_batch is None:
        return batch_size
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
        raise PlanError(f"global_batch={global_batch!r} must be a positive integer.")
    data_ranks = 1
    for axis in rules.fsdp:
        data_ranks *= mesh.size(axis) if axis in mesh.axis_names else 1
    per_step = data_ranks * microbatches
    if global_batch % per_step:
        what = "pipeline micro-batches" if pipeline is not None else "micro-batches"
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
