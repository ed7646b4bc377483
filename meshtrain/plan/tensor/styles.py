"""Tensor-parallel styles: how each module lowers, read off its parameters' specs — pure.

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

import inspect
import re
from collections.abc import Sequence
from dataclasses import replace

from torch import nn

from meshtrain.errors import PlanError
from meshtrain.plan.experts.axis import is_experts_module
from meshtrain.plan.experts.tensor import expert_tensor_style
from meshtrain.plan.ir import ModuleStyle, TPStyle
from meshtrain.plan.layers import is_linear_like, is_transposed_linear, linear_widths, tied_groups
from meshtrain.plan.tensor.pairs import Pair, find_pairs, untouched_consumers
from meshtrain.spec.partition import P
from meshtrain.spec.rules import Resolution


def infer_styles(
    model: nn.Module,
    resolution: Resolution,
    tp_axis: str | None,
    loss_parallel: bool,
    sequence_parallel: bool = False,
) -> tuple[ModuleStyle, ...]:
    """Tensor-parallel style per module, read off the module's parameter specs.

    A tied parameter (one tensor under two names) takes its first name's spec under both, so a
    head tied to a vocab-parallel embedding is a vocab-parallel head; a module that merely holds
    a parameter a Linear or Embedding uses (BERT's ``cls.predictions.bias``) takes no style.
    Under ``sequence_parallel`` norms outside the tensor-parallel pairs run on sequence shards, the
    pairs' inputs are all-gathered from sequence shards and the row-wise outputs are
    reduce-scattered back to them. A column-wise module whose FQN fully matches one of
    ``resolution.gathered`` (``Rules.gathered``: Hugging Face's ``colwise_gather_output``) has
    its output all-gathered and pairs with nothing, except the output head, whose logits the
    loss reads whole either way.
    """
    if tp_axis is None:
        return ()
    specs = dict(resolution.specs)
    for group in tied_groups(model):
        for alias in group[1:]:
            if group[0] in specs:
                specs[alias] = specs[group[0]]
    modules = dict(model.named_modules())
    used_by_layers = {
        id(param)
        for module in modules.values()
        if _is_layer(module)
        for param in module.parameters(recurse=False)
    }
    raw: dict[str, ModuleStyle] = {}
    for fqn, module in modules.items():
        own = {
            name: specs[f"{fqn}.{name}" if fqn else name]
            for name, param in module.named_parameters(recurse=False, remove_duplicate=False)
            if (f"{fqn}.{name}" if fqn else name) in specs
            and (_is_layer(module) or id(param) not in used_by_layers)
        }
        if not any(tp_axis in spec.axes for spec in own.values()):
            continue
        raw[fqn] = _style_of(fqn, module, own, tp_axis, resolution.mesh.size(tp_axis))
    raw = _mark_gathered(raw, modules, resolution.gathered)
    whole = expert_blocks(modules) if sequence_parallel else ()
    inner = {fqn: style for fqn, style in raw.items() if inside(fqn, whole)}
    outer = {fqn: style for fqn, style in raw.items() if fqn not in inner}
    styles = _resolve_pairs(outer, modules, loss_parallel, sequence_parallel)
    styles += [s for s in _resolve_pairs(inner, modules, False, False) if s.fqn not in whole]
    _check_heads(styles, modules, resolution.mesh.size(tp_axis))
    if sequence_parallel:
        styles += [_gathered_block(fqn, modules[fqn], tp_axis) for fqn in whole]
        styles = _add_sequence_styles(styles, modules, tp_axis)
    order = {fqn: index for index, fqn in enumerate(modules)}
    return tuple(sorted(styles, key=lambda style: order[style.fqn]))


_GATHERED_NOTE = "output all-gathered: the model's code needs the full features"


def expert_blocks(modules: dict[str, nn.Module]) -> tuple[str, ...]:
    """The modules that hold an experts module directly (a MoE feed-forward: its router, its
    experts and any shared expert), in module order. Under sequence parallelism each runs on the
    whole sequence (:attr:`TPStyle.SEQUENCE_GATHERED`): routing, the experts' dispatch and the
    balance statistics are those of the tensor-parallel plan without sequence parallelism.

    Example:
        >>> import torch
        >>> experts = nn.Module()
        >>> experts.num_experts = 2
        >>> experts.gate_up_proj = nn.Parameter(torch.ones(2, 4, 2))
        >>> block = nn.ModuleDict({"mlp": nn.ModuleDict({"experts": experts})})
        >>> expert_blocks(dict(block.named_modules()))
        ('mlp',)
    """
    found = [_parent(fqn) for fqn, module in modules.items() if fqn and is_experts_module(module)]
    return tuple(dict.fromkeys(block for block in found if block))


def inside(fqn: str, blocks: Sequence[str]) -> bool:
    """Whether ``fqn`` is one of ``blocks`` or inside one.

    Example:
        >>> inside("layers.1.mlp.gate", ("layers.1.mlp",)), inside("layers.1.norm", ("layers.1.mlp",))
        (True, False)
    """
    return any(fqn == block or fqn.startswith(block + ".") for block in blocks)


def _gathered_block(fqn: str, module: nn.Module, axis: str) -> ModuleStyle:
    return ModuleStyle(
        fqn,
        type(module).__name__,
        TPStyle.SEQUENCE_GATHERED,
        axis,
        "input all-gathered from sequence shards, output sliced back: routing and experts run "
        "on the whole sequence, as without sequence parallelism",
        activation_argument(module),
    )


def _mark_gathered(
    raw: dict[str, ModuleStyle], modules: dict[str, nn.Module], gathered: Sequence[str]
) -> dict[str, ModuleStyle]:
    """Column-wise modules the rules ask gathered (not the output head) become
    ``colwise_gathered`` before pairing, so their row-wise partner slices a replicated input."""
    with_params = [f for f, m in modules.items() if any(True for _ in m.parameters(recurse=False))]
    head = with_params[-1] if with_params else None
    marked = dict(raw)
    for fqn, style in raw.items():
        if (
            style.style == TPStyle.COLWISE
            and fqn != head
            and any(re.fullmatch(pattern, fqn) for pattern in gathered)
        ):
            marked[fqn] = replace(style, style=TPStyle.COLWISE_GATHERED, note=_GATHERED_NOTE)
    return marked


def _is_layer(module: nn.Module) -> bool:
    return is_linear_like(module) or isinstance(module, nn.Embedding)


def _style_of(
    fqn: str, module: nn.Module, own: dict[str, P], axis: str, ways: int = 1
) -> ModuleStyle:
    kind = type(module).__name__
    if is_experts_module(module):
        return expert_tensor_style(fqn, module, own, axis, ways)
    weight = own.get("weight", P())
    bias = own.get("bias")
    col, row = P(axis).padded(2), P(None, axis)
    if is_transposed_linear(module):  # weight [in, out]: column-wise shards dim 1
        col, row = row, col
    if is_linear_like(module):
        if weight.padded(2) == col and (bias is None or bias.padded(1) == P(axis)):
            return ModuleStyle(fqn, kind, TPStyle.COLWISE, axis)
        if weight.padded(2) == row and (bias is None or bias.padded(1) == P(None)):
            return ModuleStyle(fqn, kind, TPStyle.ROWWISE, axis)
        raise PlanError(
            f"{kind} '{fqn}' has weight {weight!r} and bias {bias!r} on axis '{axis}': tensor "
            f"parallelism lowers {col!r} (column-wise, bias P('{axis}')) or {row!r} (row-wise, "
            f"bias replicated){' — its weight is stored [in, out]' if kind == 'Conv1D' else ''}. "
            f"Change the rule for '{fqn}.weight'.",
            fqn=f"{fqn}.weight",
            spec=weight,
        )
    if isinstance(module, nn.Embedding):
        if weight.padded(2) == col:
            return ModuleStyle(fqn, kind, TPStyle.VOCAB_PARALLEL_EMBEDDING, axis)
        if weight.padded(2) == row:
            return ModuleStyle(
                fqn, kind, TPStyle.EMBEDDING_DIM_PARALLEL, axis, "output all-gathered to replicated"
            )
    sharded = {name: spec for name, spec in own.items() if axis in spec.axes}
    name, spec = next(iter(sharded.items()))
    if "norm" in kind.lower():
        hint = (
            " Norm weights stay replicated (P()); for sequence parallelism add the activation "
            f"rule ('seq', '{axis}'): norms then run on sequence shards with their weights "
            "replicated."
        )
    elif isinstance(module, nn.modules.conv._ConvNd):
        hint = (
            " Convolutions are not tensor-parallel in meshtrain (their output channels would "
            "need a gather per layer, which costs more than the layer saves on the small "
            "channel counts of CNNs): Replicate it (P()) and train CNNs with data parallelism."
        )
    else:
        hint = " Replicate it (P()), or shard a Linear/Embedding instead."
    raise PlanError(
        f"parameter '{fqn + '.' if fqn else ''}{name}' of {kind} '{fqn}' is sharded as {spec!r} over "
        f"tensor-parallel axis '{axis}', but no parallel style covers {kind} with that spec.{hint}",
        fqn=f"{fqn}.{name}" if fqn else name,
        spec=spec,
    )


def _resolve_pairs(
    raw: dict[str, ModuleStyle],
    modules: dict[str, nn.Module],
    loss_parallel: bool,
    sequence_parallel: bool,
) -> list[ModuleStyle]:
    """Styles from the pairs (:mod:`meshtrain.plan.tensor.pairs`): a paired column-wise module keeps its
    output sharded for the row-wise one, and the pair's prepare point marks their shared input
    once (one backward all-reduce, or under sequence parallelism one all-gather forward and one
    reduce-scatter backward, per pair). An unpaired column-wise module has its output
    all-gathered, except the output head (the model's last module with parameters) under
    ``loss_parallel``, which keeps vocab-sharded logits. An unpaired row-wise module takes a
    replicated input and slices it."""
    pairs, unpaired = find_pairs(raw, modules)
    paired_rowwise = {fqn for pair in pairs for fqn in pair.rowwise}
    # The output head: an unpaired column-wise Linear that is the model's last module with
    # parameters (registration order), i.e. nothing after it could consume sharded logits.
    with_params = [f for f, m in modules.items() if any(True for _ in m.parameters(recurse=False))]
    head = unpaired[-1] if unpaired and with_params and unpaired[-1] == with_params[-1] else None
    styles = []
    for fqn, style in raw.items():
        if fqn == head and loss_parallel:
            style = replace(
                style,
                style=TPStyle.LOSS_PARALLEL_HEAD,
                note="logits stay vocab-sharded under mt.loss_parallel(plan), gathered outside it",
            )
        elif fqn in unpaired:
            style = replace(
                style,
                style=TPStyle.COLWISE_GATHERED,
                note="no row-wise consumer: output all-gathered (extra collective)",
            )
        elif style.style == TPStyle.ROWWISE and fqn not in paired_rowwise:
            style = replace(
                style,
                style=TPStyle.ROWWISE_REPLICATED_INPUT,
                note="no column-wise producer: replicated input sliced locally",
            )
        if sequence_parallel:
            style = _sequence_variant(style, is_head=fqn == head)
        styles.append(style)
    return styles + _prepare_styles(pairs, modules, raw, sequence_parallel)


def _prepare_styles(
    pairs: tuple[Pair, ...],
    modules: dict[str, nn.Module],
    raw: dict[str, ModuleStyle],
    sequence_parallel: bool,
) -> list[ModuleStyle]:
    """A ``prepare_input`` style at each pair's prepare point (none where each column-wise
    module marks its own input, which sequence parallelism cannot do)."""
    axis = next(iter(raw.values())).axis if raw else ""
    styles = []
    for pair in pairs:
        if pair.prepare is None:
            if sequence_parallel:
                raise _mixed_under_sequence_parallelism(pair, modules, raw, axis)
            continue
        note = (
            "first input all-gathered from sequence shards for the column-wise children"
            if sequence_parallel
            else "first input marked replicated once for all column-wise children"
        )
        module = modules[pair.prepare]
        styles.append(
            ModuleStyle(
                pair.prepare,
                type(module).__name__,
                TPStyle.PREPARE_INPUT,
                axis,
                note,
                activation_argument(module),
            )
        )
    return styles


def _mixed_under_sequence_parallelism(
    pair: Pair, modules: dict[str, nn.Module], raw: dict[str, ModuleStyle], axis: str
) -> PlanError:
    """The scope's input also reaches what is not in the pair: no single all-gather point."""
    other = untouched_consumers(pair.scope, modules, raw)[0]
    module = modules.get(other)
    if module is None:  # a parameter of the scope itself
        what = "a parameter of it"
        fix = (
            f"Move '{other}' into a module of its own (its gradient is then reduced as a "
            "partial one where it meets the shards), or drop the ('seq', ...) activation rule"
        )
    elif _is_norm(module):
        what = type(module).__name__
        fix = (
            "A norm as wide as the input stays replicated there: train this model without "
            "sequence parallelism (drop sequence_parallel=True / the ('seq', ...) activation "
            "rule)"
        )
    else:
        what = type(module).__name__
        fix = (
            f"Shard it too (column-wise P('{axis}') or row-wise P(None, '{axis}')), or drop "
            "the ('seq', ...) activation rule"
        )
    return PlanError(
        f"sequence parallelism all-gathers the input of '{pair.scope}' "
        f"({type(modules[pair.scope]).__name__}) for its tensor-parallel Linears, but {other!r} "
        f"({what}) there is not tensor-parallel and could read that input, which would see a "
        f"different sequence length. {fix}.",
        fqn=other,
    )


def activation_argument(module: nn.Module) -> str:
    """The name of the forward parameter a module takes its activation in: the first one
    (``hidden_states`` in Hugging Face attention, ``x`` in meshtrain's Llama), or ``""`` when the
    forward takes ``*args``.

    Example:
        >>> activation_argument(nn.Linear(2, 2))
        'input'
    """
    try:
        parameters = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):  # builtins without a signature
        return ""
    if not parameters or parameters[0].kind in (
        inspect.Parameter.VAR_POSITIONAL,
        inspect.Parameter.VAR_KEYWORD,
    ):
        return ""
    return parameters[0].name


def _sequence_variant(style: ModuleStyle, *, is_head: bool) -> ModuleStyle:
    """The style's behaviour on sequence-sharded activations, or a PlanError if it has none."""
    if style.style == TPStyle.ROWWISE:
        return replace(style, note="output reduce-scattered to sequence shards")
    if style.style == TPStyle.VOCAB_PARALLEL_EMBEDDING:
        return replace(style, note="output reduce-scattered to sequence shards")
    if is_head:
        return replace(style, note=f"{style.note}; input all-gathered from sequence shards")
    if style.style == TPStyle.COLWISE:
        return style
    if style.style == TPStyle.COLWISE_GATHERED and style.note == _GATHERED_NOTE:
        raise PlanError(
            f"module '{style.fqn}' ({style.module_type}) is gathered (the rules' gathered, from "
            "the model's colwise_gather_output: the code after it needs all its features, as "
            "OLMo2's q/k norms do), which has no sequence-parallel form in meshtrain. Train this "
            "model without sequence parallelism (drop sequence_parallel=True / the ('seq', ...) "
            "activation rule).",
            fqn=f"{style.fqn}.weight",
        )
    raise PlanError(
        f"module '{style.fqn}' ({style.module_type}) lowers to '{style.style}', which has no "
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
    pair_parents = {
        s.fqn for s in styles if s.style in (TPStyle.PREPARE_INPUT, TPStyle.SEQUENCE_GATHERED)
    }
    embeddings = [f for f, m in modules.items() if isinstance(m, nn.Embedding)]
    if not embeddings:
        raise PlanError(
            "sequence parallelism needs the model to start from an nn.Embedding (its output is "
            f"where activations become sequence shards); {type(modules['']).__name__} has none. "
            "Drop the ('seq', ...) activation rule."
        )
    extra = []
    if not any(s.style in (TPStyle.LOSS_PARALLEL_HEAD, TPStyle.COLWISE_GATHERED) for s in styles):
        extra.append(_tail_style(modules, axis, styled))
        pair_parents.add(extra[0].fqn)  # the tail runs on whole activations
    for fqn in embeddings:
        if fqn not in styled:
            extra.append(
                ModuleStyle(
                    fqn,
                    "Embedding",
                    TPStyle.SEQUENCE_SPLIT,
                    axis,
                    "replicated output sliced into sequence shards (no collective)",
                )
            )
    styled |= {style.fqn for style in extra}
    styled_params = {id(p) for f in styled for p in modules[f].parameters(recurse=False)}
    for fqn, module in modules.items():
        inside_pair = any(fqn.startswith(parent + ".") for parent in pair_parents if parent)
        own = [p for p in module.parameters(recurse=False) if id(p) not in styled_params]
        if fqn in styled or inside_pair or not own:
            continue  # inside attention/MLP: runs on replicated, head-sharded activations
        if not _is_norm(module):
            _check_on_shards(fqn, module, modules, axis)
        extra.append(
            ModuleStyle(
                fqn,
                type(module).__name__,
                TPStyle.SEQUENCE_PARALLEL,
                axis,
                "runs on sequence shards; weight replicated, its partial gradients summed",
            )
        )
    return styles + extra


def _tail_style(modules: dict[str, nn.Module], axis: str, styled: set[str]) -> ModuleStyle:
    """Without a column-wise head, the sequence is gathered at the model's *tail*: the highest
    module (below the root, holding no repeated blocks and no style) around the last module with
    parameters — a classification head (RoBERTa's ``classifier`` on the first token), a
    replicated LM head. It runs on the whole sequence, as every rank's copy of it."""
    holders = [
        f
        for f, m in modules.items()
        if f and not isinstance(m, nn.Embedding) and any(True for _ in m.parameters(recurse=False))
    ]
    last = holders[-1] if holders else ""
    tail = ""
    for fqn in [*_ancestors(last)[::-1], last] if last else []:
        module = modules[fqn]
        blocks = any(isinstance(m, (nn.ModuleList, nn.ModuleDict)) for m in module.modules())
        if not blocks and not any(inside(s, (fqn,)) for s in styled):
            tail = fqn
            break
    if not tail:
        raise PlanError(
            "sequence parallelism needs the sequence gathered before the model's output: by a "
            "column-wise output head (its weight sharded on dim 0, e.g. P('" + axis + "') on the "
            "vocab), or at the model's last module with parameters outside its blocks, which "
            f"{type(modules['']).__name__} does not have apart from tensor-parallel ones. Shard the "
            "head's weight over the tensor-parallel axis, or drop the ('seq', ...) activation rule."
        )
    return ModuleStyle(
        tail,
        type(modules[tail]).__name__,
        TPStyle.SEQUENCE_GATHERED_TAIL,
        axis,
        "input all-gathered from sequence shards: the model's tail runs on the whole sequence",
        activation_argument(modules[tail]),
    )


def _check_on_shards(fqn: str, module: nn.Module, modules: dict[str, nn.Module], axis: str) -> None:
    """A replicated module with parameters computes on sequence shards under sequence
    parallelism: a per-token one (a norm, a Linear after the blocks) is fine, its weight's
    partial gradients summed over the shards; inside a repeated block it may be attention over a
    shard of the sequence (silently wrong), so it is refused; only per-token module types pass
    elsewhere."""
    if not isinstance(module, (nn.Linear, nn.Embedding)) and not is_linear_like(module):
        raise PlanError(
            f"'{fqn}' ({type(module).__name__}) is not tensor-parallel, so under sequence "
            "parallelism it would compute on one shard of the sequence; meshtrain runs norms and "
            "Linears there (per token), not other modules. Drop the ('seq', ...) activation "
            "rule.",
            fqn=fqn,
        )
    in_block = any(
        isinstance(modules.get(prefix), (nn.ModuleList, nn.ModuleDict))
        for prefix in _ancestors(fqn)
    )
    if in_block:
        raise PlanError(
            f"'{fqn}' ({type(module).__name__}) inside a repeated block is not tensor-parallel, so "
            "under sequence parallelism it would compute on one shard of the sequence (attention "
            f"over part of it, silently wrong). Shard it with its partners over '{axis}' "
            "(column-wise, then row-wise), or drop the ('seq', ...) activation rule.",
            fqn=fqn,
        )


def _ancestors(fqn: str) -> list[str]:
    parts = fqn.split(".")
    return [".".join(parts[:end]) for end in range(len(parts) - 1, 0, -1)]


def _parent(fqn: str) -> str:
    return fqn.rpartition(".")[0]


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or type(module).__name__.endswith("Norm")


def _check_heads(styles: list[ModuleStyle], modules: dict[str, nn.Module], ways: int) -> None:
    """Whole attention heads per rank: a parent with an integer ``head_dim`` attribute (Llama's
    ``Attention``; ``attention_head_size`` in BERT) must see its column-wise outputs and row-wise inputs split at head boundaries."""
    for style in styles:
        parent = modules.get(_parent(style.fqn)) if style.fqn else None
        head_dim = getattr(parent, "head_dim", None) or getattr(parent, "attention_head_size", None)
        widths = linear_widths(modules[style.fqn])
        if not isinstance(head_dim, int) or widths is None:
            continue
        if style.style in (TPStyle.COLWISE, TPStyle.COLWISE_GATHERED, TPStyle.LOSS_PARALLEL_HEAD):
            width = widths[1]
        elif style.style in (TPStyle.ROWWISE, TPStyle.ROWWISE_REPLICATED_INPUT):
            width = widths[0]
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
