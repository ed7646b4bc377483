"""Rules: from parameter FQNs (or their logical axis names) to partition specs.

Two kinds, usable together:

* **Regex rules** (EasyLM style): an ordered list of ``pattern → P``; each parameter FQN takes the
  spec of the first pattern that *fully* matches it.
* **Logical-axis rules** (Flax Linen / MaxText style): parameters carry one logical name per dim
  (``("vocab", "embed")``, see :mod:`meshtrain.spec.logical`) and an ordered list maps names to
  mesh axes with Flax's priority semantics: rules are taken in order, and a rule assigns its mesh
  axes to the first still-unassigned dim with its logical name, unless one of those axes is already
  used by another dim of the same tensor. Dims no rule assigns stay unsharded. A name may appear
  twice, the second time as a fallback.

A regex match wins over logical names, so a pattern can override one parameter of an annotated
model. There are no silent fallbacks: a parameter no rule covers, a regex rule that matches
nothing, a logical name that no rule mentions and a logical rule naming an axis the mesh lacks are
all :class:`RuleError` (``allow_unmatched`` / ``allow_unused`` opt out of the first two), and a
chosen spec that does not fit the tensor is a :class:`SpecError`.
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from torch import nn

from meshtrain.errors import RuleError, SpecError, did_you_mean, format_shape
from meshtrain.spec.hf_plan import hf_expert_patterns, hf_gathered, hf_patterns
from meshtrain.spec.layout import validate_spec
from meshtrain.spec.logical import LogicalAxes, named_logical_axes
from meshtrain.spec.mesh import Mesh
from meshtrain.spec.partition import Entry, P, entry_axes

#: The mesh axes a logical name maps to: none (replicated), one, or several (major to minor).
AxisTarget = str | tuple[str, ...] | None


@dataclass(frozen=True)
class ParamSpec:
    """The spec one parameter takes, and why.

    ``source`` is ``"regex <pattern>"``, ``"logical"`` or ``"unmatched"``; ``logical`` holds the
    parameter's logical names when it has them.
    """

    fqn: str
    shape: tuple[int, ...]
    spec: P
    source: str
    logical: LogicalAxes | None = None


@dataclass(frozen=True)
class Resolution:
    """Every parameter's spec on one mesh, with a coverage report of which rule chose what.

    Example:
        >>> rules = Rules({r"w": P("tp"), r"b": P()})
        >>> res = rules.resolve({"w": (8, 4), "b": (4,)}, Mesh(("tp",), (2,)))
        >>> res.specs
        {'w': P('tp'), 'b': P()}
    """

    mesh: Mesh
    params: tuple[ParamSpec, ...]
    gathered: tuple[str, ...] = ()  # the rules' gathered column-wise modules (``Rules.gathered``)

    @property
    def specs(self) -> dict[str, P]:
        """FQN → spec, in parameter order."""
        return {param.fqn: param.spec for param in self.params}

    def coverage(self) -> dict[str, list[str]]:
        """Source (rule) → the FQNs it chose the spec of, in rule order of first use."""
        by_source: dict[str, list[str]] = {}
        for param in self.params:
            by_source.setdefault(param.source, []).append(param.fqn)
        return by_source

    def report(self) -> str:
        """A stable, golden-file-friendly text table: one line per parameter."""
        width = max((len(param.fqn) for param in self.params), default=0)
        lines = [f"# specs on mesh {self.mesh}"]
        for param in self.params:
            names = f"  logical={param.logical}" if param.logical else ""
            lines.append(
                f"{param.fqn:<{width}}  {format_shape(param.shape):>14}  {param.spec!r:<28}  "
                f"<- {param.source}{names}"
            )
        return "\n".join(lines) + "\n"

    def to_json(self) -> str:
        """The resolution as JSON (sorted keys, stable across runs)."""
        return json.dumps(
            {
                "mesh": self.mesh.to_json(),
                "params": [
                    {
                        "fqn": param.fqn,
                        "shape": list(param.shape),
                        "spec": param.spec.to_json(),
                        "source": param.source,
                        "logical": list(param.logical) if param.logical else None,
                    }
                    for param in self.params
                ],
            },
            sort_keys=True,
            indent=1,
        )


class Rules:
    """Ordered rules mapping parameters to specs, plus the data axes FSDP shards over.

    ``gathered`` names modules (regexes on their FQNs) whose column-wise output the model's own
    code needs whole: the planner all-gathers it (``colwise_gathered``) instead of pairing the
    module with a row-wise partner. :meth:`from_hf` fills it from ``colwise_gather_output``.

    Example:
        >>> rules = Rules(
        ...     {r"layers\\.\\d+\\.attn\\.wq\\.weight": P("tp", None), r".*": P()},
        ...     logical=[("vocab", "tp"), ("embed", None)],
        ...     fsdp="dp",
        ... )
        >>> rules.patterns[0]
        ('layers\\\\.\\\\d+\\\\.attn\\\\.wq\\\\.weight', P('tp', None))
    """

    def __init__(
        self,
        patterns: Mapping[str, P] | Sequence[tuple[str, P]] = (),
        *,
        logical: Sequence[tuple[str, AxisTarget]] = (),
        fsdp: str | Sequence[str] | None = None,
        allow_unmatched: bool = False,
        allow_unused: bool = False,
        gathered: Sequence[str] = (),
        generated: Sequence[str] = (),
    ) -> None:
        items = list(patterns.items()) if isinstance(patterns, Mapping) else list(patterns)
        self.patterns: tuple[tuple[str, P], ...] = _check_patterns(items)
        self._compiled = tuple(re.compile(pattern) for pattern, _ in self.patterns)
        self.logical: tuple[tuple[str, AxisTarget], ...] = _check_logical(logical)
        self.fsdp: tuple[str, ...] = (fsdp,) if isinstance(fsdp, str) else tuple(fsdp or ())
        self.allow_unmatched = allow_unmatched
        self.allow_unused = allow_unused
        # module FQN regexes whose column-wise output is all-gathered, never paired (HF's
        # colwise_gather_output): the model's code after them needs the full features
        self.gathered: tuple[str, ...] = tuple(gathered)
        # patterns a helper wrote (from_hf's generated rules): the user's own rules may shadow
        # them, so they never count as unused
        self.generated: frozenset[str] = frozenset(generated)
        # what the plan should tell the user about how these rules were made (from_hf)
        self.notes: tuple[str, ...] = ()

    def __repr__(self) -> str:
        return (
            f"Rules(patterns={list(self.patterns)!r}, logical={list(self.logical)!r}, "
            f"fsdp={self.fsdp!r})"
        )

    @classmethod
    def from_hf(
        cls,
        model: nn.Module,
        *,
        fsdp: str | Sequence[str] | None = None,
        tp: str | None = "tp",
        sequence_parallel: bool = False,
        overrides: Mapping[str, P] | Sequence[tuple[str, P]] = (),
        ep: str | None = None,
    ) -> Rules:
        """Rules from a Hugging Face model's own tensor-parallel plan (``base_model_tp_plan``
        and ``_tp_plan``; see :mod:`meshtrain.spec.hf_plan`), over mesh axis ``tp``, everything
        else replicated. ``overrides`` (patterns tried first) cover what the plan leaves out or
        styles meshtrain does not lower, and may shadow the generated rules (only an override
        that matches nothing is an unused rule); ``sequence_parallel`` adds the ``("seq", tp)`` rule.
        ``tp=None`` reads no tensor-parallel plan. Experts modules (``base_model_ep_plan``'s
        ``grouped_gemm``/``ep_dispatch_experts``, ``moe_tp_experts``) split over ``ep`` on their
        experts dim (expert parallelism), or stay whole (``P()``, noted in the plan) without it;
        with ``tp``, the ``moe_tp_experts`` modules are split inside over it too (each expert's
        intermediate features, :mod:`meshtrain.plan.experts.tensor`).

        Example::

            rules = mt.Rules.from_hf(model, fsdp="dp")   # LlamaForCausalLM, Qwen2ForCausalLM, ...
        """
        written = list(overrides.items()) if isinstance(overrides, Mapping) else list(overrides)
        experts, notes = hf_expert_patterns(model, ep, tp)
        covered = [re.compile(pattern) for pattern, _ in [*written, *experts]]
        generated = hf_patterns(model, tp, covered=covered) if tp is not None else []
        logical = [("seq", tp)] if sequence_parallel and tp is not None else []
        made = [*experts, *generated, (r".*", P())]
        own = {pattern for pattern, _ in written}
        rules = cls(
            [*written, *made],
            logical=logical,
            fsdp=fsdp,
            gathered=hf_gathered(model, covered=covered) if tp is not None else (),
            generated=[pattern for pattern, _ in made if pattern not in own],
        )
        rules.notes = tuple(notes)
        return rules

    def match(self, fqn: str) -> tuple[str, P] | None:
        """The first regex rule that fully matches ``fqn``, or ``None``."""
        for (pattern, spec), compiled in zip(self.patterns, self._compiled):
            if compiled.fullmatch(fqn):
                return pattern, spec
        return None

    def logical_spec(self, names: LogicalAxes, mesh: Mesh | None = None) -> P:
        """The spec logical names map to under the priority rules (activations use this too).

        Example:
            >>> Rules(logical=[("batch", "dp"), ("embed", "dp"), ("embed", None)]).logical_spec(
            ...     ("batch", "seq_unused", "embed"))
            Traceback (most recent call last):
            ...
            meshtrain.errors.RuleError: logical name 'seq_unused' (in ('batch', 'seq_unused', 'embed')) appears in no logical rule (logical names with rules: 'batch', 'embed'). Add a rule for it, e.g. ('seq_unused', None) to leave it unsharded.
        """
        known = {name for name, _ in self.logical}
        for name in names:
            if name is not None and name not in known:
                raise RuleError(
                    f"logical name '{name}' (in {names}) appears in no logical rule"
                    f"{did_you_mean(name, sorted(known), 'logical names with rules')}. Add a rule "
                    f"for it, e.g. ('{name}', None) to leave it unsharded."
                )
        if mesh is not None:
            self._check_logical_axes(mesh)
        assigned: dict[int, Entry] = {}
        for name, target in self.logical:
            free = [i for i, n in enumerate(names) if n == name and i not in assigned]
            used = {axis for entry in assigned.values() for axis in entry_axes(entry)}
            if free and not used.intersection(entry_axes(target)):
                assigned[free[0]] = target
        entries = [assigned.get(dim) for dim in range(len(names))]
        while entries and entries[-1] is None:
            entries.pop()
        return P(*entries)

    def resolve(
        self,
        model: nn.Module | Mapping[str, Sequence[int]],
        mesh: Mesh,
        *,
        logical_axes: Mapping[str, LogicalAxes] | None = None,
    ) -> Resolution:
        """Choose every parameter's spec and check it against its shape and the mesh.

        ``model`` is a module (its ``named_parameters`` and logical annotations are read; meta
        tensors are fine) or a mapping FQN → shape, with ``logical_axes`` when logical rules apply.
        Pure: no collectives, no allocation; the same inputs give the same answer on every rank.
        """
        if isinstance(model, nn.Module):
            shapes = {fqn: tuple(param.shape) for fqn, param in model.named_parameters()}
            names = {**named_logical_axes(model), **(logical_axes or {})}
        else:
            shapes = {fqn: tuple(int(s) for s in shape) for fqn, shape in model.items()}
            names = dict(logical_axes or {})
        if self.logical:
            self._check_logical_axes(mesh)
        self._check_fsdp_axes(mesh)
        params, unmatched, used_patterns = [], [], set()
        for fqn, shape in shapes.items():
            hit = self.match(fqn)
            if hit is not None:
                used_patterns.add(hit[0])
                param = ParamSpec(fqn, shape, hit[1], f"regex r'{hit[0]}'", names.get(fqn))
            elif fqn in names and self.logical:
                spec = self._logical_param_spec(fqn, shape, names[fqn])
                param = ParamSpec(fqn, shape, spec, "logical", names[fqn])
            else:
                unmatched.append(fqn)
                param = ParamSpec(fqn, shape, P(), "unmatched", names.get(fqn))
            validate_spec(param.spec, shape, mesh, fqn=fqn, rule=_rule_text(param))
            params.append(param)
        if unmatched and not self.allow_unmatched:
            raise self._unmatched_error(unmatched, shapes, names, mesh)
        unused = [
            pattern
            for pattern, _ in self.patterns
            if pattern not in used_patterns and pattern not in self.generated
        ]
        if unused and not self.allow_unused:
            raise self._unused_error(unused, shapes, mesh)
        return Resolution(mesh, tuple(params), self.gathered)

    def _logical_param_spec(self, fqn: str, shape: tuple[int, ...], names: LogicalAxes) -> P:
        if len(names) != len(shape):
            raise RuleError(
                f"parameter '{fqn}' (shape {format_shape(shape)}) carries logical names {names}: "
                f"{len(names)} names for {len(shape)} dims. Annotate one name per dim.",
                fqn=fqn,
                shape=shape,
            )
        try:
            return self.logical_spec(names)
        except RuleError as err:
            raise RuleError(
                f"parameter '{fqn}' (shape {format_shape(shape)}): {err.message}",
                fqn=fqn,
                shape=shape,
            ) from None

    def _check_fsdp_axes(self, mesh: Mesh) -> None:
        for axis in self.fsdp:
            if axis not in mesh:
                raise RuleError(
                    f"fsdp={self.fsdp!r} names axis '{axis}', which mesh {mesh} does not have"
                    f"{did_you_mean(axis, mesh.axis_names, 'axes')}. Name a data axis of the mesh, "
                    f"or add it to make_mesh (size 1 is allowed: {axis}=1).",
                    mesh=mesh,
                    rule=f"fsdp={self.fsdp!r}",
                )

    def _check_logical_axes(self, mesh: Mesh) -> None:
        for name, target in self.logical:
            for axis in entry_axes(target):
                if axis not in mesh:
                    raise RuleError(
                        f"logical rule ('{name}', {target!r}) names axis '{axis}', which mesh {mesh} "
                        f"does not have{did_you_mean(axis, mesh.axis_names, 'axes')}. Add the axis "
                        f"to make_mesh (size 1 is allowed: {axis}=1) or change the rule.",
                        mesh=mesh,
                        rule=f"('{name}', {target!r})",
                    )

    def _unmatched_error(
        self,
        unmatched: list[str],
        shapes: Mapping[str, tuple[int, ...]],
        names: Mapping[str, LogicalAxes],
        mesh: Mesh,
    ) -> RuleError:
        lines = []
        for fqn in unmatched[:20]:
            patterns = [pattern for pattern, _ in self.patterns]
            near = difflib.get_close_matches(fqn, patterns, n=2, cutoff=0.6)
            shown = ", ".join(f"r'{pattern}'" for pattern in near)
            hint = f"; nearest patterns: {shown}" if near else ""
            why = (
                " (no logical names, and only logical rules could apply)"
                if self.logical and fqn not in names
                else ""
            )
            lines.append(f"  '{fqn}' (shape {format_shape(shapes[fqn])}){why}{hint}")
        more = f"\n  ... and {len(unmatched) - 20} more" if len(unmatched) > 20 else ""
        return RuleError(
            f"{len(unmatched)} of {len(shapes)} parameters match no rule on mesh {mesh}:\n"
            + "\n".join(lines)
            + more
            + "\nAdd a rule for them (a final r'.*': P() replicates everything else), annotate "
            "their logical axes, or pass allow_unmatched=True to replicate them.",
            fqn=unmatched[0],
            shape=shapes[unmatched[0]],
            mesh=mesh,
        )

    def _unused_error(
        self, unused: list[str], shapes: Mapping[str, tuple[int, ...]], mesh: Mesh
    ) -> RuleError:
        lines, never_match = [], False
        for pattern in unused:
            compiled = re.compile(pattern)
            shadowed = [fqn for fqn in shapes if compiled.fullmatch(fqn)]
            if shadowed:
                earlier = self.match(shadowed[0])
                why = (
                    f"shadowed: '{shadowed[0]}' matches it but earlier rule r'{earlier[0]}' wins"
                    if earlier
                    else ""
                )
            else:
                never_match = True
                near = difflib.get_close_matches(pattern, list(shapes), n=1, cutoff=0.3)
                why = (
                    f"no parameter matches it in full (closest FQN: '{near[0]}')"
                    if near
                    else "no parameter matches it"
                )
            lines.append(f"  r'{pattern}': {why}")
        hint = (
            "Patterns must match whole FQNs (use r'.*\\.wq\\.weight', not r'wq'). "
            if never_match
            else "Move a shadowed rule above the rule that wins. "
        )
        rules = "rule" if len(unused) == 1 else "rules"
        return RuleError(
            f"{len(unused)} {rules} matched no parameter of {len(shapes)} on mesh {mesh}:\n"
            + "\n".join(lines)
            + f"\n{hint}Fix or remove them, or pass allow_unused=True.",
            rule=unused[0],
            mesh=mesh,
        )


def _rule_text(param: ParamSpec) -> str:
    if param.source == "logical":
        return f"logical {param.logical}"
    return param.source


def _check_patterns(items: list[tuple[str, P]]) -> tuple[tuple[str, P], ...]:
    seen: dict[str, P] = {}
    for item in items:
        if not (isinstance(item, tuple) and len(item) == 2):
            raise RuleError(f"rule {item!r} is not a (pattern, P) pair.")
        pattern, spec = item
        if not isinstance(pattern, str):
            raise RuleError(f"rule pattern {pattern!r} must be a regex string.", rule=str(pattern))
        if not isinstance(spec, P):
            raise RuleError(
                f"rule {pattern!r} maps to {spec!r} of type {type(spec).__name__}; rules map to P(...), "
                f"e.g. P({', '.join(repr(e) for e in spec) if isinstance(spec, tuple) else ''}).",
                rule=pattern,
            )
        try:
            re.compile(pattern)
        except re.error as err:
            raise RuleError(
                f"rule {pattern!r} is not a valid regex: {err}.", rule=pattern
            ) from None
        if pattern in seen and seen[pattern] != spec:
            raise RuleError(
                f"conflicting rules: pattern {pattern!r} maps to both {seen[pattern]!r} and {spec!r}. "
                "Keep one of them.",
                rule=pattern,
                spec=spec,
            )
        if pattern in seen:
            raise RuleError(
                f"rule {pattern!r} → {spec!r} is given twice; remove the duplicate.", rule=pattern
            )
        seen[pattern] = spec
    return tuple(items)


def _check_logical(rules: Sequence[tuple[str, AxisTarget]]) -> tuple[tuple[str, AxisTarget], ...]:
    checked = []
    for item in rules:
        if not (isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], str)):
            raise RuleError(
                f"logical rule {item!r} must be a (logical_name, mesh_axes) pair, e.g. ('embed', 'dp') "
                "or ('batch', ('dp', 'fsdp')) or ('norm', None)."
            )
        name, target = item
        try:
            entry = P(target).entries[0] if target is not None else None
        except SpecError as err:
            raise RuleError(
                f"logical rule ('{name}', {target!r}) has a bad mesh-axis target: {err.message}",
                rule=f"('{name}', {target!r})",
            ) from None
        if (name, entry) in checked:
            raise RuleError(
                f"logical rule ('{name}', {target!r}) is given twice; remove the duplicate."
            )
        checked.append((name, entry))
    return tuple(checked)
