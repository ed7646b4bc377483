"""Pipeline parallelism, planned: which stages run where, in which schedule, at what cost — pure.

A :class:`Pipeline` names the mesh axis the stages are laid along, one of the schedules of
``torch.distributed.pipelining``, the micro-batches per step, the (virtual) stages per rank and
the split. :func:`plan_pipeline` checks it against the model and mesh and returns the
:class:`~meshtrain.plan.ir.PipelinePlan`: stage → rank assignment, per-stage memory, the
schedule's bubble fraction and the point-to-point traffic per step. Nothing here issues a
collective; the schedule's own action order (what every rank runs, in torch's code) is built
from stand-in stage descriptions, so its validation and its timing are torch's, not a copy.

==========================  ================  ==========================================
schedule                    stages per rank   stage → rank
==========================  ================  ==========================================
``GPipe``, ``1F1B``         1                 stage *s* on rank *s*
``Interleaved1F1B``,        ≥ 1 (``v``)       looped: stage *s* on rank *s mod P*
``LoopedBFS``,
``InterleavedZeroBubble``
``ZBVZeroBubble``,          2                 V: rank *r* holds stages *r* and *2P−1−r*
``DualPipeV``
==========================  ================  ==========================================

Example:
    >>> import meshtrain as mt
    >>> from meshtrain.models import LlamaConfig, build_llama, default_rules
    >>> model = build_llama(LlamaConfig.preset("debug", n_layers=4), device="meta")
    >>> mesh = mt.make_mesh(pp=2, dp=2, tp=1, world_size=4, abstract=True)
    >>> plan = mt.plan(model, mesh, default_rules(), pipeline=Pipeline(microbatches=4))
    >>> [(s.index, s.rank, s.modules) for s in plan.pipeline.stages]
    [(0, 0, ('tok_embeddings', 'layers.0', 'layers.1')), (1, 1, ('layers.2', 'layers.3', 'norm', 'output'))]
    >>> round(plan.pipeline.bubble_fraction, 3)  # (P-1)/(M+P-1) for 1F1B
    0.2
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from meshtrain.errors import PlanError
from meshtrain.plan.ir import PipelinePlan, StagePlan
from meshtrain.plan.memory.activations import ActivationProfile
from meshtrain.plan.options import SCHEDULE_KINDS, SCHEDULES, Pipeline, PlanOptions
from meshtrain.plan.pipeline.stages import Stage, split_stages, units_of
from meshtrain.spec.mesh import Mesh

__all__ = [
    "SCHEDULES",
    "Pipeline",
    "bubble_fraction",
    "check_pipeline_axis",
    "frozen_crossings",
    "plan_pipeline",
    "stage_ranks",
]

# Relative cost of the schedule's actions for the bubble estimate: forward 1, full backward 2,
# its input- and weight-gradient halves 1 each (an overlapped forward+backward: the sum).
_COST = {"F": 1, "B": 2, "I": 1, "W": 1}


def stage_ranks(schedule: str, pp_size: int, stages_per_rank: int) -> tuple[int, ...]:
    """Pipeline rank of every stage, as the schedule places them (see the module table)."""
    n_stages = pp_size * stages_per_rank
    if SCHEDULE_KINDS[schedule][0] == "v":
        return tuple(s if s < pp_size else n_stages - 1 - s for s in range(n_stages))
    return tuple(s % pp_size for s in range(n_stages))


def plan_pipeline(
    model: nn.Module,
    mesh: Mesh,
    pipeline: Pipeline,
    options: PlanOptions,
    *,
    seq_shards: int = 1,
    resharded: bool = False,
    param_bytes: dict[str, int] | None = None,
    activations: ActivationProfile | None = None,
    checkpointed: Sequence[str] = (),
    trainable: Mapping[str, bool] | None = None,
) -> PipelinePlan:
    """Check ``pipeline`` against ``model`` and ``mesh`` and lay it out (see the module docstring).

    ``options.microbatches`` must already be the pipeline's; ``seq_shards`` is how many ways the
    activations crossing stages are split along the sequence (the tensor-parallel size under
    sequence parallelism). ``resharded``: FSDP reshards parameters after forward (the units'
    decision under zero=3, :func:`~meshtrain.plan.decisions.fsdp_decisions`).
    ``param_bytes``: each parameter's bytes per rank at rest (0 for those not given).
    ``activations``: the traced activation profile (stage activations are then its blocks' peak
    under ``options.activation_checkpointing`` for ``checkpointed``; without it, 34·s·b·h bytes
    per block at 2-byte activations, after Korthikanti et al.).
    ``trainable``: whether each parameter requires a gradient (default: every one); no gradient
    is sent back across the stage boundaries before the first stage that trains
    (:func:`frozen_crossings`).
    """
    _check_schedule(pipeline, options, resharded=resharded)
    check_pipeline_axis(mesh, pipeline)
    pp_size = _pipeline_size(mesh, pipeline)
    n_stages = pp_size * pipeline.stages_per_rank
    micro = options.microbatches
    order = schedule_order(pipeline.schedule, pp_size, micro, pipeline.stages_per_rank)
    tasks = _tasks(order, n_stages)
    stages = split_stages(model, n_stages, split=pipeline.split)
    units = units_of(model, pipeline.split)
    params_of = _stage_params(model, stages)
    ranks = stage_ranks(pipeline.schedule, pp_size, pipeline.stages_per_rank)
    width = _hidden_width(model)
    boundary = _boundary_bytes(options, width, seq_shards)
    stage_plans = _stage_plans(
        stages,
        ranks,
        params_of,
        _peak_in_flight(tasks, n_stages),
        resharded_gathers(order),
        options,
        param_bytes=param_bytes or {},
        activations=activations,
        checkpointed=checkpointed,
        block_bytes=34 * boundary // 2,
    )
    stage_params = [params_of[s] for s in range(n_stages)]
    _check_frozen_start(pipeline.schedule, stage_params, trainable or {})
    frozen = frozen_crossings(ranks, stage_params, trainable or {})
    sends = micro * _sends_per_microbatch(ranks, frozen)
    return PipelinePlan(
        axis=pipeline.axis,
        schedule=pipeline.schedule,
        microbatches=micro,
        stages_per_rank=pipeline.stages_per_rank,
        split=pipeline.split,
        stages=stage_plans,
        bubble_fraction=_bubble_fraction(tasks),
        p2p_count=sends,
        p2p_bytes=sends * boundary,
        activation_width=width,
        frozen_crossings=frozen,
        container=units.container,
        before=units.before,
        after=units.after,
    )


def _boundary_bytes(options: PlanOptions, width: int, seq_shards: int) -> int:
    """Bytes of one micro-batch's activation crossing a stage boundary (0 without a batch
    shape): its tokens, split ``seq_shards`` ways along the sequence, ``width`` wide."""
    tokens = (options.batch_size or 0) * (options.seq_len or 0)
    return tokens // seq_shards * width * getattr(torch, options.param_dtype).itemsize


def _sends_per_microbatch(ranks: Sequence[int], frozen: int) -> int:
    """Point-to-point sends of one micro-batch: its activations across every boundary between
    ranks, their gradients back across those past the ``frozen`` first ones."""
    crossings = sum(ranks[s] != ranks[s + 1] for s in range(len(ranks) - 1))
    return 2 * crossings - frozen


def _check_schedule(pipeline: Pipeline, options: PlanOptions, *, resharded: bool) -> None:
    """What torch 2.13 cannot run under a schedule that splits backward in two passes:
    parameters resharded after forward, and selective activation checkpointing."""
    if resharded and pipeline.splits_backward:
        raise PlanError(
            f"zero=3 with schedule {pipeline.schedule!r}: the schedule splits backward into "
            "input- and weight-gradient passes, and with parameters resharded after forward "
            "torch 2.13's FSDP2 loses weight gradients (measured: the last stage's blocks get "
            "none). Use zero=2 (parameters stay gathered from forward to backward, the usual "
            "choice under pipelining) or a schedule without split backward (GPipe, 1F1B, "
            "Interleaved1F1B, LoopedBFS)."
        )
    if pipeline.splits_backward and options.activation_checkpointing == "selective":
        raise PlanError(
            f"selective activation checkpointing with schedule {pipeline.schedule!r}: the "
            "schedule runs backward in two passes (input gradients, then weight gradients), and "
            "torch 2.13's selective checkpoint frees what it kept after the first ('Trying to "
            "backward an extra time'). Use activation_checkpointing='full' or 'none', or a "
            "schedule without split backward (GPipe, 1F1B, Interleaved1F1B, LoopedBFS)."
        )


def _pipeline_size(mesh: Mesh, pipeline: Pipeline) -> int:
    """The pipeline axis's size, at least 2."""
    axis = pipeline.axis
    pp_size = mesh.size(axis)
    if pp_size < 2:
        raise PlanError(
            f"pipeline axis '{axis}' has size {pp_size} on mesh {mesh}: schedule "
            f"{pipeline.schedule!r} needs at least 2 pipeline ranks (with one, every stage runs on "
            f"the same rank and the schedule only adds bubbles). Make '{axis}' ≥ 2 or drop "
            "pipeline=.",
            mesh=mesh,
        )
    return pp_size


def _stage_plans(
    stages: Sequence[Stage],
    ranks: Sequence[int],
    params_of: Mapping[int, tuple[str, ...]],
    in_flight: Sequence[int],
    gathers: Mapping[int, tuple[int, int]],
    options: PlanOptions,
    *,
    param_bytes: Mapping[str, int],
    activations: ActivationProfile | None,
    checkpointed: Sequence[str],
    block_bytes: int,
) -> tuple[StagePlan, ...]:
    """Each stage's rank, modules, parameters and their bytes, the micro-batches it holds at
    once and their activations (traced, or ``block_bytes`` per block and micro-batch)."""
    return tuple(
        StagePlan(
            index=stage.index,
            rank=ranks[stage.index],
            modules=stage.modules,
            params=params_of[stage.index],
            param_bytes=sum(param_bytes.get(fqn, 0) for fqn in params_of[stage.index]),
            in_flight=in_flight[stage.index],
            zero3_gathers=gathers.get(stage.index, (1, 1)),
            activation_bytes=(
                activations.peak(
                    options.activation_checkpointing,
                    checkpointed,
                    stage.blocks,
                    in_flight[stage.index],
                )
                if activations is not None
                else in_flight[stage.index] * len(stage.blocks) * block_bytes
            ),
        )
        for stage in stages
    )


def frozen_crossings(
    ranks: Sequence[int], params: Sequence[Sequence[str]], trainable: Mapping[str, bool]
) -> int:
    """How many stage boundaries between different ranks no gradient crosses, given each stage's
    rank and parameter FQNs in stage order and whether each parameter trains (default yes).

    Autograd computes the gradient of a stage's input only when its received activation requires
    one, i.e. when some earlier stage holds a trainable parameter: the boundaries before the
    first stage that trains carry activations forward but no gradient back (torch's
    ``PipelineStage`` sends none, in every schedule). A frozen stage after a trainable one still
    sends its input's gradient back.

    Example:
        >>> stages = [("embed", "layers.0.w"), ("layers.1.w", "layers.1.lora_A"), ("head",)]
        >>> frozen = {"embed": False, "layers.0.w": False, "layers.1.w": False, "head": False}
        >>> frozen_crossings([0, 1, 0], stages, frozen)  # stage 1 trains (its adapter)
        1
        >>> frozen_crossings([0, 1, 0], stages, {})  # everything trains
        0
    """
    first = _first_trained(params, trainable)
    return sum(ranks[s] != ranks[s + 1] for s in range(min(first, len(ranks) - 1)))


def _first_trained(params: Sequence[Sequence[str]], trainable: Mapping[str, bool]) -> int:
    """The first stage holding a trainable parameter (the stage count when none does)."""
    return next(
        (s for s, names in enumerate(params) if any(trainable.get(f, True) for f in names)),
        len(params),
    )


#: Schedules whose weight-gradient step skips a stage whose input needs no gradient unless it is
#: stage 0 (torch 2.13's ``backward_weight_one_chunk``): its parameters would get no gradient.
_FIRST_STAGE_MUST_TRAIN = ("InterleavedZeroBubble", "ZBVZeroBubble")


def _check_frozen_start(
    schedule: str, params: Sequence[Sequence[str]], trainable: Mapping[str, bool]
) -> None:
    first = _first_trained(params, trainable)
    if schedule in _FIRST_STAGE_MUST_TRAIN and 0 < first < len(params):
        raise PlanError(
            f"schedule {schedule!r} with stage {first} the first to train (stages 0–{first - 1} "
            "hold only frozen parameters, e.g. a LoRA base): in torch 2.13 its weight-gradient "
            f"step leaves the parameters of such a stage without gradients (e.g. "
            f"{_trained_example(params[first], trainable)!r}), silently. Use '1F1B', "
            "'Interleaved1F1B' or 'DualPipeV', or train a parameter of stage 0 too.",
            rule=schedule,
        )


def _trained_example(names: Sequence[str], trainable: Mapping[str, bool]) -> str:
    return next(name for name in names if trainable.get(name, True))


def bubble_fraction(schedule: str, pp_size: int, microbatches: int, stages_per_rank: int) -> float:
    """The schedule's idle share of rank time (see ``_bubble_fraction``), without a model.

    Example:
        >>> round(bubble_fraction("1F1B", 4, 8, 1), 3)  # (P-1)/(M+P-1)
        0.273
    """
    order = schedule_order(schedule, pp_size, microbatches, stages_per_rank)
    return _bubble_fraction(_tasks(order, pp_size * stages_per_rank))


def check_pipeline_axis(mesh: Mesh, pipeline: Pipeline) -> None:
    """The pipeline's axis must be one of the mesh's."""
    if pipeline.axis not in mesh.axis_names:
        raise PlanError(
            f"pipeline axis '{pipeline.axis}' is not an axis of mesh {mesh}; add it "
            f"(mt.make_mesh({pipeline.axis}=2, ...)) or name an existing axis in "
            "Pipeline(axis=...).",
            mesh=mesh,
        )


class _StandIn:
    """What a schedule's constructor reads from its stages, without a module or process group."""

    def __init__(self, index: int, n_stages: int, pp_size: int) -> None:
        self.stage_index, self.num_stages = index, n_stages
        self.group_rank, self.group_size = 0, pp_size
        self.is_first, self.is_last = index == 0, index == n_stages - 1
        self.submod = None
        self.has_backward = False
        self.stage_index_to_group_rank: dict[int, int] = {}


Part = tuple[str, int, int]  # (kind F/B/I/W, stage, micro-batch)


def schedule_order(
    schedule: str, pp_size: int, microbatches: int, stages_per_rank: int
) -> dict[int, list[tuple[Part, ...]]]:
    """Per pipeline rank, the compute actions the schedule runs in order (an overlapped
    forward+backward is one action of two parts), or a PlanError when torch rejects the setup.

    Multi-stage schedules run torch's own action order (built from stand-in stages); the
    single-stage ones (GPipe, 1F1B) follow their fixed loops.
    """
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

    cls = get_schedule_class(schedule)
    n_stages = pp_size * stages_per_rank
    single = issubclass(cls, PipelineScheduleSingle)
    stand_ins: Any = (
        _StandIn(0, n_stages, pp_size)
        if single
        else [_StandIn(i, n_stages, pp_size) for i in range(stages_per_rank)]
    )
    try:
        instance = cls(stand_ins, microbatches)
    except ValueError as err:
        raise PlanError(
            f"schedule {schedule!r} with {pp_size} pipeline ranks × {stages_per_rank} stages per "
            f"rank ({n_stages} stages) cannot run microbatches={microbatches}: {err} "
            f"{_microbatch_fix(schedule, pp_size, n_stages)}"
        ) from None
    if single:
        return {
            rank: _single_order(schedule, rank, pp_size, microbatches) for rank in range(pp_size)
        }
    order: dict[int, list[tuple[Part, ...]]] = {}
    for rank, actions in instance.pipeline_order.items():
        order[rank] = [
            tuple(
                (part.computation_type.value, part.stage_index, part.microbatch_index or 0)
                for part in (action.sub_actions or (action,))
            )
            for action in actions
            if action is not None and (action.sub_actions or action.computation_type.value in _COST)
        ]
    return order


def resharded_gathers(order: dict[int, list[tuple[Part, ...]]]) -> dict[int, tuple[int, int]]:
    """Per stage, how often its blocks are all-gathered in forward and in backward under ZeRO-3,
    given the schedule's action order (:func:`schedule_order`).

    Inside a schedule FSDP2 reshards a stage's blocks after every forward
    (``reshard_after_forward``) but not after a backward other than the stage's last one
    (torch's ``PipelineStage`` turns ``reshard_after_backward`` off until then): an action finds
    the blocks gathered exactly when the stage's previous action was a backward.

    Example:
        >>> resharded_gathers(schedule_order("1F1B", 2, 4, 1))  # stage 0: F F B F B F B B
        {0: (2, 3), 1: (1, 4)}
    """
    gathered: dict[int, bool] = {}
    counts: dict[int, list[int]] = {}
    for actions in order.values():
        for parts in actions:
            for kind, stage, _ in parts:
                row = counts.setdefault(stage, [0, 0])
                if kind == "F":
                    row[0] += not gathered.get(stage, False)
                    gathered[stage] = False
                elif kind in ("B", "I"):
                    row[1] += not gathered.get(stage, False)
                    gathered[stage] = True
    return {stage: (f, b) for stage, (f, b) in sorted(counts.items())}


def _single_order(schedule: str, rank: int, pp_size: int, micro: int) -> list[tuple[Part, ...]]:
    forwards: list[tuple[Part, ...]] = [(("F", rank, m),) for m in range(micro)]
    backwards: list[tuple[Part, ...]] = [(("B", rank, m),) for m in range(micro)]
    if schedule == "GPipe":
        return forwards + backwards
    warmup = min(micro, pp_size - rank)  # then one backward, one forward, ...
    order = forwards[:warmup]
    for m in range(micro):
        order.append(backwards[m])
        if warmup + m < micro:
            order.append(forwards[warmup + m])
    return order


def _microbatch_fix(schedule: str, pp_size: int, n_stages: int) -> str:
    if schedule in ("1F1B", "DualPipeV"):
        return f"Use microbatches ≥ {n_stages} (one per stage at least)."
    return f"Use a multiple of {pp_size} micro-batches (the pipeline size)."


@dataclass(frozen=True)
class _Task:
    """One entry of a rank's action order: its cost, what it completes and what it waits for."""

    cost: int
    completes: tuple[tuple[str, int, int], ...]
    needs: tuple[tuple[str, int, int], ...]


def _tasks(order: dict[int, list[tuple[Part, ...]]], n_stages: int) -> dict[int, list[_Task]]:
    """Actions per rank as tasks; "I"/"W" stand for the input-/weight-gradient halves (a full
    backward completes both)."""
    result: dict[int, list[_Task]] = {}
    for rank, actions in order.items():
        tasks = []
        for parts in actions:
            completes: list[Part] = []
            needs: list[Part] = []
            for kind, stage, micro in parts:
                if kind == "F":
                    completes.append(("F", stage, micro))
                    needs += [("F", stage - 1, micro)] if stage > 0 else []
                elif kind in ("B", "I"):
                    completes += [("I", stage, micro)] + (
                        [("W", stage, micro)] if kind == "B" else []
                    )
                    needs.append(("F", stage, micro))
                    needs += [("I", stage + 1, micro)] if stage < n_stages - 1 else []
                else:
                    completes.append(("W", stage, micro))
                    needs.append(("I", stage, micro))
            own = set(completes)
            cost = sum(_COST[kind] for kind, _, _ in parts)
            tasks.append(_Task(cost, tuple(completes), tuple(n for n in needs if n not in own)))
        result[rank] = tasks
    return result


def _bubble_fraction(tasks: dict[int, list[_Task]]) -> float:
    """Idle share of the ranks' time when every rank runs torch's action order with unit costs.

    Forward 1, full backward 2 (its input/weight halves 1 each), overlapped forward+backward 3,
    communication free: for GPipe and 1F1B this gives (P−1)/(M+P−1).
    """
    done: dict[tuple[str, int, int], int] = {}
    clock = dict.fromkeys(tasks, 0)
    position = dict.fromkeys(tasks, 0)
    remaining = sum(len(queue) for queue in tasks.values())
    while remaining:
        progressed = False
        for rank, queue in tasks.items():
            while position[rank] < len(queue):
                task = queue[position[rank]]
                if any(need not in done for need in task.needs):
                    break
                clock[rank] = max([clock[rank], *(done[n] for n in task.needs)]) + task.cost
                done.update(dict.fromkeys(task.completes, clock[rank]))
                position[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise PlanError("the schedule's action order deadlocks in simulation.")
    busy = sum(task.cost for queue in tasks.values() for task in queue)
    makespan = max(clock.values())
    return 1.0 - busy / (len(tasks) * makespan) if makespan else 0.0


def _peak_in_flight(tasks: dict[int, list[_Task]], n_stages: int) -> list[int]:
    """Per stage, the most micro-batches whose activations it holds at once (forward done,
    weight gradient not yet)."""
    peak = [0] * n_stages
    for queue in tasks.values():
        live = [0] * n_stages
        for task in queue:
            for kind, stage, _ in task.completes:
                if kind == "F":
                    live[stage] += 1
                    peak[stage] = max(peak[stage], live[stage])
                elif kind == "W":
                    live[stage] -= 1
    return peak


def _stage_params(model: nn.Module, stages: Sequence[Any]) -> dict[int, tuple[str, ...]]:
    """Parameter FQNs per stage index (a tied parameter under its first name); weights tied
    across stages are a PlanError."""
    stage_of = {fqn: stage.index for stage in stages for fqn in stage.modules}
    first: dict[int, tuple[str, int]] = {}
    params: dict[int, list[str]] = {stage.index: [] for stage in stages}
    for fqn, param in model.named_parameters(remove_duplicate=False):
        index = stage_of[_unit_of(fqn, stage_of)]
        if id(param) not in first:
            first[id(param)] = (fqn, index)
            params[index].append(fqn)
        elif first[id(param)][1] != index:
            raise PlanError(
                f"parameter '{fqn}' is the same tensor as '{first[id(param)][0]}' (tied "
                f"weights), but the pipeline puts them on stages {first[id(param)][1]} and "
                f"{index}: tied weights across stages would need their gradients summed between "
                "stages. Untie them, or keep both modules on one stage (split=...).",
                fqn=fqn,
            )
    return {index: tuple(names) for index, names in params.items()}


def _unit_of(fqn: str, stage_of: dict[str, int]) -> str:
    parts = fqn.split(".")
    for end in range(len(parts), 0, -1):
        prefix = ".".join(parts[:end])
        if prefix in stage_of:
            return prefix
    raise PlanError(
        f"parameter '{fqn}' belongs to no pipeline stage: pipelining keeps the root's "
        "parameterised children and the repeated blocks; move root-level parameters into a "
        "submodule.",
        fqn=fqn,
    )


def _hidden_width(model: nn.Module) -> int:
    """Width of the activations between blocks: the first embedding's dim (0 when none)."""
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            return module.embedding_dim
    return 0
