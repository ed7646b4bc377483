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
    describe_uneven,
    infer_axes,
    infer_layouts,
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
    fsdp_units: Sequence[str] | None = None,
) -> Plan:
    """Compile ``rules`` for ``model`` on ``mesh`` into a :class:`Plan` (pure; meta models work).

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
    )
    resolution = rules.resolve(model, mesh)
    data_axes, tp_axis = infer_axes(resolution, rules.fsdp)
    active_data = tuple(axis for axis in data_axes if mesh.size(axis) > 1)
    shard_axes = shard_axes_of(active_data)
    layouts = infer_layouts(resolution, shard_axes, options)
    styles = infer_styles(model, resolution.specs, tp_axis, options.loss_parallel)
    units = infer_units(model, fsdp_units) if active_data else ()
    notes = describe_uneven(layouts, mesh, shard_axes) if shard_axes and zero >= 1 else []
    if not active_data:
        notes.append("no data axis larger than 1: no data-parallel wrapping, no gradient reduction")
    return Plan(
        mesh=mesh,
        options=options,
        data_axes=active_data,
        tp_axis=tp_axis,
        params=layouts,
        styles=styles,
        units=units,
        collectives=estimate_collectives(layouts, units, active_data, options)
        + estimate_tp_collectives(styles, tp_axis, options),
        memory=estimate_memory(layouts, options),
        notes=tuple(notes),
    )
