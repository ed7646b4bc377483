"""Rules from a Hugging Face model's own tensor-parallel plan (``mt.Rules.from_hf``).

``transformers`` models declare how their modules split: ``config.base_model_tp_plan`` (module
patterns under the base model, ``*`` for a layer index) and the top model's ``_tp_plan`` (the
head and, in recent versions, everything with its prefix). Each entry names a module and a style;
this module turns them into partition specs on the module's parameters:

=========================================================  ========================================
HF style                                                   specs (axis ``tp``)
=========================================================  ========================================
``colwise``, ``colwise_rep``, ``colwise_gather_output``,    weight ``P(tp, None)``, bias ``P(tp)``
``local_colwise``
``rowwise``, ``rowwise_rep``, ``local_rowwise``,            weight ``P(None, tp)``, bias ``P()``
``rowwise_split_input``
``embedding_rowwise``, ``rowwise`` on an ``nn.Embedding``   weight ``P(tp, None)`` (vocab-parallel)
``replicated_with_grad_allreduce``, ``replicate``,          ``P()``
``local``, ``sequence_parallel``, ``gather``
=========================================================  ========================================

Packed, expert and other styles are a :class:`RuleError` naming the module and what to write.
Whether an output is gathered or kept sharded is the planner's to decide from the pairs, so
``colwise_rep`` and ``colwise`` give the same specs. Reads only the dicts the model carries; it
never imports ``transformers``.

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
from collections.abc import Mapping, Sequence

from torch import nn

from meshtrain.errors import RuleError
from meshtrain.spec.partition import P

_COLWISE = {"colwise", "colwise_rep", "colwise_gather_output", "local_colwise"}
_ROWWISE = {"rowwise", "rowwise_rep", "local_rowwise", "rowwise_split_input"}
_VOCAB = {"embedding_rowwise"}
_REPLICATED = {
    "replicated_with_grad_allreduce",
    "replicate",
    "local",
    "sequence_parallel",
    "gather",
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
    params = {fqn for fqn, _ in model.named_parameters()}
    patterns: list[tuple[str, P]] = []
    for module_pattern, style in plan.items():
        regex = re.escape(module_pattern).replace(r"\*", r"\d+")
        matched = [fqn for fqn in modules if re.fullmatch(regex, fqn)]
        names = [
            f"{fqn}.{name}"
            for fqn in matched
            for name, _ in modules[fqn].named_parameters(recurse=False)
        ]
        if not matched or all(any(c.fullmatch(n) for c in covered) for n in names):
            continue
        specs = _specs(module_pattern, style, modules[matched[0]], axis)
        for name, spec in specs.items():
            if any(f"{fqn}.{name}" in params for fqn in matched):
                patterns.append((rf"{regex}\.{re.escape(name)}", spec))
    return patterns


def _specs(pattern: str, style: str, module: nn.Module, axis: str) -> Mapping[str, P]:
    if style in _VOCAB or (style in _ROWWISE and isinstance(module, nn.Embedding)):
        return {"weight": P(axis, None)}
    if style in _COLWISE and isinstance(module, nn.Embedding):
        return {"weight": P(None, axis)}
    if style in _COLWISE:
        return {"weight": P(axis, None), "bias": P(axis)}
    if style in _ROWWISE:
        return {"weight": P(None, axis), "bias": P()}
    if style in _REPLICATED:
        return {name: P() for name, _ in module.named_parameters(recurse=False)}
    replicate = re.escape(pattern).replace(r"\*", r"\d+") + r"\..*"
    raise RuleError(
        f"the model's tensor-parallel plan gives '{pattern}' the style {style!r}, which meshtrain "
        "does not lower (packed, expert and custom styles). Cover its parameters yourself (P() "
        f"replicates them): Rules.from_hf(model, overrides={{{replicate!r}: P()}}).",
        rule=pattern,
    )
