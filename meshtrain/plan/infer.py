"""Passes from resolved specs to the plan IR: axes, tensor-parallel styles, FSDP units, layouts.

Everything here is pure (meta-device models, abstract meshes) and raises :class:`PlanError`
while planning, the same on every rank, for configurations that cannot lower correctly.

Tensor-parallel style inference is in :mod:`meshtrain.plan.tensor.styles`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from torch import nn

from meshtrain.errors import PlanError, format_shape
from meshtrain.plan.ir import (
    ExpertGroup,
    FSDPUnit,
    ModuleStyle,
    ParamLayout,
    ParamReader,
    PartialGrad,
)
from meshtrain.plan.memory.activations import ActivationProfile
from meshtrain.plan.options import PlanOptions
from meshtrain.spec.layout import local_shape
from meshtrain.spec.mesh import Mesh
from meshtrain.spec.rules import Resolution, Rules

_ELEMENT_BYTES = 4  # fp32 master parameters


def infer_axes(
    resolution: Resolution,
    data_axes: Sequence[str],
    pipeline_axis: str | None = None,
    context_axis: str | None = None,
    expert_axis: str | None = None,
) -> tuple[tuple[str, ...], str | None]:
    """The data axes (checked) and the one tensor-parallel axis the specs use (or ``None``).

    Every mesh axis larger than 1 must have a job: a data axis, the pipeline axis, the context
    axis, or an axis some spec shards over.
    """
    mesh = resolution.mesh
    data = tuple(data_axes)
    _check_data_axes(data, pipeline_axis, mesh)
    used: dict[str, str] = {}
    for param in resolution.params:
        for axis in param.spec.axes:
            used.setdefault(axis, param.fqn)
    _check_sharded_axes(used, data, pipeline_axis, mesh)
    tp_axes = sorted(
        {axis for axis in used if mesh.size(axis) > 1 and axis != expert_axis},
        key=mesh.axis_names.index,
    )
    if len(tp_axes) > 1:
        raise PlanError(
            f"parameters are sharded over several model axes {tp_axes} on mesh {mesh} (e.g. "
            f"'{used[tp_axes[0]]}' over '{tp_axes[0]}', '{used[tp_axes[1]]}' over "
            f"'{tp_axes[1]}'); tensor parallelism lowers over one axis. Use one axis in the specs.",
            mesh=mesh,
        )
    idle = [
        axis
        for axis, size in zip(mesh.axis_names, mesh.axis_sizes)
        if size > 1
        and axis not in data
        and axis not in used
        and axis not in (pipeline_axis, context_axis)
    ]
    if idle:
        raise PlanError(
            f"mesh axis '{idle[0]}' (size {mesh.size(idle[0])}) of mesh {mesh} is neither a data "
            f"axis (fsdp={data!r}) nor used by any parameter spec, so its ranks would repeat the "
            f"same work. Add it to fsdp (e.g. Rules(..., fsdp='{idle[0]}')), shard parameters "
            f"over it, or lay a pipeline along it (pipeline=mt.Pipeline(axis='{idle[0]}')).",
            mesh=mesh,
        )
    return data, (tp_axes[0] if tp_axes else None)


def _check_data_axes(data: tuple[str, ...], pipeline_axis: str | None, mesh: Mesh) -> None:
    """One or two data axes, none of them the pipeline axis."""
    if pipeline_axis is not None and pipeline_axis in data:
        raise PlanError(
            f"axis '{pipeline_axis}' is the pipeline axis and a data axis (fsdp={data!r}) on mesh "
            f"{mesh}; stages along it hold different layers, so it cannot also split the batch. "
            "Use separate axes, e.g. mt.make_mesh(pp=2, dp=-1).",
            mesh=mesh,
        )
    if len(data) > 2:
        raise PlanError(
            f"fsdp={data!r} names {len(data)} data axes on mesh {mesh}; give one (FSDP) or two "
            "(HSDP: replicate axis, then shard axis).",
            mesh=mesh,
        )


def _check_sharded_axes(
    used: dict[str, str], data: tuple[str, ...], pipeline_axis: str | None, mesh: Mesh
) -> None:
    """No parameter sharded over the pipeline axis or a data axis (``used``: axis → the first
    parameter sharded over it)."""
    if pipeline_axis in used:
        raise PlanError(
            f"parameter '{used[pipeline_axis]}' is sharded over the pipeline axis "
            f"'{pipeline_axis}' on mesh {mesh}; pipeline ranks hold different stages, not shards "
            "of one parameter. Shard over another axis.",
            fqn=used[pipeline_axis],
            mesh=mesh,
        )
    for axis in data:
        if axis in used:
            raise PlanError(
                f"axis '{axis}' is a data axis (fsdp={data!r}) but parameter '{used[axis]}' is "
                f"sharded over it on mesh {mesh}; a data axis splits the batch and cannot also be "
                "a tensor-parallel axis. Use another axis in the spec, or drop it from fsdp.",
                fqn=used[axis],
                mesh=mesh,
            )


def infer_sequence_parallel(
    rules: Rules,
    mesh: Mesh,
    data_axes: Sequence[str],
    tp_axis: str | None,
    context_axis: str | None = None,
) -> bool:
    """Whether the activation rules shard the sequence dim over the tensor-parallel axis.

    Activations are ``[batch, seq, features]``; a logical rule ``("seq", axis)`` shards dim 1.
    Besides the context axis (context parallelism, :mod:`meshtrain.plan.context.axis`), only the
    tensor-parallel axis can take it (sequence parallelism); a sequence rule onto a data axis
    is refused.
    """
    if not any(name == "seq" for name, _ in rules.logical):
        return False
    axes = [
        axis
        for axis in rules.logical_spec(("seq",), mesh).axes
        if mesh.size(axis) > 1 and axis != context_axis
    ]
    if not axes:
        return False
    if axes != [tp_axis]:
        raise PlanError(
            f"the activation rule for 'seq' maps the sequence dim to {axes} on mesh {mesh}, but "
            f"sequence parallelism shards it over the tensor-parallel axis only ({tp_axis!r}); "
            f"sharding it over {'data axis' if set(axes) & set(data_axes) else 'another axis'} "
            f"would be context parallelism, which is not supported. Use ('seq', {tp_axis!r}) or "
            "('seq', None).",
            rule=f"('seq', {axes!r})",
            mesh=mesh,
        )
    return True


def check_sequence_length(seq_len: int, tp_axis: str, mesh: Mesh) -> None:
    """Sequence parallelism splits each sequence evenly over the tensor-parallel axis."""
    ways = mesh.size(tp_axis)
    if seq_len % ways:
        raise PlanError(
            f"seq_len={seq_len} does not divide over tensor-parallel axis '{tp_axis}' of size "
            f"{ways} on mesh {mesh}, which sequence parallelism shards it over. Use a sequence "
            f"length that is a multiple of {ways} (e.g. {seq_len + ways - seq_len % ways}), or drop "
            "the ('seq', ...) activation rule.",
            mesh=mesh,
        )


def infer_units(model: nn.Module, explicit: Sequence[str] | None) -> tuple[FSDPUnit, ...]:
    """FSDP units: each child of every ModuleList/ModuleDict (the repeated blocks), then the root.

    ``explicit`` replaces the detected blocks with the given module FQNs (the root is always last).
    """
    modules = dict(model.named_modules())
    if explicit is not None:
        for fqn in explicit:
            if fqn not in modules or fqn == "":
                raise PlanError(
                    f"fsdp_units names '{fqn}', which is not a submodule FQN of "
                    f"{type(model).__name__}; use names from model.named_modules(), e.g. "
                    f"{[name for name in modules if name][:3]}."
                )
        blocks = list(explicit)
    else:
        blocks = [
            f"{fqn}.{name}" if fqn else name
            for fqn, module in modules.items()
            if isinstance(module, (nn.ModuleList, nn.ModuleDict))
            for name, _ in module.named_children()
        ]
    owner: dict[str, str] = {}
    for fqn, _ in model.named_parameters():
        owner[fqn] = max((b for b in blocks if fqn.startswith(b + ".")), key=len, default="")
    units = [FSDPUnit(block, tuple(p for p, o in owner.items() if o == block)) for block in blocks]
    units.append(FSDPUnit("", tuple(p for p, o in owner.items() if o == "")))
    return tuple(unit for unit in units if unit.params or unit.fqn == "")


def infer_layouts(
    resolution: Resolution,
    shard_axes: Sequence[str],
    options: PlanOptions,
    element_bytes: Mapping[str, int] | None = None,
    *,
    trainable: Mapping[str, bool] | None = None,
    storage: Mapping[str, str] | None = None,
) -> tuple[ParamLayout, ...]:
    """Per-parameter compute layout and FSDP shard shape (dim 0 split over ``shard_axes``, padded);
    ``element_bytes``: each parameter's dtype size (default 4, fp32 master parameters);
    ``trainable``: whether each requires a gradient (default yes); ``storage``: "nf4" for
    4-bit weights."""
    mesh = resolution.mesh
    sharded = options.decisions.shard_params
    ways = math.prod(mesh.size(axis) for axis in shard_axes) if sharded else 1
    layouts = []
    for param in resolution.params:
        local = local_shape(param.spec, param.shape, mesh)
        shard = (-(-local[0] // ways), *local[1:]) if local else local
        layouts.append(
            ParamLayout(
                param.fqn,
                param.shape,
                param.spec,
                param.source,
                local,
                shard,
                (element_bytes or {}).get(param.fqn, _ELEMENT_BYTES),
                (trainable or {}).get(param.fqn, True),
                (storage or {}).get(param.fqn, ""),
            )
        )
    return tuple(layouts)


def shard_axes_of(data_axes: tuple[str, ...]) -> tuple[str, ...]:
    """The data axes FSDP shards over: all of them, or the second one under HSDP."""
    return data_axes[1:] if len(data_axes) == 2 else data_axes


def describe_uneven(
    layouts: Sequence[ParamLayout], mesh: Mesh, shard_axes: Sequence[str]
) -> list[str]:
    """Notes for parameters whose dim 0 FSDP pads (not an error: FSDP2 pads uneven shards)."""
    ways = math.prod(mesh.size(axis) for axis in shard_axes)
    padded = [p for p in layouts if p.local_shape and p.local_shape[0] % ways]
    if not padded:
        return []
    names = ", ".join(f"'{p.fqn}' ({format_shape(p.local_shape)})" for p in padded[:5])
    return [f"FSDP pads dim 0 of {len(padded)} parameter(s) to a multiple of {ways}: {names}"]


@dataclass(frozen=True)
class Inferred:
    """What inference decides before costing: axes, per-parameter layouts, module styles, FSDP
    units, blocks, compute policies, the activation profile and the notes so far."""

    data_axes: tuple[str, ...]  # data axes larger than 1
    tp_axis: str | None
    sequence_parallel: bool
    params: tuple[ParamLayout, ...]
    styles: tuple[ModuleStyle, ...]
    units: tuple[FSDPUnit, ...]
    blocks: tuple[str, ...]
    cast_axes: tuple[str, ...]
    compile_scope: str | None
    buffers: int
    profile: ActivationProfile | None
    notes: tuple[str, ...]
    tied: tuple[tuple[str, ...], ...] = ()
    batch_norms: tuple[str, ...] = ()
    partial_grads: tuple[PartialGrad, ...] = ()
    context_axis: str | None = None
    expert_axis: str | None = None
    experts: tuple[ExpertGroup, ...] = ()
    readers: tuple[ParamReader, ...] = ()
    fresh_outputs: tuple[str, ...] = ()
    averaged_buffers: tuple[tuple[str, str], ...] = ()
