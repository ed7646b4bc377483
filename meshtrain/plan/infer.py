"""Passes from resolved specs to the plan IR: axes, tensor-parallel styles, FSDP units, layouts.

Everything here is pure (meta-device models, abstract meshes) and raises :class:`PlanError`
while planning, the same on every rank, for configurations that cannot lower correctly.

Style inference, per module, from its parameters' specs on the tensor-parallel axis ``a``:

=====================  ==========================  ==========================================
module                 weight spec                 style
=====================  ==========================  ==========================================
``nn.Linear``          ``P(a)`` (bias ``P(a)``)    ``colwise`` (output stays sharded when a
                                                   ``rowwise`` sibling consumes it; otherwise
                                                   gathered, or kept vocab-sharded for the
                                                   loss-parallel cross-entropy on the head)
``nn.Linear``          ``P(None, a)`` (bias ``P()``)  ``rowwise``
``nn.Embedding``       ``P(a)``                    ``vocab_parallel_embedding``
``nn.Embedding``       ``P(None, a)``              ``embedding_dim_parallel`` (output gathered)
=====================  ==========================  ==========================================

A sharded spec on any other module (a norm, a custom module) is an error that says why.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

from torch import nn

from meshtrain.plan.ir import FSDPUnit, ModuleStyle, ParamLayout
from meshtrain.plan.options import PlanOptions
from meshtrain.spec.errors import PlanError, format_shape
from meshtrain.spec.layout import local_shape
from meshtrain.spec.mesh import Mesh
from meshtrain.spec.partition import P
from meshtrain.spec.rules import Resolution

_ELEMENT_BYTES = 4  # fp32 master parameters


def infer_axes(
    resolution: Resolution, data_axes: Sequence[str]
) -> tuple[tuple[str, ...], str | None]:
    """The data axes (checked) and the one tensor-parallel axis the specs use (or ``None``).

    Every mesh axis larger than 1 must have a job: a data axis, or an axis some spec shards over.
    """
    mesh = resolution.mesh
    data = tuple(data_axes)
    if len(data) > 2:
        raise PlanError(
            f"fsdp={data!r} names {len(data)} data axes on mesh {mesh}; give one (FSDP) or two "
            "(HSDP: replicate axis, then shard axis).",
            mesh=mesh,
        )
    used: dict[str, str] = {}
    for param in resolution.params:
        for axis in param.spec.axes:
            used.setdefault(axis, param.fqn)
    for axis in data:
        if axis in used:
            raise PlanError(
                f"axis '{axis}' is a data axis (fsdp={data!r}) but parameter '{used[axis]}' is "
                f"sharded over it on mesh {mesh}; a data axis splits the batch and cannot also be "
                "a tensor-parallel axis. Use another axis in the spec, or drop it from fsdp.",
                fqn=used[axis],
                mesh=mesh,
            )
    tp_axes = sorted({axis for axis in used if mesh.size(axis) > 1}, key=mesh.axis_names.index)
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
        if size > 1 and axis not in data and axis not in used
    ]
    if idle:
        raise PlanError(
            f"mesh axis '{idle[0]}' (size {mesh.size(idle[0])}) of mesh {mesh} is neither a data "
            f"axis (fsdp={data!r}) nor used by any parameter spec, so its ranks would repeat the "
            f"same work. Add it to fsdp (e.g. Rules(..., fsdp='{idle[0]}')) or shard parameters over it.",
            mesh=mesh,
        )
    return data, (tp_axes[0] if tp_axes else None)


def infer_styles(
    model: nn.Module, specs: dict[str, P], tp_axis: str | None, loss_parallel: bool
) -> tuple[ModuleStyle, ...]:
    """Tensor-parallel style per module, read off the module's parameter specs."""
    if tp_axis is None:
        return ()
    raw: dict[str, ModuleStyle] = {}
    for fqn, module in model.named_modules():
        own = {
            name: specs[f"{fqn}.{name}" if fqn else name]
            for name, _ in module.named_parameters(recurse=False)
            if (f"{fqn}.{name}" if fqn else name) in specs
        }
        if not any(tp_axis in spec.axes for spec in own.values()):
            continue
        raw[fqn] = _style_of(fqn, module, own, tp_axis)
    return _resolve_pairs(raw, loss_parallel)


def _style_of(fqn: str, module: nn.Module, own: dict[str, P], axis: str) -> ModuleStyle:
    kind = type(module).__name__
    weight = own.get("weight", P())
    bias = own.get("bias")
    col, row = P(axis).padded(2), P(None, axis)
    if isinstance(module, nn.Linear):
        if weight.padded(2) == col and (bias is None or bias.padded(1) == P(axis)):
            return ModuleStyle(fqn, kind, "colwise", axis)
        if weight.padded(2) == row and (bias is None or bias.padded(1) == P(None)):
            return ModuleStyle(fqn, kind, "rowwise", axis)
        raise PlanError(
            f"Linear '{fqn}' has weight {weight!r} and bias {bias!r} on axis '{axis}': tensor "
            f"parallelism lowers P('{axis}', None) (column-wise, bias P('{axis}')) or "
            f"P(None, '{axis}') (row-wise, bias replicated). Change the rule for '{fqn}.weight'.",
            fqn=f"{fqn}.weight",
            spec=weight,
        )
    if isinstance(module, nn.Embedding):
        if weight.padded(2) == col:
            return ModuleStyle(fqn, kind, "vocab_parallel_embedding", axis)
        if weight.padded(2) == row:
            return ModuleStyle(
                fqn, kind, "embedding_dim_parallel", axis, "output all-gathered to replicated"
            )
    sharded = {name: spec for name, spec in own.items() if axis in spec.axes}
    name, spec = next(iter(sharded.items()))
    hint = (
        " Norm weights stay replicated (P()) unless sequence parallelism shards the activations."
        if "norm" in kind.lower()
        else " Replicate it (P()), or shard a Linear/Embedding instead."
    )
    raise PlanError(
        f"parameter '{fqn + '.' if fqn else ''}{name}' of {kind} '{fqn}' is sharded as {spec!r} over "
        f"tensor-parallel axis '{axis}', but no parallel style covers {kind} with that spec.{hint}",
        fqn=f"{fqn}.{name}" if fqn else name,
        spec=spec,
    )


def _resolve_pairs(raw: dict[str, ModuleStyle], loss_parallel: bool) -> tuple[ModuleStyle, ...]:
    """Pair column- and row-wise modules under the same parent (attention, MLP).

    A paired column-wise module hands its local output to the row-wise one. An unpaired one has
    its output all-gathered, except the last (the output head) under ``loss_parallel``, which keeps
    vocab-sharded logits. An unpaired row-wise module takes a replicated input and slices it.
    """

    def parent(fqn: str) -> str:
        return fqn.rpartition(".")[0]

    parents = {
        kind: {parent(f) for f, s in raw.items() if s.style == kind}
        for kind in ("colwise", "rowwise")
    }
    unpaired = [
        f for f, s in raw.items() if s.style == "colwise" and parent(f) not in parents["rowwise"]
    ]
    head = unpaired[-1] if unpaired and loss_parallel else None
    styles = []
    for fqn, style in raw.items():
        if fqn == head:
            style = replace(
                style,
                style="loss_parallel_head",
                note="logits stay vocab-sharded; compute the loss under plan.loss_parallel()",
            )
        elif fqn in unpaired:
            style = replace(
                style,
                style="colwise_gathered",
                note="no row-wise consumer: output all-gathered (extra collective)",
            )
        elif style.style == "rowwise" and parent(fqn) not in parents["colwise"]:
            style = replace(
                style,
                style="rowwise_replicated_input",
                note="no column-wise producer: replicated input sliced locally",
            )
        styles.append(style)
    return tuple(styles)


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
    resolution: Resolution, shard_axes: Sequence[str], options: PlanOptions
) -> tuple[ParamLayout, ...]:
    """Per-parameter compute layout and FSDP shard shape (dim 0 split over ``shard_axes``, padded)."""
    mesh = resolution.mesh
    ways = math.prod(mesh.size(axis) for axis in shard_axes) if options.zero >= 1 else 1
    layouts = []
    for param in resolution.params:
        local = local_shape(param.spec, param.shape, mesh)
        shard = (-(-local[0] // ways), *local[1:]) if local else local
        layouts.append(
            ParamLayout(
                param.fqn, param.shape, param.spec, param.source, local, shard, _ELEMENT_BYTES
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
