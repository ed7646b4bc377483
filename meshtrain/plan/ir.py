"""The plan as plain data: per-parameter layouts, tensor-parallel styles, FSDP units, memory and
the collectives a step issues. Frozen, printable (``explain``), and JSON round-trippable.

Example:
    >>> import torch, meshtrain as mt
    >>> from meshtrain.models import LlamaConfig, build_llama, default_rules
    >>> model = build_llama(LlamaConfig.debug(), device="meta")
    >>> mesh = mt.make_mesh(dp=2, tp=2, world_size=4, abstract=True)
    >>> plan = mt.plan(model, mesh, default_rules())
    >>> Plan.from_json(plan.to_json()) == plan
    True
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from meshtrain.adapters.nf4 import nf4_bytes
from meshtrain.errors import PlanError, format_shape
from meshtrain.plan.codec import (
    NESTED,
    PLAIN,
    STRINGS,
    UNSHOWN,
    Codec,
    Section,
    from_data,
    json_field,
    methods,
    record,
    records,
    report,
    to_data,
)
from meshtrain.plan.decisions import FSDPDecisions, fsdp_decisions, pair_inputs_shared
from meshtrain.plan.options import PlanOptions
from meshtrain.spec.mesh import Mesh
from meshtrain.spec.partition import P
from meshtrain.spec.rules import AxisTarget


@dataclass(frozen=True)
class ParamLayout:
    """One parameter: its compute layout (``spec``), its data-parallel shard, and bytes per rank.

    ``local_shape`` is what forward sees on a rank (tensor-parallel shard); ``shard_shape`` is the
    slice FSDP keeps at rest (dim 0 of the local shape split over the sharding data axes, padded
    as FSDP2 pads). ``trainable``: the parameter requires a gradient (a frozen one has no
    gradient, no optimizer state and no gradient collective); ``storage``: "nf4" for a 4-bit
    NormalFloat weight (QLoRA's base), counted with :func:`~meshtrain.adapters.nf4_bytes`.
    """

    fqn: str
    shape: tuple[int, ...]
    spec: P
    source: str
    local_shape: tuple[int, ...]
    shard_shape: tuple[int, ...]
    element_bytes: int = 4
    trainable: bool = True
    storage: str = ""

    @property
    def local_numel(self) -> int:
        return math.prod(self.local_shape)

    @property
    def shard_numel(self) -> int:
        return math.prod(self.shard_shape)

    @property
    def bytes_at_rest(self) -> int:
        """Bytes of this parameter's master copy a rank keeps between steps: its data-parallel
        shard under zero ≥ 1 (``shard_shape`` is the local shape otherwise)."""
        return self.bytes_of(self.shard_numel)

    def bytes_of(self, numel: int) -> int:
        """Bytes ``numel`` of this parameter's elements take in its storage."""
        return nf4_bytes(numel) if self.storage == "nf4" else numel * self.element_bytes


class TPStyle(str, enum.Enum):
    """The tensor-parallel styles a module can lower to: a closed set. Each has one cost function
    (``meshtrain.plan.tensor.cost.TP_COSTS``) and one lowering (``meshtrain.lower.tensor.parallel``);
    its value is the name the plan's JSON, ``explain()`` and its ``repr`` print.

    Example:
        >>> TPStyle("colwise") is TPStyle.COLWISE, f"{TPStyle.COLWISE}", TPStyle.COLWISE == "colwise"
        (True, 'colwise', True)
        >>> TPStyle.COLWISE
        'colwise'
    """

    COLWISE = "colwise"  # a Linear's output features sharded, its output kept sharded for a pair
    ROWWISE = "rowwise"  # a Linear's input features sharded, partial sums reduced
    ROWWISE_REPLICATED_INPUT = "rowwise_replicated_input"  # row-wise, its input sliced locally
    COLWISE_GATHERED = "colwise_gathered"  # column-wise, its output all-gathered
    LOSS_PARALLEL_HEAD = "loss_parallel_head"  # the head, logits kept vocab-sharded
    VOCAB_PARALLEL_EMBEDDING = "vocab_parallel_embedding"  # an embedding sharded on the vocab
    EMBEDDING_DIM_PARALLEL = "embedding_dim_parallel"  # an embedding sharded on its width
    PREPARE_INPUT = "prepare_input"  # a pair parent: its input marked once for its children
    SEQUENCE_PARALLEL = "sequence_parallel"  # a norm on sequence shards
    SEQUENCE_SPLIT = "sequence_split"  # a replicated embedding's output sliced to sequence shards
    SEQUENCE_SPLIT_INPUT = "sequence_split_input"  # the first block's input sliced to shards
    SEQUENCE_GATHERED = "sequence_gathered"  # a block run whole: input gathered, output sliced
    SEQUENCE_GATHERED_TAIL = "sequence_gathered_tail"  # the model's tail on the whole sequence
    EXPERTS_TENSOR_PARALLEL = "experts_tensor_parallel"  # experts split inside, outputs reduced

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    def __repr__(self) -> str:  # prints as the string it replaces (in a ModuleStyle, a dict)
        return repr(self.value)


#: styles whose module runs on the whole sequence under sequence parallelism (inside them
#: activations are not sequence shards)
WHOLE_SEQUENCE = frozenset({TPStyle.SEQUENCE_GATHERED, TPStyle.SEQUENCE_GATHERED_TAIL})


@dataclass(frozen=True)
class ModuleStyle:
    """The tensor-parallel style a module lowers to, read off its parameters' specs.

    ``style`` is a :class:`TPStyle` (its string value is accepted and converted; any other is a
    :class:`~meshtrain.PlanError`). ``argument`` names the forward parameter a pair parent takes
    its activation in (it may come positionally or by that keyword); empty when the activation
    is always the first positional.
    """

    fqn: str
    module_type: str
    style: TPStyle
    axis: str
    note: str = ""
    argument: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.style, TPStyle):
            try:
                object.__setattr__(self, "style", TPStyle(self.style))
            except ValueError:
                raise PlanError(
                    f"module '{self.fqn}' has tensor-parallel style {self.style!r}, which is not "
                    f"one of {[s.value for s in TPStyle]}. Plan the model again with this "
                    "meshtrain.",
                    fqn=self.fqn,
                ) from None


@dataclass(frozen=True)
class FSDPUnit:
    """A module wrapped by ``fully_shard`` (or ``replicate``), the parameters it owns (not those
    of inner units) and what the ZeRO stage decided for it
    (:func:`~meshtrain.plan.decisions.fsdp_decisions`; a unit built without them gets zero=3's,
    the default stage's)."""

    fqn: str
    params: tuple[str, ...]
    decisions: FSDPDecisions = None  # type: ignore[assignment]  # filled in below

    def __post_init__(self) -> None:
        if self.decisions is None:
            object.__setattr__(self, "decisions", fsdp_decisions(3, root=not self.fqn))


@dataclass(frozen=True)
class PartialGrad:
    """A parameter replicated over the tensor-parallel ``axis`` whose module computes on
    activations sharded over it (dim ``dim`` of the module's first input): each rank's gradient
    is a partial sum, all-reduced over ``axis`` by the lowering. Found by the plan-time abstract
    run (:mod:`meshtrain.plan.proof.run`); ``op`` is the operation where it met the shard.

    Example:
        >>> PartialGrad("attn.q_norm.weight", "attn.q_norm", "tp", 2, "aten.mul.Tensor").axis
        'tp'
    """

    param: str
    module: str
    axis: str
    dim: int
    op: str = ""


@dataclass(frozen=True)
class ParamReader:
    """A parameter replicated over the tensor-parallel axis that module ``reader`` reads in its
    own forward although another module owns it (a tied head ``F.linear(h, embed.weight)``): the
    lowering hands ``reader`` the parameter's local tensor for its forward, as it hands the owner
    its own. Found by the plan-time abstract run (:mod:`meshtrain.plan.proof.run`).

    Example:
        >>> ParamReader("embed.weight", "").reader
        ''
    """

    param: str
    reader: str


@dataclass(frozen=True)
class ExpertGroup:
    """One experts module lowered with expert parallelism: its ``num_experts`` expert weights
    (``params``, 3-D, experts on dim 0) split over the plan's ``expert_axis`` so each rank holds
    ``local_experts`` of them, tokens dispatched to their expert's rank by all-to-all. ``top_k``:
    experts per token when the model's config says it (0 when unknown). ``tensor_axis``: the
    tensor-parallel axis that also splits each expert inside (its intermediate features), when
    the specs say so (:mod:`meshtrain.plan.experts.tensor`).

    Example:
        >>> g = ExpertGroup("layers.0.mlp.experts", 8, 4, ("layers.0.mlp.experts.down_proj",), 2)
        >>> ExpertGroup.from_json(g.to_json()) == g, g.describe()
        (True, 'layers.0.mlp.experts: 8 experts, 4 per rank, top-2, 1 parameters')
    """

    fqn: str
    num_experts: int
    local_experts: int
    params: tuple[str, ...]
    top_k: int = 0
    tensor_axis: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {**vars(self), "params": list(self.params)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ExpertGroup:
        return cls(**{**data, "params": tuple(data["params"])})

    def describe(self) -> str:
        """One line for ``Plan.explain()``."""
        top_k = f"top-{self.top_k}" if self.top_k else "top-k unknown"
        inside = f", split inside over '{self.tensor_axis}'" if self.tensor_axis else ""
        return (
            f"{self.fqn}: {self.num_experts} experts, {self.local_experts} per rank, {top_k}, "
            f"{len(self.params)} parameters{inside}"
        )


@dataclass(frozen=True)
class Collective:
    """Collectives of one kind on one axis per optimizer step, with their payload in bytes."""

    kind: str
    axis: str
    count: int
    bytes: int
    why: str


@dataclass(frozen=True)
class Memory:
    """Bytes per rank: what is held at rest between steps (master parameters, their gradients and
    optimizer states, buffers) and what lives only during a step (gathered compute copies of
    parameters, unsharded gradients before their reduce-scatter, activations under the plan's
    checkpointing mode — 0 when the plan has no batch_size/seq_len). See ``meshtrain.plan.cost``.

    Example:
        >>> Memory(params=4, grads=4, optimizer_states=8, activations=10).total
        26
    """

    params: int
    grads: int
    optimizer_states: int
    activations: int = 0
    gathered_params: int = 0
    unsharded_grads: int = 0
    buffers: int = 0

    @property
    def at_rest(self) -> int:
        """Bytes held between steps."""
        return self.params + self.grads + self.optimizer_states + self.buffers

    @property
    def transient(self) -> int:
        """Bytes that exist only while a step runs, at its peak."""
        return self.gathered_params + self.unsharded_grads + self.activations

    @property
    def total(self) -> int:
        """Peak bytes per rank: at rest + transient."""
        return self.at_rest + self.transient


@dataclass(frozen=True)
class StagePlan:
    """One pipeline stage: where it runs, the module and parameter FQNs it keeps, its parameters'
    bytes per rank at rest, and the most micro-batches whose activations it holds at once under
    the schedule (with their estimated bytes: 0 when the plan has no ``batch_size``/``seq_len``)."""

    index: int
    rank: int
    modules: tuple[str, ...]
    params: tuple[str, ...]
    param_bytes: int
    in_flight: int
    activation_bytes: int
    zero3_gathers: tuple[int, int] = (1, 1)  # block all-gathers (forward, backward) under ZeRO-3


@dataclass(frozen=True)
class PipelinePlan:
    """A pipeline's layout and costs: stages in order, the schedule's bubble fraction (idle share
    of rank time with forward 1, backward 2 time units) and the point-to-point traffic of one step
    between neighbouring pipeline ranks (activations forward, their gradients backward).
    ``frozen_crossings``: the stage boundaries between ranks before the first stage with a
    trainable parameter, which carry activations forward but no gradient back (autograd computes
    none there). ``container`` is the FQN of the repeated blocks' ModuleList/ModuleDict,
    ``before``/``after`` the modules the first and the last stage keep around them."""

    axis: str
    schedule: str
    microbatches: int
    stages_per_rank: int
    split: str | tuple[str, ...]
    stages: tuple[StagePlan, ...]
    bubble_fraction: float
    p2p_count: int
    p2p_bytes: int
    activation_width: int
    container: str = ""
    before: tuple[str, ...] = ()
    after: tuple[str, ...] = ()
    frozen_crossings: int = 0

    def local_stages(self, pp_rank: int) -> tuple[StagePlan, ...]:
        """The stages pipeline rank ``pp_rank`` runs, in stage order."""
        return tuple(stage for stage in self.stages if stage.rank == pp_rank)

    def explain_lines(self) -> list[str]:
        """The pipeline section of ``Plan.explain()``."""
        lines = [
            f"pipeline over '{self.axis}': {self.schedule}, {len(self.stages)} stages "
            f"({self.stages_per_rank} per rank), {self.microbatches} micro-batches per step, "
            f"bubble fraction {self.bubble_fraction:.3f}",
            "  stage  rank  params (B/rank)  in-flight  activations B  modules",
        ]
        for s in self.stages:
            shown = (
                ", ".join(s.modules)
                if len(s.modules) <= 6
                else (f"{', '.join(s.modules[:3])}, …, {', '.join(s.modules[-2:])}")
            )
            lines.append(
                f"  {s.index:>5}  {s.rank:>4}  {s.param_bytes:>15,}  {s.in_flight:>9}  "
                f"{s.activation_bytes:>13,}  {shown}"
            )
        sized = "" if self.p2p_bytes else " (give batch_size and seq_len to size them)"
        what = "activations forward, their gradients backward"
        if self.frozen_crossings:
            crossings = sum(a.rank != b.rank for a, b in zip(self.stages, self.stages[1:]))
            frozen = self.frozen_crossings
            what = (
                f"activations forward across {crossings} rank boundar"
                f"{'y' if crossings == 1 else 'ies'}, their gradients backward across "
                f"{crossings - frozen}: "
                + (
                    "the first has no trainable parameter before it"
                    if frozen == 1
                    else f"the first {frozen} have no trainable parameter before them"
                )
            )
        lines.append(
            f"  point-to-point per step: {self.p2p_count} sends of {self.p2p_bytes:,} B in total"
            f" ({what}){sized}"
        )
        return lines


def _mesh_data(mesh: Mesh) -> dict[str, Any]:
    return {
        "axes": [[name, size] for name, size in mesh.shape.items()],
        "device_type": mesh.device_type,
    }


def _mesh_from_data(data: dict[str, Any], _: Mapping[str, Any]) -> Mesh:
    axes = dict(data["axes"])  # [name, size] pairs: JSON keeps their order
    return Mesh(tuple(axes), tuple(axes.values()), data["device_type"])


def _param_data(p: ParamLayout) -> dict[str, Any]:
    return {
        "fqn": p.fqn,
        "shape": list(p.shape),
        "spec": p.spec.to_json(),
        "source": p.source,
        "local_shape": list(p.local_shape),
        "shard_shape": list(p.shard_shape),
        "element_bytes": p.element_bytes,
        "trainable": p.trainable,
        "storage": p.storage,
    }


def _param_from_data(p: dict[str, Any]) -> ParamLayout:
    return ParamLayout(
        fqn=p["fqn"],
        shape=tuple(p["shape"]),
        spec=P.from_json(p["spec"]),
        source=p["source"],
        local_shape=tuple(p["local_shape"]),
        shard_shape=tuple(p["shard_shape"]),
        element_bytes=p["element_bytes"],
        trainable=p.get("trainable", True),
        storage=p.get("storage", ""),
    )


def _unit_data(u: FSDPUnit) -> dict[str, Any]:
    return {"fqn": u.fqn, "params": list(u.params), "decisions": u.decisions.to_json()}


_MESH = Codec(_mesh_data, _mesh_from_data)
_PARAMS = Codec(
    lambda params: [_param_data(p) for p in params],
    lambda data, _: tuple(_param_from_data(p) for p in data),
)
_UNITS = Codec(
    lambda units: [_unit_data(u) for u in units],
    lambda data, decoded: tuple(_unit_from_data(u, decoded["options"]) for u in data),
)
_RULES = Codec(
    lambda rules: [[name, target] for name, target in rules],
    lambda data, _: tuple(
        (name, tuple(target) if isinstance(target, list) else target) for name, target in data
    ),
)
_PIPELINE = Codec(
    lambda pipeline: None if pipeline is None else _pipeline_data(pipeline),
    lambda data, _: _pipeline_from_data(data),
)
_OMITTED_STRINGS = dataclasses.replace(STRINGS, omit_empty=True)
_OMITTED_NESTED = dataclasses.replace(NESTED, omit_empty=True)


# The report's sections (``Plan.explain()``): each field below names the one that shows it.


def _header(plan: Plan) -> list[str]:
    options = plan.options
    return [
        f"plan on mesh {plan.mesh}: data axes {list(plan.data_axes)}, tensor-parallel axis "
        f"{plan.tp_axis!r}{' with sequence parallelism' if plan.sequence_parallel else ''}, "
        f"zero={options.zero}, precision={options.precision}, "
        f"offload={options.offload}, offload_optimizer={options.offload_optimizer}, "
        "data-parallel gradients "
        f"{'summed' if options.grad_reduction == 'sum' else 'averaged'}"
    ]


def _params(plan: Plan) -> list[str]:
    return [
        "parameters (fqn, global shape, spec, local shape, data-parallel shard, bytes/rank at rest):",
        *_param_lines(plan.params),
    ]


def _styles(plan: Plan) -> list[str]:
    return ["tensor-parallel styles:"] + (
        [
            f"  {s.fqn}: {s.style} over '{s.axis}' ({s.module_type}){' — ' + s.note if s.note else ''}"
            for s in plan.styles
        ]
        or ["  none"]
    )


def _units(plan: Plan) -> list[str]:
    units = [f"  {u.fqn or '<root>'}: {len(u.params)} parameters" for u in plan.units]
    return [
        "FSDP units (fully_shard order, root last):",
        *(units or ["  none"]),
        *_decision_lines(plan.units),
    ]


def _compute(plan: Plan) -> list[str]:
    options = plan.options
    mode = options.activation_checkpointing
    lines = ["compute:"]
    if mode == "none":
        lines.append("  activation checkpointing: none")
    else:
        every = f", every {options.checkpoint_every}" if options.checkpoint_every > 1 else ""
        lines.append(
            f"  activation checkpointing: {mode} on {len(plan.checkpointed)} of "
            f"{len(plan.blocks)} blocks{every}"
            + (" (keeps matmul and attention outputs)" if mode == "selective" else "")
        )
    if plan.activation_estimates:
        shown = ", ".join(f"{name} {value:,} B" for name, value in plan.activation_estimates)
        lines.append(f"  activations per rank per micro-batch by mode: {shown}")
    lines.append(_compile_line(plan))
    lines.append(_precision_line(plan))
    return lines


def _compile_line(plan: Plan) -> str:
    if plan.compile_scope is None:
        return "  torch.compile: off"
    what = (
        f"each of {len(plan.blocks)} blocks and the loss"
        if plan.compile_scope == "block"
        else "the whole model (each pipeline stage) and the loss"
    )
    return (
        f"  torch.compile: {what}, backend {plan.options.compile_backend!r}, "
        f"fullgraph={plan.options.compile_fullgraph}; order: tensor parallel → checkpointing "
        "→ compile → FSDP2"
    )


def _precision_line(plan: Plan) -> str:
    options = plan.options
    if options.precision == "fp32":
        return "  precision: fp32 throughout"
    carrier = f" (FSDP2 over size-1 axes {list(plan.cast_axes)})" if plan.cast_axes else ""
    scaling = "; fp16 needs dynamic loss scaling (mt.train.LossScaler)"
    return (
        f"  precision: parameters cast to {options.param_dtype} per unit for compute, fp32 "
        f"master weights and optimizer, gradients reduced in {options.reduce_dtype}"
        f"{carrier}{scaling if options.precision == 'fp16' else ''}"
    )


def _memory(plan: Plan) -> list[str]:
    m = plan.memory
    return [
        f"memory per rank at rest: params {m.params:,} B, grads {m.grads:,} B, optimizer "
        f"states {m.optimizer_states:,} B, buffers {m.buffers:,} B",
        f"  during a step: gathered params {m.gathered_params:,} B, unsharded grads "
        f"{m.unsharded_grads:,} B, activations {m.activations:,} B; peak total {m.total:,} B",
    ]


def _collectives(plan: Plan) -> list[str]:
    rows = [
        f"  {c.kind:<14} {c.axis:<8} {c.count:>4} × {c.bytes:>12,} B  {c.why}"
        for c in plan.collectives
    ]
    return ["collectives per step (kind, axis, count, payload bytes):", *(rows or ["  none"])]


def _pipeline(plan: Plan) -> list[str]:
    return [] if plan.pipeline is None else plan.pipeline.explain_lines()


def _batch_norms(plan: Plan) -> list[str]:
    if not plan.batch_norms:
        return []
    where = "over every data-parallel rank" if plan.data_axes else "on this rank"
    return [f"BatchNorm statistics over the global batch ({where}): " + ", ".join(plan.batch_norms)]


def _partial_grads(plan: Plan) -> list[str]:
    if not plan.partial_grads:
        return []
    return [
        "partial gradients all-reduced over the tensor-parallel axis (replicated "
        "parameters computing on its shards; module, input dim sharded):",
        *(
            f"  {g.param}: over '{g.axis}' ({g.module}, dim {g.dim}, at {g.op})"
            for g in plan.partial_grads
        ),
    ]


def _readers(plan: Plan) -> list[str]:
    if not plan.readers:
        return []
    return [
        "replicated parameters read outside their module (the reader computes "
        "on their local tensors):",
        *(f"  {r.param}: read by '{r.reader or '<root>'}'" for r in plan.readers),
    ]


def _fresh_outputs(plan: Plan) -> list[str]:
    if not plan.fresh_outputs:
        return []
    return [
        "outputs updated in place by the forward (handed out as fresh tensors): "
        + ", ".join(plan.fresh_outputs)
    ]


def _averaged_buffers(plan: Plan) -> list[str]:
    if not plan.averaged_buffers:
        return []
    return [
        f"buffers written from the batch, averaged over {list(plan.token_axes)} "
        "after the forward of the module writing each:",
        *(f"  {buffer}: after '{writer or '<root>'}'" for buffer, writer in plan.averaged_buffers),
    ]


def _experts(plan: Plan) -> list[str]:
    if not plan.experts:
        return []
    return [
        f"expert parallelism over '{plan.expert_axis}' (tokens dispatched to "
        "their expert's rank by all-to-all, dropless; the batch split over "
        f"{list(plan.batch_axes)}):",
        *(f"  {group.describe()}" for group in plan.experts),
    ]


def _context(plan: Plan) -> list[str]:
    if plan.context_axis is None:
        return []
    options = plan.options
    return [
        f"context parallelism over '{plan.context_axis}' "
        f"({plan.mesh.size(plan.context_axis)} ranks per sequence, balance "
        f"{options.context_balance!r}, attention by {options.context_method!r}): "
        "parameters replicated over it, gradients and loss tokens reduced over "
        f"{list(plan.token_axes)}"
    ]


def _tied(plan: Plan) -> list[str]:
    if not plan.tied:
        return []
    return [
        "tied parameters (one tensor, one gradient, one optimizer state):",
        *(f"  {' = '.join(group)}" for group in plan.tied),
    ]


def _notes(plan: Plan) -> list[str]:
    return ["notes:", *(f"  - {note}" for note in plan.notes)] if plan.notes else []


HEADER = Section(0, _header)
PARAMS = Section(1, _params)
STYLES = Section(2, _styles)
UNITS = Section(3, _units)
COMPUTE = Section(4, _compute)
MEMORY = Section(5, _memory)
COLLECTIVES = Section(6, _collectives)
PIPELINE = Section(7, _pipeline)
BATCH_NORMS = Section(8, _batch_norms)
PARTIAL_GRADS = Section(9, _partial_grads)
READERS = Section(10, _readers)
FRESH_OUTPUTS = Section(11, _fresh_outputs)
AVERAGED_BUFFERS = Section(12, _averaged_buffers)
EXPERTS = Section(13, _experts)
CONTEXT = Section(14, _context)
TIED = Section(15, _tied)
NOTES = Section(16, _notes)


@dataclass(frozen=True)
class Plan:
    """How a model trains on a mesh, as plain data; ``mt.plan`` builds it, ``mt.apply`` lowers it.

    ``activation_rules`` are the logical-axis rules that ``mt.constrain`` resolves activation
    names with (the rules' logical part; ``("seq", tp)`` among them turns sequence parallelism on).
    ``blocks`` are the repeated blocks (checkpointing and per-block compile act on them;
    :attr:`checkpointed` are those whose activations are recomputed), ``compile_scope`` 'block', 'model'
    or None. ``cast_axes``: size-1 data axes FSDP2 is applied over only to carry the
    mixed-precision policy (no data axis larger than 1). ``activation_estimates``: peak
    activation bytes per rank for each checkpointing mode (empty without batch_size/seq_len; a
    pipeline's are its busiest rank's, with the micro-batches its stages hold at once).
    ``tied``: names that share one parameter tensor (the first is the one ``params`` lists);
    lowering keeps each group one parameter. ``batch_norms``: BatchNorm modules, which lowering
    makes compute their statistics over the global batch. ``readers``: replicated parameters read
    outside their module's forward (the lowering gives the reader local tensors);
    ``fresh_outputs``: styled modules whose output the forward updates in place (the lowering
    hands out a fresh tensor); ``averaged_buffers``: buffers the forward writes from the batch
    and the module whose forward writes each, averaged over the token axes after that forward
    (``batch_buffers="average"``).
    """

    # each field with its JSON codec and report section (meshtrain.plan.codec): to_json,
    # from_json and explain follow
    mesh: Mesh = json_field(_MESH, explain=HEADER)
    options: PlanOptions = json_field(methods(PlanOptions), explain=HEADER)
    data_axes: tuple[str, ...] = json_field(STRINGS, explain=HEADER)
    tp_axis: str | None = json_field(PLAIN, explain=HEADER)
    params: tuple[ParamLayout, ...] = json_field(_PARAMS, explain=PARAMS)
    styles: tuple[ModuleStyle, ...] = json_field(records(ModuleStyle), explain=STYLES)
    units: tuple[FSDPUnit, ...] = json_field(_UNITS, explain=UNITS)
    collectives: tuple[Collective, ...] = json_field(records(Collective), explain=COLLECTIVES)
    memory: Memory = json_field(record(Memory), explain=MEMORY)
    sequence_parallel: bool = json_field(PLAIN, explain=HEADER, default=False)
    # the logical-axis rules are the user's own input (their spec), not something planned
    activation_rules: tuple[tuple[str, AxisTarget], ...] = json_field(
        _RULES, explain=UNSHOWN, default=()
    )
    pipeline: PipelinePlan | None = json_field(_PIPELINE, explain=PIPELINE, default=None)
    notes: tuple[str, ...] = json_field(STRINGS, explain=NOTES, default=())
    blocks: tuple[str, ...] = json_field(STRINGS, explain=COMPUTE, default=())
    compile_scope: str | None = json_field(PLAIN, explain=COMPUTE, default=None)
    cast_axes: tuple[str, ...] = json_field(STRINGS, explain=COMPUTE, default=())
    activation_estimates: tuple[tuple[str, int], ...] = json_field(
        NESTED, explain=COMPUTE, default=()
    )
    tied: tuple[tuple[str, ...], ...] = json_field(NESTED, explain=TIED, default=())
    batch_norms: tuple[str, ...] = json_field(STRINGS, explain=BATCH_NORMS, default=())
    partial_grads: tuple[PartialGrad, ...] = json_field(
        records(PartialGrad), explain=PARTIAL_GRADS, default=()
    )
    expert_axis: str | None = json_field(PLAIN, explain=EXPERTS, default=None)
    experts: tuple[ExpertGroup, ...] = json_field(
        methods(ExpertGroup, many=True), explain=EXPERTS, default=()
    )
    context_axis: str | None = json_field(PLAIN, explain=CONTEXT, default=None)
    # the abstract run's findings: in the JSON only when there are some
    readers: tuple[ParamReader, ...] = json_field(
        records(ParamReader, omit_empty=True), explain=READERS, default=()
    )
    fresh_outputs: tuple[str, ...] = json_field(_OMITTED_STRINGS, explain=FRESH_OUTPUTS, default=())
    averaged_buffers: tuple[tuple[str, str], ...] = json_field(
        _OMITTED_NESTED, explain=AVERAGED_BUFFERS, default=()
    )

    @property
    def pair_inputs_shared(self) -> bool:
        """Whether tensor-parallel pair parents keep their plain input, shared by their
        column-wise Linears (:func:`~meshtrain.plan.decisions.pair_inputs_shared`): the proof
        and the lowering read this one decision."""
        return pair_inputs_shared(self.compile_scope, self.options.activation_checkpointing)

    @property
    def batch_axes(self) -> tuple[str, ...]:
        """The axes the batch is split over: the data axes, then the expert axis (expert
        parallelism is carved out of the data ranks: every rank trains its own tokens). Loss,
        token counts and the data-parallel mean reduce over them."""
        return self.data_axes + ((self.expert_axis,) if self.expert_axis else ())

    @property
    def token_axes(self) -> tuple[str, ...]:
        """The axes a step's loss tokens are spread over: the batch axes, then the context axis
        (its ranks hold chunks of the same sequences, see :mod:`meshtrain.plan.context.axis`). Token
        counts, the loss and the gradient reduction run over them; the batch rows do not split
        over the context axis."""
        return self.batch_axes + ((self.context_axis,) if self.context_axis else ())

    @property
    def specs(self) -> dict[str, P]:
        """FQN → compute spec."""
        return {param.fqn: param.spec for param in self.params}

    def collective_totals(self) -> dict[tuple[str, str], tuple[int, int]]:
        """Collectives per step by (kind, axis): their count and payload bytes, the rows of one
        kind and axis summed (the form a ``CollectiveCounter`` measures in).

        Example:
            >>> import meshtrain as mt
            >>> from meshtrain.models import LlamaConfig, build_llama
            >>> model = build_llama(LlamaConfig.debug(), device="meta")
            >>> mesh = mt.make_mesh(dp=2, world_size=2, abstract=True)
            >>> sorted(mt.plan(model, mesh, mt.Rules({".*": mt.P()}, fsdp="dp")).collective_totals())
            [('all_gather', 'dp'), ('reduce_scatter', 'dp')]
        """
        totals: dict[tuple[str, str], tuple[int, int]] = {}
        for c in self.collectives:
            count, payload = totals.get((c.kind, c.axis), (0, 0))
            totals[(c.kind, c.axis)] = (count + c.count, payload + c.bytes)
        return totals

    @property
    def checkpointed(self) -> tuple[str, ...]:
        """Blocks whose activations are recomputed in backward."""
        return self.options.checkpointed_blocks(self.blocks)

    def explain(self) -> str:
        """A human-readable report: parameters, styles, units, memory, collectives, notes (each
        field's section is declared with the field, :mod:`meshtrain.plan.codec`)."""
        return report(self)

    def to_json(self) -> str:
        """Stable JSON (sorted keys): replayable with :meth:`from_json`."""
        return json.dumps(to_data(self), sort_keys=True, indent=1)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """Inverse of :meth:`to_json` (the mesh comes back as a description: applying the plan
        binds it to the running ranks when their number matches)."""
        plan: Plan = from_data(cls, json.loads(text))
        return plan


def _param_lines(params: tuple[ParamLayout, ...]) -> list[str]:
    """The parameters section of ``Plan.explain()``, with the trainable share when some are
    frozen."""
    width = max((len(p.fqn) for p in params), default=0)
    lines = [
        f"  {p.fqn:<{width}}  {format_shape(p.shape):>12}  {p.spec!r:<22} "
        f"{format_shape(p.local_shape):>12}  {format_shape(p.shard_shape):>12}  "
        f"{p.bytes_at_rest:>10,}{'' if p.trainable else '  frozen'}"
        f"{'  ' + p.storage if p.storage else ''}"
        for p in params
    ]
    frozen = [p for p in params if not p.trainable]
    if frozen:
        trainable = sum(math.prod(p.shape) for p in params if p.trainable)
        total = sum(math.prod(p.shape) for p in params)
        lines += [
            "",
            f"trainable parameters: {trainable:,} of {total:,} "
            f"({trainable / max(total, 1):.3%}); {len(frozen)} frozen tensors get no "
            "gradient, optimizer state or gradient collective",
        ]
    return lines


def _unit_from_data(data: dict[str, Any], options: PlanOptions) -> FSDPUnit:
    """A unit from the plan's JSON; a plan written before units carried their decisions gets
    them from its options, as it was lowered then."""
    fqn = data["fqn"]
    decisions = (
        FSDPDecisions.from_json(data["decisions"])
        if "decisions" in data
        else options.unit_decisions(fqn)
    )
    return FSDPUnit(fqn, tuple(data["params"]), decisions)


def _decision_lines(units: tuple[FSDPUnit, ...]) -> list[str]:
    """What the ZeRO stage decided, one line per distinct decision and the units it holds for."""
    groups: dict[FSDPDecisions, list[str]] = {}
    for unit in units:
        groups.setdefault(unit.decisions, []).append(unit.fqn or "<root>")
    lines = []
    for decisions, names in groups.items():
        which = (
            "every unit"
            if len(names) == len(units)
            else (", ".join(names) if len(names) <= 3 else f"{len(names)} units ({names[0]}, …)")
        )
        lines.append(f"  decided for {which}: {decisions.describe()}")
    return lines


def _pipeline_from_data(data: dict[str, Any] | None) -> PipelinePlan | None:
    if data is None:
        return None
    split = data["split"]
    return PipelinePlan(
        **{
            **data,
            "split": split if isinstance(split, str) else tuple(split),
            "stages": tuple(
                StagePlan(
                    **{
                        **s,
                        "modules": tuple(s["modules"]),
                        "params": tuple(s["params"]),
                        "zero3_gathers": tuple(s["zero3_gathers"]),
                    }
                )
                for s in data["stages"]
            ),
            "before": tuple(data.get("before", ())),
            "after": tuple(data.get("after", ())),
        }
    )


def _pipeline_data(pipeline: PipelinePlan) -> dict[str, Any]:
    data = vars(pipeline).copy()
    data["split"] = pipeline.split if isinstance(pipeline.split, str) else list(pipeline.split)
    data["stages"] = [
        {**vars(s), "modules": list(s.modules), "params": list(s.params)} for s in pipeline.stages
    ]
    data["before"], data["after"] = list(pipeline.before), list(pipeline.after)
    return data
