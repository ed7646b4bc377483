"""Tensor-parallel collectives per optimizer step: one cost function per style, in one table
(:data:`TP_COSTS`, keyed by :class:`~meshtrain.plan.ir.TPStyle`), summed by
:func:`estimate_tp_collectives`.

A new style adds a member to ``TPStyle``, its cost function here and its lowering in
``meshtrain/lower/tensor/parallel.py``; a test checks that both tables cover every style.

Per micro-batch, without sequence parallelism: forward, one all-reduce per row-wise module
and vocab-parallel embedding (partial sums) and one all-gather per gathered output; backward,
one all-reduce per pair parent (its column-wise children share one replicated input) and per
unpaired column-wise module, one all-gather per row-wise module whose input was sliced locally.
With sequence parallelism the all-reduces become reduce-scatters to sequence shards, each pair
parent and the head all-gather their input in forward (reduce-scatter in backward), and the
replicated parameters of sequence-parallel modules (norm weights and biases) have partial
gradients, all-reduced one parameter at a time once per gradient sync. The
loss-parallel cross-entropy adds none. Payload: the full activation each collective handles,
``batch_size × seq_len × width`` elements in the compute dtype (0 when the plan was not given
``batch_size`` and ``seq_len``). Measured against real steps in the tests.

Frozen parameters (a LoRA base) change backward only. Autograd computes an activation's
gradient only when a trainable parameter is upstream of it, so an input gradient's collective
is issued only past the first trainable parameter (in the order the model registers its
parameters: the forward order of the models meshtrain plans; a later pipeline stage receives
an input that requires a gradient only then too), a sequence-parallel row-wise module's
output gradient only when its output requires one, and a frozen norm weight has no partial
gradient to reduce. A tensor-parallel LoRA Linear's replicated adapter (``lora_A`` of a
column-wise one, ``lora_B`` of a row-wise one; see :mod:`meshtrain.plan.adapters`) contracts
the sharded dim in its gradient, a partial sum: one all-reduce of its local gradient per
gradient sync, like the norms'. Both are in the compute dtype, or in the reduce dtype where
FSDP2 accumulated several micro-batches before the sync. The low-rank path adds no other
collective: a row-wise module's low-rank partial sums are reduced with the base's output, a
column-wise one's input gradient with the base's.

Example:
    >>> sorted(TP_COSTS) == sorted(TPStyle)
    True
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from meshtrain.adapters.lora import ADAPTERS
from meshtrain.plan.decisions import FSDPDecisions
from meshtrain.plan.ir import (
    WHOLE_SEQUENCE,
    Collective,
    FSDPUnit,
    ModuleStyle,
    ParamLayout,
    PartialGrad,
    TPStyle,
)
from meshtrain.plan.options import PlanOptions
from meshtrain.plan.tensor.styles import inside

_ROW_PARTIALS = "forward: partial sums of row-wise outputs"
_GATHERED_OUTPUTS = "forward: gathered column-wise outputs"
_MARKED_INPUTS = (
    "backward: input gradients of pair parents and column-wise modules that mark their own input"
)
_ADAPTER_GRADS = (
    "backward: partial gradients of replicated LoRA adapters (lora_A of column-wise, lora_B of "
    "row-wise Linears), once per gradient sync"
)
_NORM_GRADS = "norm weights' partial gradients, one per parameter per gradient sync"
_PARTIAL_GRADS = (
    "backward: partial gradients of replicated parameters computing on tensor-parallel shards "
    "(found by the abstract run), one per parameter per gradient sync"
)


class _StepCounts:
    """What the style costs read (the model's styles, weights and gradient flow) and the rows
    they add: activation collectives per micro-batch by (kind, reason), and the replicated
    parameters whose partial gradients are reduced once per gradient sync."""

    def __init__(
        self,
        styles: Sequence[ModuleStyle],
        layouts: Sequence[ParamLayout],
        by_fqn: Mapping[str, ParamLayout],
        act_bytes: int,
        sequence_parallel: bool,
    ) -> None:
        self.styles, self.layouts, self.act_bytes = styles, layouts, act_bytes
        self.by_fqn = by_fqn
        self.sp = sequence_parallel
        self.weights = {
            fqn.removesuffix(".weight"): p for fqn, p in by_fqn.items() if fqn.endswith(".weight")
        }
        self.transposed = {s.fqn for s in styles if s.module_type == "Conv1D"}  # weight [in, out]
        self.split_at_block = any(s.style == TPStyle.SEQUENCE_SPLIT_INPUT for s in styles)
        self.prepared = {s.fqn for s in styles if s.style == TPStyle.PREPARE_INPUT}
        self.whole = tuple(s.fqn for s in styles if s.style in WHOLE_SEQUENCE)
        self.partial_kind = "reduce_scatter" if sequence_parallel else "all_reduce"
        self.input_grad, self.output_grad = _gradient_flow(layouts)
        self.rows: dict[tuple[str, str], list[int]] = {}
        self.replicated_grads: list[ParamLayout] = []  # sequence-parallel norms' parameters

    def weights_of(self, fqn: str, name: str) -> tuple[int, ...]:
        """The global shape of parameter ``name`` of module ``fqn``."""
        return self.by_fqn[f"{fqn}.{name}" if fqn else name].shape

    def sp_at(self, fqn: str) -> bool:
        """Whether activations at ``fqn`` are sequence shards (sequence parallelism, outside
        the blocks run whole)."""
        return self.sp and not inside(fqn, self.whole)

    def add(self, kind: str, why: str, width: int) -> None:
        """One collective per micro-batch over an activation ``width`` wide."""
        row = self.rows.setdefault((kind, why), [0, 0])
        row[0] += 1
        row[1] += width * self.act_bytes

    def shape(self, fqn: str) -> tuple[int, ...]:
        """The weight's shape as a Linear stores it: [out, in]."""
        dims = self.weights[fqn].shape
        return (dims[1], dims[0]) if fqn in self.transposed else dims

    def child_in_width(self, parent: str) -> int:
        """The input width of a pair parent's first column-wise child."""
        child = next(
            s.fqn
            for s in self.styles
            if s.style == TPStyle.COLWISE and (not parent or s.fqn.startswith(parent + "."))
        )
        return self.shape(child)[1]


def _rowwise(c: _StepCounts, style: ModuleStyle) -> None:
    width = c.shape(style.fqn)[0]
    c.add("reduce_scatter" if c.sp_at(style.fqn) else "all_reduce", _ROW_PARTIALS, width)
    if c.sp_at(style.fqn) and c.output_grad(style.fqn):
        c.add(
            "all_gather",
            "backward: output gradients of row-wise modules from sequence shards",
            width,
        )


def _rowwise_replicated_input(c: _StepCounts, style: ModuleStyle) -> None:
    c.add("all_reduce", _ROW_PARTIALS, c.shape(style.fqn)[0])
    if c.input_grad(style.fqn):
        c.add(
            "all_gather",
            "backward: input gradients of row-wise modules fed a replicated input",
            c.shape(style.fqn)[1],
        )


def _vocab_parallel_embedding(c: _StepCounts, style: ModuleStyle) -> None:
    shards_out = c.sp and not c.split_at_block  # the embedding's output is a sequence shard
    width = c.shape(style.fqn)[1]
    c.add(
        c.partial_kind if shards_out else "all_reduce",
        "forward: partial sums of the vocab-parallel embedding",
        width,
    )
    if shards_out and c.output_grad(style.fqn):
        c.add("all_gather", "backward: embedding output gradient from sequence shards", width)


def _sequence_split_input(c: _StepCounts, style: ModuleStyle) -> None:
    if c.input_grad(style.fqn):
        parent = next(s.fqn for s in c.styles if s.style == TPStyle.PREPARE_INPUT)
        c.add(
            "all_gather",
            "backward: the first block's input gradient from sequence shards",
            c.child_in_width(parent),
        )


def _colwise(c: _StepCounts, style: ModuleStyle) -> None:
    """Under a pair parent nothing; under a parent with other consumers of its input it marks
    its own plain input."""
    if any(style.fqn.startswith(parent + ".") or not parent for parent in c.prepared):
        return
    if c.input_grad(style.fqn):
        c.add("all_reduce", _MARKED_INPUTS, c.shape(style.fqn)[1])


def _embedding_dim_parallel(c: _StepCounts, style: ModuleStyle) -> None:
    c.add("all_gather", _GATHERED_OUTPUTS, c.shape(style.fqn)[1])


def _marked_input(c: _StepCounts, style: ModuleStyle, width: int) -> None:
    """A replicated input marked once: all-gathered from sequence shards in forward and
    reduce-scattered back in backward, else its gradient all-reduced."""
    if c.sp_at(style.fqn):
        c.add(
            "all_gather", "forward: inputs of pair parents and the head from sequence shards", width
        )
        if c.input_grad(style.fqn):
            c.add(
                "reduce_scatter",
                "backward: input gradients of pair parents and the head to sequence shards",
                width,
            )
    elif c.input_grad(style.fqn):
        c.add("all_reduce", _MARKED_INPUTS, width)


def _prepare_input(c: _StepCounts, style: ModuleStyle) -> None:
    _marked_input(c, style, c.child_in_width(style.fqn))


def _loss_parallel_head(c: _StepCounts, style: ModuleStyle) -> None:
    _marked_input(c, style, c.shape(style.fqn)[1])


def _colwise_gathered(c: _StepCounts, style: ModuleStyle) -> None:
    _marked_input(c, style, c.shape(style.fqn)[1])
    c.add("all_gather", _GATHERED_OUTPUTS, c.shape(style.fqn)[0])


def _sequence_parallel(c: _StepCounts, style: ModuleStyle) -> None:
    """A norm on sequence shards: each trainable parameter's partial gradient is all-reduced
    (a LayerNorm's weight and bias: two), once per gradient sync."""
    c.replicated_grads += [
        p for p in c.layouts if p.fqn.rpartition(".")[0] == style.fqn and p.trainable
    ]


def _sequence_gathered(c: _StepCounts, style: ModuleStyle) -> None:
    """A block run whole: its input all-gathered from sequence shards in forward (its input
    gradient, the same on every rank, sliced back locally) and its output's gradient all-gathered
    in backward (its output sliced locally). The width is the block's input width: its first
    two-dimensional weight's input features (a router's)."""
    width = next(
        (
            layout.shape[-1]
            for fqn, layout in c.weights.items()
            if fqn.startswith(style.fqn + ".") and len(layout.shape) == 2
        ),
        0,
    )
    c.add("all_gather", "forward: inputs of blocks run whole (MoE) from sequence shards", width)
    if c.output_grad(style.fqn):
        c.add(
            "all_gather",
            "backward: output gradients of blocks run whole (MoE) from sequence shards",
            width,
        )


def _sequence_gathered_tail(c: _StepCounts, style: ModuleStyle) -> None:
    """The model's tail run whole (no column-wise head to gather the sequence): its input
    all-gathered from sequence shards in forward; its input gradient, the same on every rank,
    sliced back locally. The width is its first weight's input features."""
    width = next(
        (
            layout.shape[-1]
            for fqn, layout in c.weights.items()
            if (fqn == style.fqn or fqn.startswith(style.fqn + ".")) and len(layout.shape) == 2
        ),
        0,
    )
    c.add("all_gather", "forward: the tail's input (run whole) from sequence shards", width)


def _experts_tensor_parallel(c: _StepCounts, style: ModuleStyle) -> None:
    """An experts module split inside: its output's partial sums all-reduced in forward, its
    input's gradient all-reduced in backward, each ``[tokens, hidden]`` (under expert
    parallelism the rows each rank received, about ``top_k`` times as many, are what travel)."""
    width = c.weights_of(style.fqn, "down_proj")[1]
    c.add("all_reduce", _ROW_PARTIALS, width)
    if c.input_grad(style.fqn):
        c.add("all_reduce", _MARKED_INPUTS, width)


def _no_collective(c: _StepCounts, style: ModuleStyle) -> None:
    """A replicated output sliced into sequence shards locally."""


#: The tensor-parallel collectives of each style, per micro-batch (see
#: :func:`estimate_tp_collectives`).
TP_COSTS: Mapping[TPStyle, Callable[[_StepCounts, ModuleStyle], None]] = {
    TPStyle.COLWISE: _colwise,
    TPStyle.ROWWISE: _rowwise,
    TPStyle.ROWWISE_REPLICATED_INPUT: _rowwise_replicated_input,
    TPStyle.COLWISE_GATHERED: _colwise_gathered,
    TPStyle.LOSS_PARALLEL_HEAD: _loss_parallel_head,
    TPStyle.VOCAB_PARALLEL_EMBEDDING: _vocab_parallel_embedding,
    TPStyle.EMBEDDING_DIM_PARALLEL: _embedding_dim_parallel,
    TPStyle.PREPARE_INPUT: _prepare_input,
    TPStyle.SEQUENCE_PARALLEL: _sequence_parallel,
    TPStyle.SEQUENCE_SPLIT: _no_collective,
    TPStyle.SEQUENCE_SPLIT_INPUT: _sequence_split_input,
    TPStyle.SEQUENCE_GATHERED: _sequence_gathered,
    TPStyle.SEQUENCE_GATHERED_TAIL: _sequence_gathered_tail,
    TPStyle.EXPERTS_TENSOR_PARALLEL: _experts_tensor_parallel,
}


def estimate_tp_collectives(
    styles: Sequence[ModuleStyle],
    layouts: Sequence[ParamLayout],
    tp_axis: str | None,
    options: PlanOptions,
    *,
    sequence_parallel: bool = False,
    data_parallel: bool = False,
    pipelined: bool = False,
    tied: Sequence[Sequence[str]] = (),
    units: Sequence[FSDPUnit] = (),
) -> tuple[Collective, ...]:
    """Tensor-parallel collectives per optimizer step, with payloads when the batch is known.

    Each style's collectives are its entry of :data:`TP_COSTS` (what they are: the module
    docstring). ``pipelined``: the norm weights' and adapters' partial gradients are reduced once
    per step (the schedule holds them).
    ``tied``: groups of names sharing one parameter (aliases take the first name's layout).
    ``units``: the FSDP units, whose decisions say when gradients sync (``data_parallel``: they
    shard over a data axis larger than 1). Each style's collectives are its entry of
    :data:`TP_COSTS`.

    Example (tensor parallel of 2 ways, adapters of rank 4 on a [64, 32] column-wise Linear and a
    [32, 64] row-wise one under a pair parent; only the adapters train):
        >>> from meshtrain.spec.partition import P
        >>> def layout(fqn, shape, spec, trainable):
        ...     local = tuple(n // 2 if e == "tp" else n for n, e in zip(shape, spec.padded(2)))
        ...     return ParamLayout(fqn, shape, spec, "", local, local, trainable=trainable)
        >>> layouts = [layout("mlp.up.weight", (64, 32), P("tp"), False),
        ...            layout("mlp.up.lora_A", (4, 32), P(), True),
        ...            layout("mlp.up.lora_B", (64, 4), P("tp"), True),
        ...            layout("mlp.down.weight", (32, 64), P(None, "tp"), False),
        ...            layout("mlp.down.lora_A", (4, 64), P(None, "tp"), True),
        ...            layout("mlp.down.lora_B", (32, 4), P(), True)]
        >>> styles = [ModuleStyle("mlp", "MLP", "prepare_input", "tp"),
        ...           ModuleStyle("mlp.up", "LoRALinear", "colwise", "tp"),
        ...           ModuleStyle("mlp.down", "LoRALinear", "rowwise", "tp")]
        >>> for c in estimate_tp_collectives(styles, layouts, "tp",
        ...                                  PlanOptions(batch_size=2, seq_len=8)):
        ...     print(c.kind, c.count, c.bytes, c.why.partition(" (")[0])
        all_reduce 1 2048 forward: partial sums of row-wise outputs
        all_reduce 2 1024 backward: partial gradients of replicated LoRA adapters

    (No input gradient of ``mlp`` is reduced: nothing trainable comes before it.)
    """
    if tp_axis is None or not styles:
        return ()
    by_fqn = {p.fqn: p for p in layouts}
    for group in tied:  # an alias (a tied head's weight) has its first name's layout
        by_fqn.update({alias: by_fqn[group[0]] for alias in group[1:] if group[0] in by_fqn})
    tokens = (options.batch_size or 0) * (options.seq_len or 0)
    act_bytes = tokens * getattr(torch, options.param_dtype).itemsize
    counts = _StepCounts(styles, layouts, by_fqn, act_bytes, sequence_parallel)
    adapters: list[ParamLayout] = []
    for style in styles:
        adapters += _replicated_adapters(style, by_fqn, tp_axis)
        TP_COSTS[style.style](counts, style)
    micro = options.microbatches
    sized = "" if tokens else " (activation-sized: give batch_size and seq_len to size it)"
    result = [
        Collective(kind, tp_axis, count * micro, payload * micro, why + sized)
        for (kind, why), (count, payload) in counts.rows.items()
    ]
    decisions = _decisions(units, options) if data_parallel else None
    syncs, dtype = _partial_grad_syncs(decisions, options, pipelined=pipelined)
    grad_bytes = getattr(torch, dtype).itemsize
    for why, params in ((_NORM_GRADS, counts.replicated_grads), (_ADAPTER_GRADS, adapters)):
        if params:
            result.append(
                Collective(
                    "all_reduce",
                    tp_axis,
                    len(params) * syncs,
                    sum(p.local_numel for p in params) * grad_bytes * syncs,
                    why,
                )
            )
    return tuple(result)


def partial_grad_collectives(
    partial_grads: Sequence[PartialGrad],
    layouts: Sequence[ParamLayout],
    options: PlanOptions,
    *,
    data_parallel: bool = False,
    pipelined: bool = False,
    units: Sequence[FSDPUnit] = (),
) -> tuple[Collective, ...]:
    """The all-reduces of the partial gradients the abstract run found (replicated parameters
    computing on tensor-parallel shards), per axis: each parameter's gradient once per gradient
    sync, as for the norms of sequence parallelism.

    Example:
        >>> from meshtrain.spec.partition import P
        >>> layouts = [ParamLayout("attn.q_norm.weight", (16,), P(), "", (16,), (16,))]
        >>> grads = [PartialGrad("attn.q_norm.weight", "attn.q_norm", "tp", 2)]
        >>> [(c.kind, c.axis, c.count, c.bytes) for c in partial_grad_collectives(grads, layouts,
        ...                                                                      PlanOptions())]
        [('all_reduce', 'tp', 1, 64)]
    """
    by_fqn = {p.fqn: p for p in layouts}
    decisions = _decisions(units, options) if data_parallel else None
    syncs, dtype = _partial_grad_syncs(decisions, options, pipelined=pipelined)
    grad_bytes = getattr(torch, dtype).itemsize
    per_axis: dict[str, list[ParamLayout]] = {}
    for grad in partial_grads:
        if grad.param in by_fqn:
            per_axis.setdefault(grad.axis, []).append(by_fqn[grad.param])
    return tuple(
        Collective(
            "all_reduce",
            axis,
            len(params) * syncs,
            sum(p.local_numel for p in params) * grad_bytes * syncs,
            _PARTIAL_GRADS,
        )
        for axis, params in per_axis.items()
    )


def _replicated_adapters(
    style: ModuleStyle, by_fqn: Mapping[str, ParamLayout], tp_axis: str
) -> list[ParamLayout]:
    """The trainable adapters of a tensor-parallel LoRA Linear that are replicated (``lora_A``
    of a column-wise one, ``lora_B`` of a row-wise one): their gradients are partial sums."""
    if style.module_type != "LoRALinear":
        return []
    prefix = f"{style.fqn}." if style.fqn else ""
    return [
        p
        for name in ADAPTERS
        if (p := by_fqn.get(prefix + name)) is not None
        and p.trainable
        and tp_axis not in p.spec.axes
    ]


def _decisions(units: Sequence[FSDPUnit], options: PlanOptions) -> FSDPDecisions:
    """The decisions the data-parallel units share (the root's: only reshard-after-forward
    differs between units); the options' stage for a caller that gives no units."""
    return units[-1].decisions if units else options.decisions


def _partial_grad_syncs(
    decisions: FSDPDecisions | None, options: PlanOptions, *, pipelined: bool
) -> tuple[int, str]:
    """How often partial gradients are all-reduced per step, and in which dtype: once per
    gradient sync (each micro-batch where the data-parallel units sync every one, outside a
    pipeline schedule), in the reduce dtype where FSDP2 accumulated micro-batches before."""
    micro = options.microbatches
    if decisions is None:  # no data parallelism: reduced once per step (the hook's last call)
        return 1, options.param_dtype
    every = decisions.sync_every_microbatch and not pipelined
    accumulated = micro > 1 and not every
    return (micro if every else 1), (options.reduce_dtype if accumulated else options.param_dtype)


def _gradient_flow(
    layouts: Sequence[ParamLayout],
) -> tuple[Callable[[str], bool], Callable[[str], bool]]:
    """Whether autograd computes the gradient of a module's input (some trainable parameter is
    registered before the module's first parameter; a module without parameters of its own, a
    tied head, comes last), and of its output (also when it owns a trainable parameter)."""
    first: dict[str, int] = {}
    trains: set[str] = set()
    for index, p in enumerate(layouts):
        parts = p.fqn.split(".")
        for depth in range(len(parts)):
            module = ".".join(parts[:depth])
            first.setdefault(module, index)
            if p.trainable:
                trains.add(module)
    first_trainable = next((i for i, p in enumerate(layouts) if p.trainable), len(layouts))

    def input_grad(fqn: str) -> bool:
        return first_trainable < first.get(fqn, len(layouts))

    def output_grad(fqn: str) -> bool:
        return fqn in trains or input_grad(fqn)

    return input_grad, output_grad
