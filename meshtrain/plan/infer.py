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
from collections.abc import Mapping, Sequence
from dataclasses import replace

from torch import nn

from meshtrain.errors import PlanError, format_shape
from meshtrain.plan.ir import FSDPUnit, ModuleStyle, ParamLayout
from meshtrain.plan.options import PlanOptions
from meshtrain.spec.layout import local_shape
from meshtrain.spec.mesh import Mesh
from meshtrain.spec.partition import P
from meshtrain.spec.rules import Resolution, Rules

_ELEMENT_BYTES = 4  # fp32 master parameters


def infer_axes(
    resolution: Resolution, data_axes: Sequence[str], pipeline_axis: str | None = None
) -> tuple[tuple[str, ...], str | None]:
    """The data axes (checked) and the one tensor-parallel axis the specs use (or ``None``).

    Every mesh axis larger than 1 must have a job: a data axis, the pipeline axis, or an axis
    some spec shards over.
    """
    mesh = resolution.mesh
    data = tuple(data_axes)
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
    used: dict[str, str] = {}
    for param in resolution.params:
        for axis in param.spec.axes:
            used.setdefault(axis, param.fqn)
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
        if size > 1 and axis not in data and axis not in used and axis != pipeline_axis
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


def infer_sequence_parallel(
    rules: Rules, mesh: Mesh, data_axes: Sequence[str], tp_axis: str | None
) -> bool:
    """Whether the activation rules shard the sequence dim over the tensor-parallel axis.

    Activations are ``[batch, seq, features]``; a logical rule ``("seq", axis)`` shards dim 1.
    Only the tensor-parallel axis can take it (sequence parallelism); a sequence rule onto a data
    axis or a third axis would be context parallelism, which meshtrain does not lower.
    """
    if not any(name == "seq" for name, _ in rules.logical):
        return False
    axes = [axis for axis in rules.logical_spec(("seq",), mesh).axes if mesh.size(axis) > 1]
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


def infer_styles(
    model: nn.Module,
    resolution: Resolution,
    tp_axis: str | None,
    loss_parallel: bool,
    sequence_parallel: bool = False,
) -> tuple[ModuleStyle, ...]:
    """Tensor-parallel style per module, read off the module's parameter specs.

    Under ``sequence_parallel`` norms outside the tensor-parallel pairs run on sequence shards, the
    pairs' parents all-gather their input from sequence shards and the row-wise outputs are
    reduce-scattered back to them.
    """
    if tp_axis is None:
        return ()
    specs = resolution.specs
    raw: dict[str, ModuleStyle] = {}
    modules = dict(model.named_modules())
    for fqn, module in modules.items():
        own = {
            name: specs[f"{fqn}.{name}" if fqn else name]
            for name, _ in module.named_parameters(recurse=False)
            if (f"{fqn}.{name}" if fqn else name) in specs
        }
        if not any(tp_axis in spec.axes for spec in own.values()):
            continue
        raw[fqn] = _style_of(fqn, module, own, tp_axis)
    styles = _resolve_pairs(raw, modules, loss_parallel, sequence_parallel)
    _check_heads(styles, modules, resolution.mesh.size(tp_axis))
    if sequence_parallel:
        styles = _add_sequence_styles(styles, modules, tp_axis)
    order = {fqn: index for index, fqn in enumerate(modules)}
    return tuple(sorted(styles, key=lambda style: order[style.fqn]))


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
        " Norm weights stay replicated (P()); for sequence parallelism add the activation rule "
        f"('seq', '{axis}'): norms then run on sequence shards with their weights replicated."
        if "norm" in kind.lower()
        else " Replicate it (P()), or shard a Linear/Embedding instead."
    )
    raise PlanError(
        f"parameter '{fqn + '.' if fqn else ''}{name}' of {kind} '{fqn}' is sharded as {spec!r} over "
        f"tensor-parallel axis '{axis}', but no parallel style covers {kind} with that spec.{hint}",
        fqn=f"{fqn}.{name}" if fqn else name,
        spec=spec,
    )


def _parent(fqn: str) -> str:
    return fqn.rpartition(".")[0]


def _resolve_pairs(
    raw: dict[str, ModuleStyle],
    modules: dict[str, nn.Module],
    loss_parallel: bool,
    sequence_parallel: bool,
) -> list[ModuleStyle]:
    """Pair column- and row-wise modules under the same parent (attention, MLP).

    A row-wise Linear pairs with the column-wise Linears beside it under its parent, directly or
    inside a projection group (a module whose parameters are all column-wise, e.g. a ``qkv``
    module holding ``wq``/``wk``/``wv``). A paired column-wise module hands its local output to
    the row-wise one, and the parent marks its first input once for all its column-wise
    descendants (one backward all-reduce, or under sequence parallelism one all-gather forward and
    one reduce-scatter backward, per parent). An unpaired column-wise module has its output
    all-gathered, except the output head (the model's last module with parameters) under
    ``loss_parallel``, which keeps vocab-sharded logits. An unpaired row-wise module takes a
    replicated input and slices it.
    """
    rowwise_parents = {_parent(f) for f, s in raw.items() if s.style == "rowwise"}
    scopes = {
        fqn: _pair_scope(fqn, rowwise_parents, modules, raw)
        for fqn, style in raw.items()
        if style.style == "colwise"
    }
    paired = rowwise_parents & set(scopes.values())
    unpaired = [f for f, scope in scopes.items() if scope not in paired]
    # The output head: an unpaired column-wise Linear that is the model's last module with
    # parameters (registration order), i.e. nothing after it could consume sharded logits.
    with_params = [f for f, m in modules.items() if any(True for _ in m.parameters(recurse=False))]
    head = unpaired[-1] if unpaired and with_params and unpaired[-1] == with_params[-1] else None
    styles = []
    for fqn, style in raw.items():
        if fqn == head and loss_parallel:
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
        elif style.style == "rowwise" and _parent(fqn) not in paired:
            style = replace(
                style,
                style="rowwise_replicated_input",
                note="no column-wise producer: replicated input sliced locally",
            )
        if sequence_parallel:
            style = _sequence_variant(style, is_head=fqn == head)
        styles.append(style)
    axis = next(iter(raw.values())).axis if raw else ""
    for fqn in sorted(paired, key=list(modules).index):
        others = _untouched_consumers(fqn, modules, raw)
        if others and sequence_parallel:
            raise PlanError(
                f"sequence parallelism all-gathers the input of '{fqn}' "
                f"({type(modules[fqn]).__name__}) for its tensor-parallel Linears, but "
                f"{others[0]!r} there is not tensor-parallel and would see a different sequence "
                f"length. Shard it too (column-wise P('{axis}') or row-wise P(None, '{axis}')), "
                "or drop the ('seq', ...) activation rule.",
                fqn=others[0],
            )
        if others:  # mixed parent: each column-wise child marks its own (plain) input
            continue
        note = (
            "first input all-gathered from sequence shards for the column-wise children"
            if sequence_parallel
            else "first input marked replicated once for all column-wise children"
        )
        styles.append(ModuleStyle(fqn, type(modules[fqn]).__name__, "prepare_input", axis, note))
    return styles


def _pair_scope(
    fqn: str, rowwise_parents: set[str], modules: dict[str, nn.Module], raw: dict[str, ModuleStyle]
) -> str:
    """The parent a column-wise module pairs under: its own parent, or the first ancestor above
    a chain of projection groups (modules whose parameters are all column-wise)."""
    scope = _parent(fqn)
    while scope and scope not in rowwise_parents and _is_projection_group(scope, modules, raw):
        scope = _parent(scope)
    return scope


def _is_projection_group(
    fqn: str, modules: dict[str, nn.Module], raw: dict[str, ModuleStyle]
) -> bool:
    """Every module under ``fqn`` that holds parameters is column-wise (and there is one)."""
    holders = [
        name
        for name, module in modules[fqn].named_modules(prefix=fqn)
        if any(True for _ in module.parameters(recurse=False))
    ]
    return bool(holders) and all(name in raw and raw[name].style == "colwise" for name in holders)


def _untouched_consumers(
    parent: str, modules: dict[str, nn.Module], raw: dict[str, ModuleStyle]
) -> list[str]:
    """Parameters of ``parent`` (its own, or of direct children other than projection groups)
    without a tensor-parallel style: they would receive the parent's input as a DTensor if the
    parent marked it."""
    module = modules[parent]
    found = [f"{parent}.{name}" for name, _ in module.named_parameters(recurse=False)]
    for name, child in module.named_children():
        fqn = f"{parent}.{name}" if parent else name
        if (
            fqn not in raw
            and any(True for _ in child.parameters())
            and not _is_projection_group(fqn, modules, raw)
        ):
            found.append(fqn)
    return found


def _sequence_variant(style: ModuleStyle, *, is_head: bool) -> ModuleStyle:
    """The style's behaviour on sequence-sharded activations, or a PlanError if it has none."""
    if style.style == "rowwise":
        return replace(style, note="output reduce-scattered to sequence shards")
    if style.style == "vocab_parallel_embedding":
        return replace(style, note="output reduce-scattered to sequence shards")
    if is_head:
        return replace(style, note=f"{style.note}; input all-gathered from sequence shards")
    if style.style == "colwise":
        return style
    raise PlanError(
        f"module '{style.fqn}' ({style.module_type}) lowers to {style.style!r}, which has no "
        "sequence-parallel form: sequence parallelism needs every tensor-parallel Linear paired "
        "(column-wise then row-wise under one parent), embeddings sharded on vocab or replicated, "
        "and at most one unpaired column-wise Linear, the output head. Change the rule for "
        f"'{style.fqn}.weight', or drop the ('seq', ...) activation rule.",
        fqn=f"{style.fqn}.weight",
    )


def _add_sequence_styles(
    styles: list[ModuleStyle], modules: dict[str, nn.Module], axis: str
) -> list[ModuleStyle]:
    """Norms on sequence shards; a replicated input embedding sliced into them."""
    styled = {style.fqn for style in styles}
    pair_parents = {s.fqn for s in styles if s.style == "prepare_input"}
    embeddings = [f for f, m in modules.items() if isinstance(m, nn.Embedding)]
    if not embeddings:
        raise PlanError(
            "sequence parallelism needs the model to start from an nn.Embedding (its output is "
            f"where activations become sequence shards); {type(modules['']).__name__} has none. "
            "Drop the ('seq', ...) activation rule."
        )
    if not any(s.style in ("loss_parallel_head", "colwise_gathered") for s in styles):
        raise PlanError(
            "sequence parallelism needs a column-wise output head (its weight sharded on dim 0, "
            "e.g. P('" + axis + "') on the vocab) to gather the sequence shards before the loss; "
            f"{type(modules['']).__name__} has none, so its output would stay a sequence shard. "
            "Shard the head's weight over the tensor-parallel axis, or drop the ('seq', ...) "
            "activation rule."
        )
    extra = []
    for fqn in embeddings:
        if fqn not in styled:
            extra.append(
                ModuleStyle(
                    fqn,
                    "Embedding",
                    "sequence_split",
                    axis,
                    "replicated output sliced into sequence shards (no collective)",
                )
            )
    for fqn, module in modules.items():
        if fqn in styled or not _is_norm(module) or not any(True for _ in module.parameters()):
            continue
        if any(fqn.startswith(parent + ".") for parent in pair_parents if parent):
            continue  # inside attention/MLP: runs on replicated, head-sharded activations
        extra.append(
            ModuleStyle(
                fqn,
                type(module).__name__,
                "sequence_parallel",
                axis,
                "runs on sequence shards; weight replicated",
            )
        )
    return styles + extra


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or type(module).__name__.endswith("Norm")


def _check_heads(styles: list[ModuleStyle], modules: dict[str, nn.Module], ways: int) -> None:
    """Whole attention heads per rank: a parent with an integer ``head_dim`` attribute (Llama's
    ``Attention``) must see its column-wise outputs and row-wise inputs split at head boundaries."""
    for style in styles:
        parent = modules.get(_parent(style.fqn)) if style.fqn else None
        head_dim = getattr(parent, "head_dim", None)
        module = modules[style.fqn]
        if not isinstance(head_dim, int) or not isinstance(module, nn.Linear):
            continue
        if style.style in ("colwise", "colwise_gathered", "loss_parallel_head"):
            width = module.out_features
        elif style.style in ("rowwise", "rowwise_replicated_input"):
            width = module.in_features
        else:
            continue
        if width % head_dim:
            continue  # not a per-head projection
        heads = width // head_dim
        if heads % ways:
            raise PlanError(
                f"Linear '{style.fqn}' projects {heads} heads of size {head_dim} ({type(parent).__name__} "
                f"'{_parent(style.fqn)}'), which do not split evenly over tensor-parallel axis "
                f"'{style.axis}' of size {ways}: each rank must hold whole heads. Use a tp size "
                f"that divides {heads}, or a model with a multiple of {ways} heads.",
                fqn=f"{style.fqn}.weight",
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
) -> tuple[ParamLayout, ...]:
    """Per-parameter compute layout and FSDP shard shape (dim 0 split over ``shard_axes``, padded);
    ``element_bytes``: each parameter's dtype size (default 4, fp32 master parameters)."""
    mesh = resolution.mesh
    ways = math.prod(mesh.size(axis) for axis in shard_axes) if options.zero >= 1 else 1
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
