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

from collections.abc import Sequence

from torch import nn

from meshtrain.plan.cost import estimate_collectives, estimate_memory, estimate_tp_collectives
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
from meshtrain.plan.ir import Plan
from meshtrain.plan.options import PlanOptions, Precision
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
) -> Plan:
    """Compile ``rules`` for ``model`` on ``mesh`` into a :class:`Plan` (pure; meta models work).

    ``batch_size`` (sequences per micro-batch per data-parallel rank) and ``seq_len`` are optional;
    given, they size the activation collectives in ``explain()``, and under sequence parallelism
    ``seq_len`` must divide by the tensor-parallel size.

    ``fsdp_units`` overrides the detected repeated blocks that FSDP wraps one by one.
    """
    options = PlanOptions(
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
    data_axes, tp_axis = infer_axes(resolution, rules.fsdp)
    active_data = tuple(axis for axis in data_axes if mesh.size(axis) > 1)
    shard_axes = shard_axes_of(active_data)
    layouts = infer_layouts(resolution, shard_axes, options)
    sequence_parallel = infer_sequence_parallel(rules, mesh, data_axes, tp_axis)
    styles = infer_styles(model, resolution, tp_axis, options.loss_parallel, sequence_parallel)
    if sequence_parallel and seq_len is not None and tp_axis is not None:
        check_sequence_length(seq_len, tp_axis, mesh)
    units = infer_units(model, fsdp_units) if active_data else ()
    notes = describe_uneven(layouts, mesh, shard_axes) if shard_axes and zero >= 1 else []
    if not active_data:
        notes.append("no data axis larger than 1: no data-parallel wrapping, no gradient reduction")
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
        collectives=estimate_collectives(layouts, units, active_data, options)
        + estimate_tp_collectives(
            styles,
            layouts,
            tp_axis,
            options,
            sequence_parallel=sequence_parallel,
            data_parallel=bool(active_data),
        ),
        memory=estimate_memory(layouts, options),
        notes=tuple(notes),
    )
