"""Plan options: what the user asks of a plan, validated before anything is inferred.

:class:`PlanOptions` holds every choice (ZeRO stage, precision, micro-batches, pipeline,
checkpointing, compile, batch geometry); :meth:`PlanOptions.with_overrides` takes ``mt.plan``'s
keyword arguments in their friendly forms (``compile=True``, ``activation_checkpointing=
{"every": 2}``). :class:`AutoSearch` holds what ``strategy="auto"`` needs beyond them.

Example:
    >>> PlanOptions(zero=2, precision="bf16").param_dtype
    'bfloat16'
    >>> PlanOptions().with_overrides(compile={"backend": "aot_eager"}).compile_backend
    'aot_eager'
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, get_args

from meshtrain.errors import PlanError, did_you_mean
from meshtrain.plan.decisions import FSDPDecisions, fsdp_decisions
from meshtrain.plan.memory.sizes import parse_bytes

#: name → (stage → rank style, splits backward into input and weight gradients)
SCHEDULE_KINDS: dict[str, tuple[str, bool]] = {
    "GPipe": ("single", False),
    "1F1B": ("single", False),
    "Interleaved1F1B": ("loop", False),
    "LoopedBFS": ("loop", False),
    "InterleavedZeroBubble": ("loop", True),
    "ZBVZeroBubble": ("v", True),
    "DualPipeV": ("v", True),
}
SCHEDULES = tuple(SCHEDULE_KINDS)


@dataclass(frozen=True)
class Pipeline:
    """What a pipeline-parallel plan asks for (checked against the model and mesh by ``mt.plan``).

    ``microbatches`` splits each data-parallel rank's batch per step (it is the gradient
    accumulation of a pipelined plan); ``None`` means one per stage. ``split`` is ``"auto"``
    (balanced by parameter count, embedding and head included) or the FQNs of the first block of
    every stage after the first.

    Example:
        >>> Pipeline(schedule="interleaved1f1b", stages_per_rank=2).schedule
        'Interleaved1F1B'
    """

    axis: str = "pp"
    schedule: str = "1F1B"
    microbatches: int | None = None
    stages_per_rank: int = 1
    split: str | tuple[str, ...] = "auto"

    def __post_init__(self) -> None:
        names = {name.lower(): name for name in SCHEDULE_KINDS}
        if not isinstance(self.schedule, str) or self.schedule.lower() not in names:
            raise PlanError(
                f"pipeline schedule {self.schedule!r} is unknown; use one of {list(SCHEDULE_KINDS)} "
                "(torch.distributed.pipelining's schedules)."
            )
        object.__setattr__(self, "schedule", names[self.schedule.lower()])
        if not isinstance(self.split, str):
            object.__setattr__(self, "split", tuple(self.split))
        for name in ("microbatches", "stages_per_rank"):
            value = getattr(self, name)
            if value is None and name == "microbatches":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PlanError(f"Pipeline({name}={value!r}): give a positive integer.")
        style = SCHEDULE_KINDS[self.schedule][0]
        if style == "single" and self.stages_per_rank != 1:
            raise PlanError(
                f"schedule {self.schedule!r} runs one stage per rank, but stages_per_rank="
                f"{self.stages_per_rank}; use stages_per_rank=1, or a multi-stage schedule "
                "(Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble, DualPipeV)."
            )
        if style == "v" and self.stages_per_rank != 2:
            raise PlanError(
                f"schedule {self.schedule!r} places two stages per rank in a V (rank r holds "
                f"stages r and 2P-1-r), but stages_per_rank={self.stages_per_rank}; use "
                "stages_per_rank=2."
            )

    @property
    def splits_backward(self) -> bool:
        """Whether the schedule runs input- and weight-gradient halves of backward separately."""
        return SCHEDULE_KINDS[self.schedule][1]


Precision = Literal["fp32", "bf16", "fp16"]
Checkpointing = Literal["none", "full", "selective"]
CHECKPOINTING_MODES: tuple[Checkpointing, ...] = get_args(Checkpointing)
#: 0 = DDP, 1 = optimizer states sharded, 2 = gradients too, 3 = parameters too.
ZeroStage = Literal[0, 1, 2, 3]
ZERO_STAGES: tuple[ZeroStage, ...] = get_args(ZeroStage)
CompileScope = Literal["auto", "block", "model"]
GradReduction = Literal["mean", "sum"]
#: how context parallelism gives ranks their chunks ("headtail": chunks r and 2·cp-1-r of 2·cp)
ContextBalance = Literal["headtail", "contiguous"]
#: how its attention meets the other ranks' keys and values (circulated, or gathered at once)
ContextMethod = Literal["ring", "allgather"]
#: what a tensor-parallel plan does when the plan-time shard proof cannot run the model
UnprovenShards = Literal["refuse", "note"]
#: what a plan does with buffers its forward writes from the batch (refuse, or average them)
BatchBuffers = Literal["refuse", "average"]
_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
_OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd": 1, "sgd_nomomentum": 0}


@dataclass(frozen=True)
class PlanOptions:
    """Data-parallel stage, offload, precision and the optimizer the memory model assumes.

    ``batch_size`` (sequences per micro-batch per data-parallel rank) and ``seq_len`` are optional:
    given, they size the activation collectives and check sequence-parallel divisibility.

    ``zero``: 0 = DDP (replicated parameters, gradient all-reduce); 1 = optimizer states sharded
    (parameters and gradients stay whole between micro-batches, gradients reduce-scattered once per
    step); 2 = gradients sharded too (parameters kept gathered from forward to backward); 3 =
    parameters sharded as well (gathered per unit in forward and again in backward).

    ``offload``: FSDP2's CPU offload — master parameters, gradients and optimizer states on the
    host. ``offload_optimizer``: only the optimizer states on the host (the optimizer steps there,
    see :class:`meshtrain.train.HostOptimizer`); parameters and gradients stay on the device.

    ``grad_reduction``: how data-parallel gradients combine. ``"mean"`` (default) is PyTorch's
    DDP/FSDP semantics: each rank's loss is the mean over its own batch and the gradients are
    averaged, so a loop written for DDP trains as on one device unchanged. ``"sum"``: the
    gradients are summed, for a loss divided by the global token count (what
    ``mt.make_train_step`` does with either: under ``"mean"`` it scales the loss by the number
    of data-parallel ranks to compensate).

    ``context_balance`` and ``context_method``: under context parallelism (an activation rule
    ``("seq", "cp")``), which chunks of each sequence a rank holds and how its attention meets
    the other ranks' keys and values (see :mod:`meshtrain.plan.context.axis`).

    ``unproven_shards``: a tensor-parallel plan is proven while planning by running the model on
    fake tensors (:mod:`meshtrain.plan.proof.run`), which also finds the replicated parameters
    whose gradients are partial sums over the tensor-parallel axis. When that run fails on the
    model's own code, ``"refuse"`` (default) raises a PlanError naming the failure; ``"note"``
    plans anyway with a note, and any such partial gradient then trains unreduced (wrong).

    ``batch_buffers``: a buffer the forward writes from the batch (a hand-made running mean; the
    abstract run finds it) would be updated from each data-parallel rank's own rows. ``"refuse"``
    (default) raises a PlanError naming it; ``"average"`` averages it over the batch axes after
    each forward, like SyncBatchNorm's statistics (exact for a statistic linear in the batch with
    equal rows per rank, such as a running mean).
    """

    zero: int = 3
    offload: bool = False
    offload_optimizer: bool = False
    precision: Precision = "fp32"
    reduce_precision: Precision = "fp32"
    optimizer: str = "adamw"
    loss_parallel: bool = True
    microbatches: int = 1
    batch_size: int | None = None
    seq_len: int | None = None
    activation_checkpointing: Checkpointing = "none"
    checkpoint_every: int = 1
    compile: bool = False
    compile_backend: str = "inductor"
    compile_fullgraph: bool = False
    compile_scope: CompileScope = "auto"
    pipeline: Pipeline | None = None
    fsdp_units: tuple[str, ...] | None = None
    global_batch: int | None = None
    grad_reduction: GradReduction = "mean"
    context_balance: ContextBalance = "headtail"
    context_method: ContextMethod = "ring"
    unproven_shards: UnprovenShards = "refuse"
    batch_buffers: BatchBuffers = "refuse"

    def __post_init__(self) -> None:
        if self.fsdp_units is not None and not isinstance(self.fsdp_units, tuple):
            object.__setattr__(self, "fsdp_units", tuple(self.fsdp_units))
        if self.pipeline is not None and not isinstance(self.pipeline, Pipeline):
            raise PlanError(
                f"pipeline={self.pipeline!r} must be a meshtrain.Pipeline(...) or None."
            )
        if isinstance(self.zero, bool) or self.zero not in ZERO_STAGES:
            raise PlanError(
                f"zero={self.zero!r} is out of range: use 0 (DDP), 1 (optimizer states sharded), "
                "2 (gradients too) or 3 (parameters too)."
            )
        for name in ("precision", "reduce_precision"):
            value = getattr(self, name)
            if value not in _DTYPES:
                raise PlanError(f"{name}={value!r} is not one of {sorted(_DTYPES)}.")
        if self.grad_reduction not in ("mean", "sum"):
            raise PlanError(
                f"grad_reduction={self.grad_reduction!r} is not one of 'mean' (PyTorch's DDP/FSDP "
                "semantics: gradients averaged over data-parallel ranks) or 'sum' (for a loss "
                "divided by the global token count)."
            )
        _check_context_options(self.context_balance, self.context_method)
        if self.unproven_shards not in ("refuse", "note"):
            raise PlanError(
                f"unproven_shards={self.unproven_shards!r} is not one of 'refuse' "
                "(default) or 'note' (plan a tensor-parallel plan the abstract run "
                "cannot prove, with a note)."
            )
        if self.batch_buffers not in ("refuse", "average"):
            raise PlanError(
                f"batch_buffers={self.batch_buffers!r} is not one of 'refuse' "
                "(default) or 'average' (buffers written from the batch averaged over "
                "the data-parallel ranks after each forward)."
            )
        if self.optimizer not in _OPTIMIZER_STATES:
            raise PlanError(
                f"optimizer={self.optimizer!r} is unknown to the memory model; use one of "
                f"{sorted(_OPTIMIZER_STATES)} (the number of fp32 states per parameter it keeps)."
            )
        for name, meaning in (
            ("microbatches", "gradient accumulation steps per optimizer step"),
            ("batch_size", "sequences per micro-batch on each data-parallel rank"),
            ("seq_len", "tokens per sequence"),
            ("checkpoint_every", "checkpoint every k-th block"),
            ("global_batch", "sequences per optimizer step over all data-parallel ranks"),
        ):
            value = getattr(self, name)
            if value is None and name not in ("microbatches", "checkpoint_every"):
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PlanError(f"{name}={value!r} must be a positive integer ({meaning}).")
        if self.activation_checkpointing not in CHECKPOINTING_MODES:
            raise PlanError(
                f"activation_checkpointing={self.activation_checkpointing!r} is not one of "
                "'none', 'full' (recompute each block), 'selective' (keep matmul and attention "
                "outputs, recompute the rest) or {'every': k} (full recompute of every k-th block)."
            )
        if self.compile_scope not in ("auto", "block", "model"):
            raise PlanError(
                f"compile scope={self.compile_scope!r} is not one of 'auto', 'block' (each "
                "repeated block and the loss) or 'model' (the whole model)."
            )
        if not isinstance(self.compile_backend, str) or not self.compile_backend:
            raise PlanError(
                f"compile backend={self.compile_backend!r} must name a torch.compile backend "
                "('inductor', 'aot_eager', ...)."
            )
        self.unit_decisions("")  # decided here, once: offload needs a stage that shards

    @functools.cached_property
    def decisions(self) -> FSDPDecisions:
        """What the ZeRO stage decides for every FSDP unit but the root, decided once: cost,
        inference and lowering read it here (or on :attr:`FSDPUnit.decisions`)."""
        return fsdp_decisions(self.zero, root=False, offload=self.offload)

    @functools.cached_property
    def root_decisions(self) -> FSDPDecisions:
        """What the ZeRO stage decides for the model's root unit (it keeps its parameters)."""
        return fsdp_decisions(self.zero, root=True, offload=self.offload)

    def unit_decisions(self, fqn: str) -> FSDPDecisions:
        """The decisions of the FSDP unit at ``fqn`` (``""``: the root)."""
        return self.decisions if fqn else self.root_decisions

    def checkpointed_blocks(self, blocks: Sequence[str]) -> tuple[str, ...]:
        """The blocks whose activations are recomputed: all, or the k-th, 2k-th, … of them.

        Example:
            >>> PlanOptions(activation_checkpointing="full", checkpoint_every=2).checkpointed_blocks(
            ...     ["b0", "b1", "b2", "b3"])
            ('b1', 'b3')
        """
        if self.activation_checkpointing == "none":
            return ()
        every = self.checkpoint_every
        return tuple(fqn for position, fqn in enumerate(blocks, start=1) if position % every == 0)

    @property
    def param_dtype(self) -> str:
        """The dtype parameters are computed in (the master copy stays fp32)."""
        return _DTYPES[self.precision]

    @property
    def reduce_dtype(self) -> str:
        """The dtype gradients are reduced in."""
        return _DTYPES[self.reduce_precision]

    @property
    def optimizer_states(self) -> int:
        """fp32 optimizer tensors kept per parameter element (Adam: 2, SGD with momentum: 1)."""
        return _OPTIMIZER_STATES[self.optimizer]

    def keys(self) -> list[str]:
        """Deprecated: ``mt.plan(model, mesh, rules, **options)`` from the time
        ``Recipe.plan_options()`` returned a dict. Pass the options whole instead:
        ``mt.plan(model, mesh, rules, options)``."""
        warnings.warn(
            "unpacking PlanOptions with ** is deprecated; pass it whole: "
            "mt.plan(model, mesh, rules, recipe.plan_options()).",
            DeprecationWarning,
            stacklevel=2,
        )
        return [field.name for field in dataclasses.fields(self)]

    def __getitem__(self, name: str) -> Any:
        """The field ``name`` (what ``**options`` reads after :meth:`keys`)."""
        if name not in {field.name for field in dataclasses.fields(self)}:
            raise KeyError(name)
        return getattr(self, name)

    def with_overrides(self, **overrides: Any) -> PlanOptions:
        """These options with ``mt.plan``'s keyword arguments applied: any field by name, with
        ``activation_checkpointing`` also as ``{"every": k, "mode": ...}`` or a bool and
        ``compile`` also as a dict of ``backend``/``fullgraph``/``scope``. Unknown names are a
        :class:`PlanError` naming the closest field."""
        fields = {field.name for field in dataclasses.fields(self)}
        changes: dict[str, Any] = {}
        for name, value in overrides.items():
            if name == "activation_checkpointing":
                mode, every = parse_checkpointing(value)
                changes.update(activation_checkpointing=mode, checkpoint_every=every)
            elif name == "compile":
                changes.update(parse_compile(value))
            elif name in fields:
                changes[name] = value
            else:
                raise PlanError(
                    f"mt.plan got an unknown option {name}={value!r}"
                    f"{did_you_mean(name, sorted(fields | set(AutoSearch.KEYS)), 'options')}."
                )
        return dataclasses.replace(self, **changes)

    def to_json(self) -> dict[str, object]:
        """Plain-data form for ``Plan.to_json``."""
        data = asdict(self)
        if self.pipeline is not None:
            split = self.pipeline.split
            data["pipeline"] = {
                **asdict(self.pipeline),
                "split": split if isinstance(split, str) else list(split),
            }
        if self.fsdp_units is not None:
            data["fsdp_units"] = list(self.fsdp_units)
        for name in ("unproven_shards", "batch_buffers"):
            if data[name] == "refuse":  # the default: plans' JSON as before it existed
                del data[name]
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> PlanOptions:
        """Inverse of :meth:`to_json`."""
        values = dict(data)
        if values.get("pipeline") is not None:
            values["pipeline"] = Pipeline(**values["pipeline"])
        return cls(**values)


@dataclass(frozen=True)
class AutoSearch:
    """What ``strategy="auto"`` needs besides the plan options: the memory per device (bytes)
    and the devices per node (tensor parallelism stays inside one); ``progress`` (e.g. ``print``)
    is given a line every few seconds of a long search.

    Example:
        >>> AutoSearch.from_overrides({"strategy": "auto", "device_memory": 2**30}).node_size
        8
    """

    device_memory: int
    node_size: int = 8
    progress: Callable[[str], None] | None = field(default=None, compare=False, repr=False)

    KEYS = ("strategy", "device_memory", "node_size")

    @classmethod
    def from_overrides(cls, overrides: Mapping[str, Any]) -> AutoSearch | None:
        """The search ``mt.plan``'s ``strategy``/``device_memory``/``node_size`` ask for, or
        ``None`` for ``strategy="manual"`` (the default)."""
        strategy = overrides.get("strategy", "manual")
        if strategy == "manual":
            return None
        if strategy != "auto":
            raise PlanError(f"strategy={strategy!r} is not one of 'manual' or 'auto'.")
        memory = overrides.get("device_memory")
        if memory is None:
            raise PlanError(
                "strategy='auto' needs device_memory (bytes per device, or a string like '80GiB')."
            )
        return cls(parse_bytes(memory), int(overrides.get("node_size", 8)))


def _check_context_options(balance: str, method: str) -> None:
    """Context parallelism's load balancer and attention method are among the known ones."""
    if balance not in get_args(ContextBalance):
        raise PlanError(
            f"context_balance={balance!r} is not one of 'headtail' (rank r holds chunks r and "
            "2·cp-1-r of 2·cp: equal causal work) or 'contiguous' (rank r holds chunk r of cp)."
        )
    if method not in get_args(ContextMethod):
        raise PlanError(
            f"context_method={method!r} is not one of 'ring' (keys and values passed around the "
            "context group, one chunk in flight) or 'allgather' (gathered at once)."
        )


_COMPILE_KEYS = {
    "backend": "compile_backend",
    "fullgraph": "compile_fullgraph",
    "scope": "compile_scope",
}


def parse_checkpointing(value: object) -> tuple[str, int]:
    """``activation_checkpointing`` argument → (mode, every k-th block)."""
    if isinstance(value, Mapping):
        unknown = sorted(set(value) - {"every", "mode"})
        if unknown or "every" not in value:
            raise PlanError(
                f"activation_checkpointing={dict(value)!r}: a dict takes 'every' (checkpoint every "
                f"k-th block) and optionally 'mode' ('full' or 'selective'); unknown keys {unknown}."
            )
        mode = value.get("mode", "full")
        if mode not in ("full", "selective"):
            raise PlanError(
                f"activation_checkpointing mode={mode!r} with 'every' must be 'full' or 'selective'."
            )
        return str(mode), value["every"]
    if value is None or value is False:
        return "none", 1
    if value is True:
        return "full", 1
    return str(value), 1


def parse_compile(value: object) -> dict[str, Any]:
    """``compile`` argument (bool or dict of backend/fullgraph/scope) → ``PlanOptions`` fields."""
    if isinstance(value, bool):
        return {"compile": value}
    if not isinstance(value, Mapping):
        raise PlanError(
            f"compile={value!r} must be True, False or a dict with keys {sorted(_COMPILE_KEYS)}."
        )
    unknown = sorted(set(value) - set(_COMPILE_KEYS))
    if unknown:
        raise PlanError(
            f"compile={dict(value)!r} has unknown keys {unknown}; allowed: {sorted(_COMPILE_KEYS)}."
        )
    return {"compile": True, **{_COMPILE_KEYS[key]: item for key, item in value.items()}}
