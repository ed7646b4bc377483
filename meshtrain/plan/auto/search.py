"""``strategy="auto"``: choose the data/tensor/pipeline degrees, ZeRO stage and checkpointing.

The decision procedure, for a model, a world of ``world_size`` devices in nodes of ``node_size``,
``device_memory`` bytes per device and a global batch:

1. **Candidates.** Every mesh ``{pp, dp, tp}`` (tensor parallel fastest, so its groups are
   neighbouring ranks) with ``tp`` a power of two up to ``node_size`` (tensor parallel stays
   inside a node), ``pp`` a power of two up to the number of blocks, ``dp`` the rest; every ZeRO
   stage 0–3; checkpointing none, selective, full. A pipeline runs 1F1B with the most
   micro-batches up to ``4 × pp`` that split the data-parallel rank's batch (at least ``pp``).
   Candidates the planner rejects (heads that do not split, a batch that does not divide) drop
   out, each with its reason.
2. **Memory.** Each candidate is planned by ``mt.plan`` itself; it *fits* when its peak per rank
   (:attr:`~meshtrain.plan.ir.Memory.total`: master parameters, gradients, optimizer states,
   buffers, gathered copies, unsharded gradients, activations) is at most ``device_memory``.
3. **Cost.** The modelled time a step spends on more than its model FLOPs (:class:`Links`):
   every collective's ring bytes over its axis's link (inside a node or across nodes) plus a
   latency per collective, the pipeline bubble (idle fraction of the compute time) and the
   recomputation full checkpointing adds (one more forward: a third of the step's FLOPs).
4. **Choice.** The fitting candidate of least cost; ties go to the simpler plan (fewer pipeline
   stages, less tensor parallelism, lower ZeRO stage, less checkpointing).

The textbook ladder falls out of the costs: a model that fits one device runs DDP (ZeRO-1/2 move
the same bytes with twice the collectives when gradients are reduced in the dtype parameters are
gathered in); otherwise optimizer states are sharded, then gradients, then parameters (ZeRO-3
adds an all-gather per block in backward); tensor parallelism, whose per-layer activation
collectives only pay on fast links, stays inside a node; pipelines cut the data-parallel traffic
of the largest models across nodes at the price of the bubble. One deviation: with bf16 compute
and fp32 gradient reduction, ZeRO-1 gathers parameters in bf16 and reduce-scatters gradients in
fp32 (6 bytes per parameter) where DDP all-reduces fp32 gradients (8), so ZeRO-1 wins even when
DDP fits.

Example:
    >>> from meshtrain.models import LlamaConfig, build_llama, default_rules
    >>> model = build_llama(LlamaConfig.debug(), device="meta")
    >>> choice = choose_plan(model, 4, default_rules(), PlanOptions(global_batch=8, seq_len=32),
    ...                      search=AutoSearch(device_memory=2**30))
    >>> choice.plan.mesh, choice.plan.options.zero
    (Mesh({pp: 1, dp: 4, tp: 1}), 0)
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace

from torch import nn

from meshtrain.adapters.nf4 import nf4_bytes
from meshtrain.errors import MeshtrainError, PlanError
from meshtrain.plan.adapters import storage
from meshtrain.plan.build import build_plan
from meshtrain.plan.decisions import fsdp_decisions
from meshtrain.plan.infer import infer_units
from meshtrain.plan.ir import Plan
from meshtrain.plan.memory.footprint import footprint
from meshtrain.plan.memory.sizes import format_bytes
from meshtrain.plan.options import AutoSearch, Pipeline, PlanOptions
from meshtrain.spec.mesh import make_mesh
from meshtrain.spec.rules import Rules

MODES = ("none", "selective", "full")


@dataclass(frozen=True)
class Links:
    """What the cost model assumes of the machine (defaults: H100 nodes of 8 with NVLink inside
    and 400 Gb/s InfiniBand per GPU across nodes, and 40% of bf16 peak FLOPs achieved).

    Example:
        >>> Links().seconds(4 * 10**9, inside_node=False)
        0.08003
    """

    intra_bytes_per_s: float = 360e9
    inter_bytes_per_s: float = 50e9
    intra_latency_s: float = 15e-6
    inter_latency_s: float = 30e-6
    flops_per_s: float = 0.4 * 989e12

    def seconds(self, sent_bytes: float, *, inside_node: bool, collectives: int = 1) -> float:
        """Time to send ``sent_bytes`` in ``collectives`` collectives over one kind of link."""
        if inside_node:
            return sent_bytes / self.intra_bytes_per_s + collectives * self.intra_latency_s
        return sent_bytes / self.inter_bytes_per_s + collectives * self.inter_latency_s


@dataclass(frozen=True)
class Candidate:
    """One point of the search: a mesh, a ZeRO stage, a checkpointing mode, the micro-batches."""

    pp: int
    dp: int
    tp: int
    zero: int
    checkpointing: str
    microbatches: int
    cp: int = 1  # context parallelism: ranks sharing each sequence (dp · cp · tp · pp = world)

    @property
    def simplicity(self) -> tuple[int, ...]:
        """Tie-break order: less context parallelism, fewer pipeline stages, less tensor
        parallelism, lower ZeRO stage, less checkpointing."""
        return (self.cp, self.pp, self.tp, self.zero, MODES.index(self.checkpointing))

    def describe(self) -> str:
        if self.pp > 1:
            pipe = f", 1F1B over {self.microbatches} micro-batches"
        else:
            pipe = (
                f", {self.microbatches} accumulated micro-batches" if self.microbatches > 1 else ""
            )
        context = f" × cp {self.cp}" if self.cp > 1 else ""
        return (
            f"pp {self.pp} × dp {self.dp}{context} × tp {self.tp}, zero {self.zero}, "
            f"{self.checkpointing} checkpointing{pipe}"
        )


@dataclass(frozen=True)
class Evaluated:
    """A candidate with its planned peak memory and modelled cost (or why it cannot be planned)."""

    candidate: Candidate
    peak_bytes: int | None
    cost_s: float | None
    rejected: str = ""
    floor_bytes: int | None = None  # a lower bound of the peak, when rejected without planning

    def fits(self, device_memory: int) -> bool:
        return self.peak_bytes is not None and self.peak_bytes <= device_memory

    @property
    def cost(self) -> float:
        """Modelled seconds (infinite when not planned)."""
        return math.inf if self.cost_s is None else self.cost_s


@dataclass(frozen=True)
class AutoChoice:
    """The chosen plan, every candidate considered, and the reasons, for ``explain()``."""

    plan: Plan
    chosen: Evaluated
    candidates: tuple[Evaluated, ...]
    device_memory: int
    reasons: tuple[str, ...] = field(default=())


def choose_plan(
    model: nn.Module,
    world_size: int,
    rules: Rules,
    options: PlanOptions,
    *,
    search: AutoSearch,
    links: Links | None = None,
    device_type: str = "cpu",
    abstract: bool = True,
) -> AutoChoice:
    """Run the decision procedure (module docstring) and return the chosen plan.

    ``rules`` must name the mesh axes ``dp`` (FSDP) and, for tensor parallelism, ``tp``;
    ``options`` carry ``global_batch`` and ``seq_len`` (both required) and the choices every
    candidate shares (precision, optimizer, ...); the search sets the ZeRO stage, checkpointing,
    micro-batches and pipeline itself. ``abstract``: whether the chosen mesh is for planning
    only. Raises :class:`PlanError` when nothing fits, with the smallest world (at this device
    memory) and the smallest device memory (at this world) that would.
    """
    _check_request(options, world_size, search)
    assert options.global_batch is not None and options.seq_len is not None
    shared = replace(
        options,
        zero=3,
        activation_checkpointing="none",
        checkpoint_every=1,
        microbatches=1,
        pipeline=None,
    )
    engine = _Search(
        model,
        world_size,
        rules,
        search.device_memory,
        options.global_batch,
        options.seq_len,
        search.node_size,
        links or Links(),
        device_type,
        shared,
        n_blocks=_n_blocks(model),
        rest_bytes=_rest_bytes(model, shared),
    )
    evaluated = list(reported(engine.evaluate_all(), search, world_size))
    fitting = [e for e in evaluated if e.fits(search.device_memory)]
    if not fitting:  # long sequences: split each over context ranks (plan/context/cost.py)
        evaluated += reported(engine.evaluate_context(), search, world_size, "with context ranks")
        fitting = [e for e in evaluated if e.fits(search.device_memory)]
    if not fitting:
        raise engine.nothing_fits(evaluated)
    best = min(fitting, key=lambda e: (e.cost, e.candidate.simplicity))
    plan = engine.plan(best.candidate, abstract=abstract)
    reasons = _reasons(best, evaluated, search.device_memory, world_size, search.node_size)
    return AutoChoice(
        replace(plan, notes=(*reasons, *plan.notes)),
        best,
        tuple(evaluated),
        search.device_memory,
        reasons,
    )


def reported(
    evaluations: Iterable[Evaluated],
    search: AutoSearch,
    world_size: int,
    kind: str = "",
    every_s: float = 5.0,
) -> Iterator[Evaluated]:
    """``evaluations`` passed through; to ``search.progress`` a line as they start and then
    every ``every_s`` seconds: how many layouts are planned and how many fit so far."""
    say = search.progress
    if say is None:
        yield from evaluations
        return
    say(f"searching layouts {kind + ' ' if kind else ''}for {world_size:,} ranks")
    began = last = time.monotonic()
    fit = 0
    for planned, evaluation in enumerate(evaluations, 1):
        fit += evaluation.fits(search.device_memory)
        yield evaluation
        if time.monotonic() - last >= every_s:
            last = time.monotonic()
            say(f"  {planned} layouts planned in {last - began:.0f} s, {fit} fit")


def _check_request(options: PlanOptions, world_size: int, search: AutoSearch) -> None:
    """What auto chooses must be left alone; what it needs must be given."""
    chosen = {
        "pipeline": None,
        "microbatches": 1,
        "activation_checkpointing": "none",
        "batch_size": None,
    }
    clashes = [
        f"{name}={getattr(options, name)!r}"
        for name, default in chosen.items()
        if getattr(options, name) != default
    ]
    missing = [name for name in ("global_batch", "seq_len") if getattr(options, name) is None]
    if clashes or missing:
        raise PlanError(
            f"strategy='auto' on {world_size} ranks of {format_bytes(search.device_memory)}: "
            + (f"it chooses {', '.join(clashes)} itself — leave them out; " if clashes else "")
            + (f"it needs {', '.join(missing)}." if missing else "")
        )


def step_cost(
    plan: Plan,
    node_size: int,
    links: Links,
    tokens_per_step: int,
    checkpointing: str | None = None,
) -> float:
    """Modelled seconds a step spends beyond its model FLOPs: collectives (ring bytes over each
    axis's link + latency), the pipeline bubble and full checkpointing's recomputation (under
    ``checkpointing``, default the plan's own mode; a flat plan's three modes share one planning).
    """
    report = footprint(plan)
    comm = 0.0
    for traffic in report.traffic:
        span = max(plan.mesh.span(axis) for axis in traffic.axis.split("+"))
        comm += links.seconds(
            traffic.sent_bytes, inside_node=span <= node_size, collectives=traffic.count
        )
    params = sum(math.prod(p.shape) for p in plan.params)
    compute = 6 * params * tokens_per_step / plan.mesh.world_size / links.flops_per_s
    bubble = report.bubble_fraction / (1 - report.bubble_fraction) * compute
    mode = checkpointing or plan.options.activation_checkpointing
    return comm + bubble + (compute / 3 if mode == "full" else 0.0)


def candidates(world_size: int, node_size: int, n_blocks: int) -> Iterator[tuple[int, int, int]]:
    """(pp, dp, tp) meshes of the search: powers of two for tp (≤ node) and pp (≤ blocks).

    Example:
        >>> list(candidates(8, 8, 2))
        [(1, 8, 1), (2, 4, 1), (1, 4, 2), (2, 2, 2), (1, 2, 4), (2, 1, 4), (1, 1, 8)]
    """
    tp = 1
    while tp <= min(node_size, world_size):
        if world_size % tp == 0:
            pp = 1
            while pp <= n_blocks and world_size % (tp * pp) == 0:
                yield pp, world_size // (tp * pp), tp
                pp *= 2
        tp *= 2


# --- internals -------------------------------------------------------------------------------


def _n_blocks(model: nn.Module) -> int:
    return max(1, sum(1 for unit in infer_units(model, None) if unit.fqn))


def _microbatches(pp: int, dp: int, global_batch: int) -> tuple[int, ...]:
    """Micro-batch counts to try: without a pipeline 1 and one sequence per micro-batch
    (gradient accumulation); with one, the most ≤ 4·pp (≥ pp) that split a dp rank's batch."""
    if global_batch % dp:
        return ()
    per_rank = global_batch // dp
    if pp == 1:
        return tuple(sorted({1, per_rank}))
    for micro in range(min(4 * pp, per_rank), pp - 1, -1):
        if per_rank % micro == 0:
            return (micro,)
    return ()


def _rest_bytes(model: nn.Module, options: PlanOptions) -> int:
    """The whole model's bytes at rest on one device: every parameter in its storage (NF4 for a
    QLoRA base), and a gradient and the optimizer's states for each trainable one (no states on
    the device under ``offload_optimizer``)."""
    nf4 = storage(model)
    states = 0 if options.offload_optimizer else options.optimizer_states
    total = 0
    for fqn, param in model.named_parameters():
        numel, size = param.numel(), param.element_size()
        total += nf4_bytes(numel) if fqn in nf4 else numel * size
        total += numel * size * (1 + states) if param.requires_grad else 0
    return total


def _at_rest_floor(rest_bytes: int, c: Candidate, options: PlanOptions) -> int:
    """A lower bound of a candidate's memory at rest: the model's ``rest_bytes`` split tp·pp
    ways (and dp ways under ZeRO ≥ 1); 0 under offload."""
    if options.offload:
        return 0
    ways = c.tp * c.pp * (c.dp * c.cp if fsdp_decisions(c.zero).shard_params else 1)
    return rest_bytes // ways


def _options(c: Candidate, global_batch: int, shared: PlanOptions) -> PlanOptions:
    """The options of candidate ``c``: the shared ones with its ZeRO stage, checkpointing,
    global batch and micro-batches (a 1F1B pipeline over ``pp`` when ``c.pp > 1``)."""
    pipeline = (
        Pipeline(axis="pp", schedule="1F1B", microbatches=c.microbatches) if c.pp > 1 else None
    )
    return shared.with_overrides(
        zero=c.zero,
        activation_checkpointing=c.checkpointing,
        global_batch=global_batch,
        pipeline=pipeline,
        microbatches=1 if pipeline else c.microbatches,
    )


@dataclass(frozen=True)
class _Search:
    """The inputs every step of the decision procedure shares."""

    model: nn.Module
    world_size: int
    rules: Rules
    device_memory: int
    global_batch: int
    seq_len: int
    node_size: int
    links: Links
    device_type: str
    shared: PlanOptions  # what every candidate shares (precision, optimizer, seq_len, ...)
    n_blocks: int  # repeated blocks: the most pipeline stages
    rest_bytes: int  # the whole model's bytes at rest (see _rest_bytes)

    def plan(
        self,
        c: Candidate,
        *,
        world: int | None = None,
        batch: int | None = None,
        abstract: bool = True,
    ) -> Plan:
        """Candidate ``c`` planned (on ``world`` ranks with global ``batch`` if given); with
        ``c.cp > 1`` on a mesh with a ``cp`` axis and the rule ``("seq", "cp")``."""
        axes = {"pp": c.pp, "dp": c.dp, "tp": c.tp}
        rules = self.rules
        if c.cp > 1:
            axes = {"pp": c.pp, "dp": c.dp, "cp": c.cp, "tp": c.tp}
            rules = Rules(
                rules.patterns,
                logical=(("seq", "cp"), *rules.logical),
                fsdp=rules.fsdp,
                allow_unmatched=rules.allow_unmatched,
                allow_unused=rules.allow_unused,
                gathered=rules.gathered,
                generated=tuple(rules.generated),
            )
        mesh = make_mesh(
            axes,
            world_size=world or self.world_size,
            abstract=abstract,
            device_type=self.device_type,
        )
        options = _options(c, batch or self.global_batch, self.shared)
        return build_plan(self.model, mesh, rules, options)

    def cost(self, plan: Plan, checkpointing: str | None = None) -> float:
        tokens = self.global_batch * self.seq_len
        return step_cost(plan, self.node_size, self.links, tokens, checkpointing)

    def evaluate_all(self) -> Iterator[Evaluated]:
        """Every candidate, planned — with three shortcuts that never hide a fitting one: a
        memory floor at rest above the device's rejects a candidate unplanned; a flat plan's one
        planning gives all three checkpointing modes (only activations differ); a pipeline is
        planned with full checkpointing first, and when that does not fit, neither do the modes
        that keep more."""
        for pp, dp, tp in candidates(self.world_size, self.node_size, self.n_blocks):
            micros = _microbatches(pp, dp, self.global_batch)
            if not micros:
                yield Evaluated(
                    Candidate(pp, dp, tp, 0, "none", 0),
                    None,
                    None,
                    f"global batch {self.global_batch} does not split into {dp} "
                    f"data-parallel ranks × ≥{pp} micro-batches",
                )
                continue
            for micro in micros:
                for zero in (0, 1, 2, 3):
                    yield from self.evaluate_modes(Candidate(pp, dp, tp, zero, "full", micro))

    def evaluate_context(self) -> list[Evaluated]:
        """When nothing fits: context parallelism over ``cp`` = 2, 4, ... ranks (powers of two
        dividing the world whose ``2·cp`` chunks split the sequence), with data parallelism
        over the rest and (to keep the search small) neither tensor nor pipeline parallelism,
        every ZeRO stage and checkpointing mode."""
        found: list[Evaluated] = []
        cp = 2
        while cp <= self.world_size and self.world_size % cp == 0:
            if self.seq_len % (2 * cp) == 0:
                dp = self.world_size // cp
                for micro in _microbatches(1, dp, self.global_batch):
                    for zero in (0, 1, 2, 3):
                        found += self.evaluate_modes(Candidate(1, dp, 1, zero, "full", micro, cp))
            cp *= 2
        return found

    def evaluate_modes(self, base: Candidate) -> Iterator[Evaluated]:
        """``base`` (full checkpointing) and its selective and no-checkpointing variants."""
        floor = _at_rest_floor(self.rest_bytes, base, self.shared)
        if floor > self.device_memory:
            for mode in MODES:
                yield Evaluated(
                    replace(base, checkpointing=mode),
                    None,
                    None,
                    f"memory at rest ≥ {format_bytes(floor)}",
                    floor,
                )
            return
        try:
            plan = self.plan(base)
        except MeshtrainError as error:
            yield Evaluated(base, None, None, error.message.split(". ")[0])
            return
        estimates = dict(plan.activation_estimates)
        full = Evaluated(base, plan.memory.total, self.cost(plan))
        if plan.pipeline is None and estimates:
            other = plan.memory.total - plan.memory.activations
            for mode in MODES:
                if mode == "full":
                    yield full
                else:
                    yield Evaluated(
                        replace(base, checkpointing=mode),
                        other + estimates[mode],
                        self.cost(plan, mode),
                    )
            return
        monotone = not estimates or estimates["none"] >= estimates["selective"] >= estimates["full"]
        yield full
        for mode in ("selective", "none"):
            c = replace(base, checkpointing=mode)
            if monotone and not full.fits(self.device_memory):
                yield Evaluated(
                    c,
                    None,
                    None,
                    "keeps more activations than full checkpointing, which does not fit",
                )
                continue
            planned = self.plan(c)
            yield Evaluated(c, planned.memory.total, self.cost(planned))

    def nothing_fits(self, evaluated: list[Evaluated]) -> PlanError:
        """The error for a search where nothing fits: what memory and what world would."""
        sized = [e for e in evaluated if (e.peak_bytes or e.floor_bytes) is not None]
        if not sized:
            reasons = sorted({e.rejected for e in evaluated})[:3]
            return PlanError(
                f"strategy auto found no plan for {self.world_size} ranks: no candidate mesh can "
                f"be planned ({'; '.join(reasons)}). Use a world size with a valid factorisation "
                "(a multiple of the tensor-parallel degree the heads allow) or a global batch "
                "that divides into it."
            )
        unplanned = {_leanest(e.candidate) for e in sized if e.peak_bytes is None}
        planned = [e for e in sized if e.peak_bytes is not None] + [
            e for e in (self.try_plan(c) for c in sorted(unplanned, key=str)) if e is not None
        ]
        smallest = min(planned, key=lambda e: e.peak_bytes or 0)
        need = f"{format_bytes(smallest.peak_bytes or 0)} ({smallest.candidate.describe()})"
        return PlanError(
            f"strategy auto: the model does not fit {self.world_size} devices of "
            f"{format_bytes(self.device_memory)} at any degree ({len(evaluated)} candidates). Use "
            f"devices of at least {need}{self.smallest_world()}."
        )

    def try_plan(
        self, c: Candidate, world: int | None = None, batch: int | None = None
    ) -> Evaluated | None:
        """``c`` planned (its peak, no cost), or None when the planner rejects it."""
        try:
            return Evaluated(c, self.plan(c, world=world, batch=batch).memory.total, None)
        except MeshtrainError:
            return None

    def smallest_world(self) -> str:
        """', or at least N devices of this memory': the world doubled (with the global batch,
        so each rank keeps its sequences) until the leanest plan of some mesh fits."""
        world, batch = self.world_size, self.global_batch
        for _ in range(12):
            world, batch = world * 2, batch * 2
            for pp, dp, tp in candidates(world, self.node_size, self.n_blocks):
                micros = _microbatches(pp, dp, batch)
                if not micros:
                    continue
                c = Candidate(pp, dp, tp, 3, "full", micros[-1])
                result = self.try_plan(c, world, batch)
                if result is not None and result.fits(self.device_memory):
                    return (
                        f", or at least {world} devices of this memory ({c.describe()}, "
                        f"global batch {batch}: the same sequences per data-parallel rank)"
                    )
        return f" (no world up to {world:,} devices of this memory fits either)"


def _leanest(c: Candidate) -> Candidate:
    """The leanest variant of ``c``'s mesh: ZeRO-3 with full checkpointing."""
    return replace(c, zero=3, checkpointing="full")


def _reasons(
    best: Evaluated,
    evaluated: list[Evaluated],
    device_memory: int,
    world_size: int,
    node_size: int,
) -> tuple[str, ...]:
    planned = [e for e in evaluated if e.peak_bytes is not None]
    fitting = [e for e in planned if e.fits(device_memory)]
    lines = [
        f"strategy auto on {world_size} devices of {format_bytes(device_memory)} (nodes of "
        f"{node_size}): chose {best.candidate.describe()}: peak {format_bytes(best.peak_bytes or 0)} "
        f"per rank, modelled overhead {best.cost * 1e3:.1f} ms per step",
        f"{len(evaluated)} candidates: {len(planned)} planned, {len(fitting)} fit; the cheapest "
        "fitting one wins (collectives + bubble + recomputation; ties: simpler plan)",
    ]
    cheaper = sorted(
        (e for e in planned if not e.fits(device_memory) and e.cost < best.cost),
        key=lambda e: e.cost,
    )[:3]
    for e in cheaper:
        lines.append(
            f"cheaper but too big: {e.candidate.describe()} needs {format_bytes(e.peak_bytes or 0)} "
            f"({e.cost * 1e3:.1f} ms)"
        )
    return tuple(lines)
