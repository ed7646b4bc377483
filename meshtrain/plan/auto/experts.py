"""``strategy="auto"`` for a mixture of experts: the expert-parallel degree joins the search.

A model with experts modules (:func:`~meshtrain.plan.experts.axis.is_experts_module`) is searched
twice, and the cheapest fitting plan of both wins (ties: the simpler plan, less ``ep``):

1. **Dense**: :func:`~meshtrain.plan.auto.search.choose_plan`'s candidates, the experts data-parallel
   like any weight (the rules' ``("expert", ep)`` logical rule dropped, so they stay whole per
   expert and FSDP shards them).
2. **Expert-parallel**: the mesh ``{pp: 1, dp: world / ep, ep, tp: 1}`` for every ``ep`` a power
   of two of at least 2 that divides the world and every module's experts; ZeRO 1–3 and every
   checkpointing mode, one micro-batch (expert parallelism lowers with none of tensor
   parallelism, pipelines or ZeRO 0). Costs are :func:`~meshtrain.plan.auto.search.step_cost`'s, the
   token all-to-alls (sized for uniform routing) included, over the intra-node link when ``ep``
   ranks are neighbours within a node.

Activation memory is what the planner traces, the experts' dispatch counted for uniform routing
(:mod:`meshtrain.plan.experts.activations`), so candidates are compared with their activations.

Example:
    >>> from meshtrain.models.moe import MoEConfig, build_moe, default_rules
    >>> model = build_moe(MoEConfig.debug(), device="meta")
    >>> expert_degrees(model, 16)
    (2, 4, 8)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from torch import nn

from meshtrain.errors import MeshtrainError, PlanError
from meshtrain.plan.auto.search import (
    MODES,
    AutoChoice,
    Candidate,
    Evaluated,
    Links,
    choose_plan,
    step_cost,
)
from meshtrain.plan.build import build_plan
from meshtrain.plan.experts.axis import is_experts_module
from meshtrain.plan.ir import Plan
from meshtrain.plan.memory.sizes import format_bytes
from meshtrain.plan.options import AutoSearch, PlanOptions
from meshtrain.spec.mesh import make_mesh
from meshtrain.spec.rules import Rules

__all__ = ["ExpertCandidate", "choose_expert_plan", "expert_degrees", "has_experts"]


@dataclass(frozen=True)
class ExpertCandidate(Candidate):
    """A candidate with ``ep`` expert-parallel ranks (``dp · ep`` batch ranks)."""

    ep: int = 1

    @property
    def simplicity(self) -> tuple[int, ...]:
        return (self.ep, *super().simplicity)

    def describe(self) -> str:
        return super().describe().replace(f"dp {self.dp}", f"dp {self.dp} × ep {self.ep}", 1)


def has_experts(model: nn.Module) -> bool:
    """Whether ``model`` has an experts module."""
    return any(is_experts_module(module) for module in model.modules())


def expert_degrees(model: nn.Module, world_size: int) -> tuple[int, ...]:
    """The ``ep`` sizes the search tries: powers of two ≥ 2 dividing the world and every experts
    module's number of experts."""
    counts = [int(m.num_experts) for m in model.modules() if is_experts_module(m)]  # type: ignore[arg-type]
    if not counts:
        return ()
    common = math.gcd(*counts)
    found, ep = [], 2
    while ep <= min(world_size, common):
        if world_size % ep == 0 and common % ep == 0:
            found.append(ep)
        ep *= 2
    return tuple(found)


def choose_expert_plan(
    model: nn.Module,
    world_size: int,
    rules: Rules,
    options: PlanOptions,
    *,
    search: AutoSearch,
    links: Links | None = None,
    device_type: str = "cpu",
    abstract: bool = True,
    expert_axis: str = "ep",
) -> AutoChoice:
    """The module docstring's search; ``rules`` map the experts dim to ``expert_axis`` (e.g. the
    MoE model's ``default_rules(ep="ep")``). Raises :class:`PlanError` when nothing fits."""
    links = links or Links()
    dense: AutoChoice | None = None
    dense_error = ""
    try:
        dense = choose_plan(
            model,
            world_size,
            _without_axis(rules, expert_axis),
            options,
            search=search,
            links=links,
            device_type=device_type,
            abstract=abstract,
        )
    except MeshtrainError as error:
        dense_error = error.message.split(". ")[0]
    evaluated = list(
        _expert_candidates(
            model, world_size, rules, options, search, links, device_type, expert_axis
        )
    )
    if search.progress is not None:
        search.progress(f"  {len(evaluated)} layouts with expert parallelism planned")
    fitting = [e for e, _ in evaluated if e.fits(search.device_memory)]
    if dense is not None:
        fitting.append(dense.chosen)
    if not fitting:
        raise PlanError(
            f"strategy auto: the mixture of experts does not fit {world_size} devices of "
            f"{format_bytes(search.device_memory)} with or without expert parallelism "
            f"(dense search: {dense_error or 'no fitting plan'}; ep {expert_degrees(model, world_size)}"
            " tried). Use more devices or devices with more memory."
        )
    best = min(fitting, key=lambda e: (e.cost, e.candidate.simplicity))
    if dense is not None and best is dense.chosen:
        return dense
    plans = {id(e): plan for e, plan in evaluated}
    plan = plans[id(best)]
    if not abstract:
        assert isinstance(best.candidate, ExpertCandidate)
        plan = _plan(
            model, best.candidate, rules, options, world_size, device_type, False, expert_axis
        )
    reason = (
        f"strategy auto on {world_size} devices of {format_bytes(search.device_memory)}: chose "
        f"{best.candidate.describe()}: peak {format_bytes(best.peak_bytes or 0)} per rank, "
        f"modelled overhead {best.cost * 1e3:.1f} ms per step"
        + (
            f"; the best without expert parallelism costs {dense.chosen.cost * 1e3:.1f} ms"
            if dense is not None
            else f"; without expert parallelism: {dense_error or 'nothing fits'}"
        )
    )
    candidates = tuple(e for e, _ in evaluated) + (dense.candidates if dense is not None else ())
    return AutoChoice(
        replace(plan, notes=(reason, *plan.notes)),
        best,
        candidates,
        search.device_memory,
        (reason,),
    )


def _expert_candidates(
    model: nn.Module,
    world_size: int,
    rules: Rules,
    options: PlanOptions,
    search: AutoSearch,
    links: Links,
    device_type: str,
    expert_axis: str,
) -> list[tuple[Evaluated, Plan]]:
    """Every expert-parallel candidate planned once per ZeRO stage; a flat plan's one planning
    gives its three checkpointing modes (only activations differ)."""
    assert options.global_batch is not None and options.seq_len is not None
    tokens = options.global_batch * options.seq_len
    found: list[tuple[Evaluated, Plan]] = []
    for ep in expert_degrees(model, world_size):
        dp = world_size // ep
        for zero in (1, 2, 3):
            c = ExpertCandidate(1, dp, 1, zero, "full", 1, ep=ep)
            try:
                plan = _plan(model, c, rules, options, world_size, device_type, True, expert_axis)
            except MeshtrainError:
                continue  # refused for this ep and stage: not a candidate
            estimates = dict(plan.activation_estimates)
            other = plan.memory.total - plan.memory.activations
            for mode in MODES:
                peak = other + estimates[mode] if estimates else plan.memory.total
                cost = step_cost(plan, search.node_size, links, tokens, mode)
                found.append((Evaluated(replace(c, checkpointing=mode), peak, cost), plan))
    return found


def _plan(
    model: nn.Module,
    c: ExpertCandidate,
    rules: Rules,
    options: PlanOptions,
    world_size: int,
    device_type: str,
    abstract: bool,
    expert_axis: str,
) -> Plan:
    mesh = make_mesh(
        {"pp": 1, "dp": c.dp, expert_axis: c.ep, "tp": 1},
        world_size=world_size,
        abstract=abstract,
        device_type=device_type,
    )
    chosen = options.with_overrides(
        zero=c.zero, activation_checkpointing=c.checkpointing, microbatches=1, pipeline=None
    )
    return build_plan(model, mesh, rules, chosen)


def _without_axis(rules: Rules, axis: str) -> Rules:
    """``rules`` with logical rules onto ``axis`` mapping to nothing instead (experts whole)."""
    logical = tuple((name, None if target == axis else target) for name, target in rules.logical)
    return Rules(
        rules.patterns,
        logical=logical,
        fsdp=rules.fsdp,
        allow_unmatched=rules.allow_unmatched,
        allow_unused=rules.allow_unused,
        gathered=rules.gathered,
        generated=tuple(rules.generated),
    )
