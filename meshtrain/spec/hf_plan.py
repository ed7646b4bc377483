"""Rules from a Hugging Face model's own tensor-parallel plan (``mt.Rules.from_hf``).

``transformers`` models declare how their modules split: ``config.base_model_tp_plan`` (module
patterns under the base model, ``*`` for a layer index) and the top model's ``_tp_plan`` (the
head and, in recent versions, everything with its prefix). Each entry names a module and a style;
this module turns them into partition specs on the module's parameters, and tells the planner
which column-wise outputs the model's own code needs whole (``gathered``). Every style
``transformers`` declares has a row in :data:`HF_STYLES`: lowered as ``transformers`` lowers it,
or refused with a :class:`RuleError` naming the style, the module and what to write instead
(the table is printed in ``docs/bring-your-own-model.md``). A style not in the table (a newer
``transformers``) is refused the same way. Reads only the dicts the model carries; it never
imports ``transformers``.

Example:
    >>> class Config:
    ...     base_model_tp_plan = {"layers.*.up": "colwise", "layers.*.down": "rowwise"}
    >>> class Block(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.up, self.down = nn.Linear(4, 8), nn.Linear(8, 4)
    >>> class Tiny(nn.Module):
    ...     base_model_prefix, config = "", Config()
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.layers = nn.ModuleList([Block()])
    >>> [(pattern, spec) for pattern, spec in hf_patterns(Tiny(), "tp")][:2]
    [('layers\\\\.\\\\d+\\\\.up\\\\.weight', P('tp', None)), ('layers\\\\.\\\\d+\\\\.up\\\\.bias', P('tp'))]
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from torch import nn

from meshtrain.errors import RuleError
from meshtrain.spec.partition import P


@dataclass(frozen=True)
class HFStyle:
    """How meshtrain takes one ``transformers`` TP style.

    ``kind`` is ``colwise`` (weight ``P(tp, None)``, bias ``P(tp)``; paired with a row-wise
    partner by the planner), ``gathered`` (the same specs, the output all-gathered to full
    features: never paired), ``rowwise`` (weight ``P(None, tp)``, bias ``P()``), ``vocab``
    (an embedding sharded on the vocabulary), ``embedding_dim`` (an embedding sharded on its
    width, output gathered), ``replicated`` (every parameter ``P()``) or ``refused``.
    ``lowering`` says what meshtrain does (a row of the docs' table); a refused style's
    ``lowering`` says why and what to write instead.

    Example:
        >>> HF_STYLES["colwise_gather_output"].kind
        'gathered'
    """

    kind: str
    lowering: str


_OVERRIDE = "replicate the module with `Rules.from_hf(model, overrides={pattern: P()})`"
HF_STYLES: Mapping[str, HFStyle] = {
    "colwise": HFStyle(
        "colwise",
        "`colwise`, output kept sharded for its row-wise partner "
        "(`prepare_input` once per pair); unpaired: `colwise_gathered`",
    ),
    "colwise_rep": HFStyle(
        "gathered",
        "`colwise_gathered`: output all-gathered to full "
        "features, its row-wise partner slices a replicated input",
    ),
    "colwise_gather_output": HFStyle(
        "gathered",
        "`colwise_gathered`: output all-gathered to "
        "full features (OLMo2's q/k/v before their full-width "
        "norms); the partner is `rowwise_replicated_input`",
    ),
    "local_colwise": HFStyle(
        "colwise", "as `colwise` (older transformers: the same math on local tensors)"
    ),
    "rowwise": HFStyle(
        "rowwise",
        "`rowwise` (partial sums all-reduced); on an `nn.Embedding` "
        "(older plans) `vocab_parallel_embedding`",
    ),
    "rowwise_rep": HFStyle(
        "rowwise",
        "`rowwise`, or `rowwise_replicated_input` when its column-wise producer is gathered",
    ),
    "rowwise_split_input": HFStyle(
        "rowwise",
        "`rowwise_replicated_input`: the replicated input sliced locally, partial sums all-reduced",
    ),
    "embedding_rowwise": HFStyle(
        "vocab", "`vocab_parallel_embedding` (partial lookups all-reduced)"
    ),
    "embedding_colwise": HFStyle("embedding_dim", "`embedding_dim_parallel` (output all-gathered)"),
    "replicated_with_grad_allreduce": HFStyle(
        "replicated",
        "`P()`; the plan's abstract run "
        "finds its gradient partial and all-reduces it "
        "over `tp` (`partial_grads` in `explain()`: "
        "Qwen3's per-head `q_norm`/`k_norm`)",
    ),
    "replicate": HFStyle("replicated", "`P()`"),
    "local": HFStyle("replicated", "`P()` (older transformers)"),
    "sequence_parallel": HFStyle(
        "replicated",
        "`P()`; the norm runs on sequence shards when `Rules.from_hf(..., sequence_parallel=True)`",
    ),
    "local_rowwise": HFStyle(
        "refused",
        f"refused: its partial output is left for a later `gather` to reduce; {_OVERRIDE}",
    ),
    "gather": HFStyle(
        "refused", f"refused: it reduces partial outputs of `local_rowwise` children; {_OVERRIDE}"
    ),
    "all_reduce": HFStyle(
        "refused",
        f"refused: it all-reduces a partial output of modules the plan does not shard; {_OVERRIDE}",
    ),
    "packed_colwise": HFStyle(
        "refused",
        "refused: a fused projection (`gate_up_proj`) needs "
        "each packed half sharded alike (or unfuse it into two Linears); "
        f"{_OVERRIDE}",
    ),
    "packed_rowwise": HFStyle(
        "refused", f"refused: the row-wise partner of a packed projection; {_OVERRIDE}"
    ),
    "mla_kv_a_proj": HFStyle(
        "refused",
        "refused: MLA's split projection (DeepSeek-V2) whose "
        f"rotary half bypasses `kv_b_proj`; {_OVERRIDE}",
    ),
    "local_params": HFStyle(
        "refused", f"refused: a bare parameter sharded by its own entry; {_OVERRIDE}"
    ),
    "moe_tp_experts": HFStyle(
        "refused",
        "refused on a module that is not an experts module (an "
        "int `num_experts`, 3-D weights [experts, ...]); an experts "
        "module's weights split over the expert axis with "
        "`Rules.from_hf(model, ep='ep')`, or stay whole (`P()`, with a "
        f"note) without it; {_OVERRIDE}",
    ),
    "moe_identity_expert": HFStyle("refused", f"refused: part of `moe_tp_experts`; {_OVERRIDE}"),
    "grouped_gemm": HFStyle(
        "refused",
        "refused in a tensor-parallel plan: an expert-parallel "
        "style, read from `base_model_ep_plan` by `Rules.from_hf(model, "
        f"ep='ep')` (expert weights `P(ep, None, None)`); {_OVERRIDE}",
    ),
    "ep_dispatch_experts": HFStyle(
        "refused",
        "refused in a tensor-parallel plan: an "
        "expert-parallel style, read from `base_model_ep_plan` by "
        "`Rules.from_hf(model, ep='ep')` (the module whose tokens "
        f"are dispatched); {_OVERRIDE}",
    ),
}


def hf_tp_plan(model: nn.Module) -> dict[str, str]:
    """The model's tensor-parallel plan as module patterns with full FQNs (``*`` for an index):
    the top model's ``_tp_plan`` and the config's ``base_model_tp_plan`` under the base model's
    prefix. Empty when the model declares none."""
    plan: dict[str, str] = {}
    config = getattr(model, "config", None)
    base = getattr(config, "base_model_tp_plan", None) or {}
    prefix = getattr(model, "base_model_prefix", "") or ""
    has_base = bool(prefix) and isinstance(getattr(model, prefix, None), nn.Module)
    for pattern, style in dict(base).items():
        plan[f"{prefix}.{pattern}" if has_base else pattern] = style
    plan.update(dict(getattr(model, "_tp_plan", None) or {}))
    return plan


def hf_patterns(
    model: nn.Module, axis: str, covered: Sequence[re.Pattern[str]] = ()
) -> list[tuple[str, P]]:
    """Regex rules (full-match on parameter FQNs) for the parameters the plan covers; a module
    whose parameters all match one of ``covered`` (the user's own rules) is left to them."""
    params = {fqn for fqn, _ in model.named_parameters()}
    patterns: list[tuple[str, P]] = []
    for regex, style, matched, module in _entries(model, covered):
        for name, spec in _specs(style, module, axis).items():
            if any(f"{fqn}.{name}" in params for fqn in matched):
                patterns.append((rf"{regex}\.{re.escape(name)}", spec))
    return patterns


def hf_gathered(model: nn.Module, covered: Sequence[re.Pattern[str]] = ()) -> list[str]:
    """Regexes (full-match on module FQNs) of the column-wise modules whose output the plan
    must all-gather (``colwise_gather_output``, ``colwise_rep``): the model's code after them
    needs the full features, e.g. OLMo2's q/k norms over all heads."""
    return [
        regex
        for regex, style, _, module in _entries(model, covered)
        if HF_STYLES[style].kind == "gathered" and not isinstance(module, nn.Embedding)
    ]


def _entries(
    model: nn.Module, covered: Sequence[re.Pattern[str]]
) -> Iterator[tuple[str, str, list[str], nn.Module]]:
    """Each plan entry the user did not cover: its module regex, style, matched module FQNs and
    first module; a refused or unknown style, or an entry naming a parameter, is a RuleError."""
    plan = hf_tp_plan(model)
    if not plan:
        raise RuleError(
            f"{type(model).__name__} declares no tensor-parallel plan (no "
            "config.base_model_tp_plan, no _tp_plan), so Rules.from_hf has nothing to read. "
            "Write the rules: P('tp', None) on the weights (and P('tp') on the biases) of the "
            "Linears that read a block's input (q, k, v, up, gate), P(None, 'tp') on the ones "
            "that write its output (o, down), P('tp', None) on the embedding and the head, "
            "r'.*': P() for the rest."
        )
    modules = dict(model.named_modules())
    params = [fqn for fqn, _ in model.named_parameters()]
    for module_pattern, style in plan.items():
        regex = _plan_regex(module_pattern)
        matched = [fqn for fqn in modules if re.fullmatch(regex, fqn)]
        known = HF_STYLES.get(style)
        refused = known is None or known.kind == "refused"
        # a refused style reaches the whole subtree (all_reduce on a parent of sharded Linears)
        names = [
            f"{fqn}.{name}"
            for fqn in matched
            for name, _ in modules[fqn].named_parameters(recurse=refused)
        ]
        if not matched:
            names = [fqn for fqn in params if re.fullmatch(regex, fqn)]
        if not names or all(any(c.fullmatch(n) for c in covered) for n in names):
            continue
        if not matched:
            _refuse(module_pattern, style, "a parameter, not a module", "its parameter")
        if refused:
            why = known.lowering if known else "a style meshtrain does not know"
            _refuse(module_pattern, style, type(modules[matched[0]]).__name__, why)
        yield regex, style, matched, modules[matched[0]]


def _plan_regex(pattern: str) -> str:
    """The regex of a transformers plan pattern, whose ``*`` stands for a layer index.

    Example:
        >>> _plan_regex("layers.*.mlp")
        'layers\\\\.\\\\d+\\\\.mlp'
    """
    return re.escape(pattern).replace(r"\*", r"\d+")


def _refuse(pattern: str, style: str, kind: str, why: str) -> None:
    replicate = _plan_regex(pattern) + r"(\..*)?"
    reason = why.removeprefix("refused: ").removesuffix(f"; {_OVERRIDE}")
    raise RuleError(
        f"the model's tensor-parallel plan gives '{pattern}' ({kind}) the style {style!r}, which "
        f"meshtrain does not lower: {reason}. Cover its parameters yourself (P() replicates "
        f"them): Rules.from_hf(model, overrides={{{replicate!r}: P()}}).",
        rule=pattern,
    )


def _specs(style: str, module: nn.Module, axis: str) -> Mapping[str, P]:
    kind = HF_STYLES[style].kind
    embedding = isinstance(module, nn.Embedding)
    if kind == "vocab" or (kind == "rowwise" and embedding):
        return {"weight": P(axis, None)}
    if kind == "embedding_dim" or (kind in ("colwise", "gathered") and embedding):
        return {"weight": P(None, axis)}
    if kind in ("colwise", "gathered"):
        return {"weight": P(axis, None), "bias": P(axis)}
    if kind == "rowwise":
        return {"weight": P(None, axis), "bias": P()}
    return {name: P() for name, _ in module.named_parameters(recurse=False)}


#: the expert-parallel styles of ``base_model_ep_plan`` (transformers 5) meshtrain reads
EP_STYLES = ("grouped_gemm", "ep_dispatch_experts")


def hf_ep_plan(model: nn.Module) -> dict[str, str]:
    """The model's expert-parallel plan (``config.base_model_ep_plan`` under the base model's
    prefix, then the top model's ``_ep_plan``) as patterns with full FQNs; empty without one."""
    plan: dict[str, str] = {}
    config = getattr(model, "config", None)
    prefix = getattr(model, "base_model_prefix", "") or ""
    has_base = bool(prefix) and isinstance(getattr(model, prefix, None), nn.Module)
    for pattern, style in dict(getattr(config, "base_model_ep_plan", None) or {}).items():
        plan[f"{prefix}.{pattern}" if has_base else pattern] = style
    plan.update(dict(getattr(model, "_ep_plan", None) or {}))
    return plan


def hf_expert_patterns(
    model: nn.Module, axis: str | None, tp: str | None = None
) -> tuple[list[tuple[str, P]], list[str]]:
    """Rules for the experts modules of the model's plans and notes about them: with ``axis``,
    their weights (``grouped_gemm`` parameters and the experts-dim parameters of
    ``ep_dispatch_experts`` / ``moe_tp_experts`` modules) split over it on dim 0; without it,
    every parameter of those modules whole (``P()``), noted. With ``tp``, the experts modules
    the tensor-parallel plan names ``moe_tp_experts`` are also split inside over it
    (``gate_up_proj`` packed column-wise, ``down_proj`` row-wise:
    :mod:`meshtrain.plan.experts.tensor`). A ``moe_tp_experts`` entry on a module that is not an
    experts module is left for the tensor-parallel plan to refuse.

    Example:
        >>> import torch
        >>> class Experts(nn.Module):
        ...     num_experts = 4
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.down_proj = nn.Parameter(torch.empty(4, 2, 8))
        >>> class Config:
        ...     base_model_ep_plan = {"layers.*.experts": "ep_dispatch_experts"}
        >>> class Tiny(nn.Module):
        ...     base_model_prefix, config = "", Config()
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.layers = nn.ModuleList([nn.ModuleDict({"experts": Experts()})])
        >>> hf_expert_patterns(Tiny(), "ep")[0]
        [('layers\\\\.\\\\d+\\\\.experts\\\\.down_proj', P('ep', None, None))]
    """
    modules = dict(model.named_modules())
    entries = [(p, s) for p, s in hf_ep_plan(model).items() if s in EP_STYLES]
    inside = [p for p, s in hf_tp_plan(model).items() if s == "moe_tp_experts"]
    entries += [(p, "moe_tp_experts") for p in inside]
    split = {
        id(m) for p in inside if tp is not None for m in _experts_matching(modules, _plan_regex(p))
    }
    patterns: dict[str, P] = {}
    found: list[str] = []
    for module_pattern, style in entries:
        regex = _plan_regex(module_pattern)
        if style == "grouped_gemm":
            owner, _, name = module_pattern.rpartition(".")
            experts = _experts_matching(modules, _plan_regex(owner))
            if experts and id(experts[0]) in split and _splits_inside(experts[0]):
                patterns[regex] = _INSIDE[name](axis, tp)
            elif experts and axis is not None:
                patterns[regex] = P(axis, *([None] * (getattr(experts[0], name).ndim - 1)))
            continue
        experts = _experts_matching(modules, regex)
        if not experts:
            continue
        found.append(module_pattern)
        if id(experts[0]) in split and _splits_inside(experts[0]):
            for name, spec_of in _INSIDE.items():
                patterns.setdefault(rf"{regex}\.{name}", spec_of(axis, tp))
            continue
        if axis is None:
            patterns.setdefault(rf"{regex}\..*", P())
            continue
        for name, param in experts[0].named_parameters(recurse=False):
            whole = param.shape[0] != experts[0].num_experts
            spec = P() if whole else P(axis, *([None] * (param.ndim - 1)))
            patterns.setdefault(rf"{regex}\.{re.escape(name)}", spec)
    notes = []
    if found and axis is None and not split:
        notes.append(
            f"experts modules {sorted(set(found))} kept whole (P()) on every rank: split them "
            "over an expert axis with Rules.from_hf(model, ep='ep') on a mesh with an 'ep' axis"
        )
    return list(patterns.items()), notes


#: an experts weight's spec split inside over tensor-parallel ``tp`` (and over expert ``axis``)
_INSIDE = {
    "gate_up_proj": lambda axis, tp: P(axis, tp, None),
    "down_proj": lambda axis, tp: P(axis, None, tp),
}


def _splits_inside(experts: nn.Module) -> bool:
    """Whether an experts module has the layout tensor parallelism splits inside: exactly
    ``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I], not transposed."""
    names = {name for name, _ in experts.named_parameters(recurse=False)}
    return names == {"gate_up_proj", "down_proj"} and not getattr(experts, "is_transposed", False)


def _experts_matching(modules: Mapping[str, nn.Module], regex: str) -> list[nn.Module]:
    """The experts modules (an int ``num_experts`` and a 3-D parameter over that many experts)
    whose FQN matches ``regex``."""
    return [
        module
        for fqn, module in modules.items()
        if re.fullmatch(regex, fqn)
        and isinstance(getattr(module, "num_experts", None), int)
        and any(
            p.ndim == 3 and p.shape[0] == module.num_experts
            for p in module.parameters(recurse=False)
        )
    ]
