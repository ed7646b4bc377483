"""Analytic per-rank memory and data-parallel communication of a plan, per optimizer step.

Memory per rank comes in two parts. *At rest* — what a rank holds between steps, checked byte for
byte against real runs (``tests/test_memory_spmd.py``): master parameters, gradients and
optimizer states in the parameters' own dtype (fp32 unless the model was built otherwise), plus
buffers. *Transient* — what lives only during a step: the gathered compute copies of parameters,
unsharded gradients before their reduce-scatter, and activations.

======  ====================  ==============  ================  ===================================
zero    parameters (master)   gradients       optimizer states  gathered compute copies (param dtype)
======  ====================  ==============  ================  ===================================
0       local (TP shard)      local           local × states    local when cast to bf16/fp16, else 0
1       shard                 shard           shard × states    local (all units, whole step)
2       shard                 shard           shard × states    local (all units, forward→backward)
3       shard                 shard           shard × states    root + 2 × largest block (prefetch)
======  ====================  ==============  ================  ===================================

"local" is the tensor-parallel shard a rank computes with; "shard" is its data-parallel slice
(dim 0 padded as FSDP2 pads). Unsharded gradients (in the reduce dtype): the largest unit's
while its reduce-scatter runs, and every unit's under zero 1 with micro-batches (accumulated
whole until the step's one reduce-scatter). Without a data axis larger than 1 nothing is wrapped
and everything is local. With offload, master parameters, gradients and optimizer states live on
the host and count 0 on the device; with ``offload_optimizer`` only the optimizer states do.
Frozen parameters (``requires_grad=False``: a LoRA base) have no gradient, no optimizer state,
no unsharded gradient and no gradient collective; a unit with only frozen parameters issues no
reduce-scatter (FSDP2 reduces the parameters that have gradients). NF4 weights (QLoRA) count
their 4-bit storage at rest and when gathered. Data-parallel collectives follow FSDP2's schedule: one
all-gather per unit in forward (the root's parameters are not resharded after forward), one more
per non-root unit in backward under zero=3, one reduce-scatter per unit per gradient sync, and an
all-reduce over the replicate axis under HSDP. zero 0 and 1 sync gradients once per step; zero 2
and 3 on every micro-batch so gradients stay sharded.

Example:
    >>> from meshtrain.plan.options import PlanOptions
    >>> PlanOptions(zero=1).optimizer_states
    2
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from meshtrain.adapters.lora import ADAPTERS
from meshtrain.plan.ir import Collective, FSDPUnit, Memory, ModuleStyle, ParamLayout
from meshtrain.plan.options import PlanOptions
from meshtrain.spec.mesh import Mesh


def estimate_memory(
    layouts: Sequence[ParamLayout],
    units: Sequence[FSDPUnit],
    options: PlanOptions,
    *,
    buffers: int = 0,
    sharded: bool = True,
) -> Memory:
    """Bytes per rank: at rest and transient (see the table above), activations left at 0.

    ``units`` are the FSDP units over ``layouts`` (empty: nothing is wrapped); ``sharded``:
    the units shard over a data axis larger than 1 (False when FSDP2 only carries the
    mixed-precision policy over size-1 axes).
    """
    shards = units and sharded and options.zero >= 1
    at_rest = sum(p.bytes_of(p.shard_numel if shards else p.local_numel) for p in layouts)
    trained = sum(
        (p.shard_numel if shards else p.local_numel) * p.element_bytes
        for p in layouts
        if p.trainable
    )
    states = trained * options.optimizer_states
    host = options.offload and bool(units)
    param_bytes = getattr(torch, options.param_dtype).itemsize
    reduce_bytes = getattr(torch, options.reduce_dtype).itemsize
    gathered_by_unit = _unit_bytes(layouts, units, param_bytes)
    grads_by_unit = _unit_numel(layouts, units, trainable_only=True)
    blocks = [n for unit, n in zip(units, gathered_by_unit) if unit.fqn]
    gathered = unsharded = 0
    if units and (options.zero >= 1 or options.precision != "fp32"):
        if options.zero == 3:
            root = sum(n for unit, n in zip(units, gathered_by_unit) if not unit.fqn)
            gathered = root + 2 * max(blocks, default=0)
        else:
            gathered = sum(gathered_by_unit)
    if units and options.zero >= 1:
        whole = options.zero == 1 and options.microbatches > 1
        unsharded = (sum(grads_by_unit) if whole else max(grads_by_unit, default=0)) * reduce_bytes
    return Memory(
        params=0 if host else at_rest,
        grads=0 if host else trained,
        optimizer_states=0 if host or options.offload_optimizer else states,
        gathered_params=gathered,
        unsharded_grads=unsharded,
        buffers=buffers,
    )


def _unit_numel(
    layouts: Sequence[ParamLayout], units: Sequence[FSDPUnit], *, trainable_only: bool = False
) -> list[int]:
    """Local (tensor-parallel shard) elements of each unit's own parameters (the trainable ones
    only: those that have gradients)."""
    by_fqn = {p.fqn: p for p in layouts}
    return [
        sum(
            by_fqn[fqn].local_numel
            for fqn in unit.params
            if fqn in by_fqn and (by_fqn[fqn].trainable or not trainable_only)
        )
        for unit in units
    ]


def _unit_bytes(
    layouts: Sequence[ParamLayout], units: Sequence[FSDPUnit], param_bytes: int
) -> list[int]:
    """Bytes of each unit's gathered compute copies: ``param_bytes`` per element, an NF4 weight
    in its 4-bit storage (FSDP2 all-gathers the NF4 tensor's codes and scales)."""
    by_fqn = {p.fqn: p for p in layouts}
    return [
        sum(
            by_fqn[fqn].bytes_of(by_fqn[fqn].local_numel)
            if by_fqn[fqn].storage
            else by_fqn[fqn].local_numel * param_bytes
            for fqn in unit.params
            if fqn in by_fqn
        )
        for unit in units
    ]


def estimate_collectives(
    layouts: Sequence[ParamLayout],
    units: Sequence[FSDPUnit],
    data_axes: tuple[str, ...],
    options: PlanOptions,
    *,
    pipelined: bool = False,
    block_gathers: tuple[int, int] = (1, 1),
) -> tuple[Collective, ...]:
    """Data-parallel collectives per optimizer step, per kind and axis, with payload bytes.

    ``pipelined``: inside a pipeline schedule, which syncs gradients (and reshards after
    backward) on a stage's last backward only, whatever the ZeRO stage; ``units`` are then one
    stage's (its blocks, its root last) and under zero=3 ``block_gathers`` says how often the
    blocks are gathered in forward and in backward
    (``StagePlan.zero3_gathers``, from :func:`~meshtrain.plan.pipeline.resharded_gathers`).
    """
    if not data_axes:
        return ()
    param_bytes = getattr(torch, options.param_dtype).itemsize
    reduce_bytes = getattr(torch, options.reduce_dtype).itemsize
    gathered = _unit_bytes(layouts, units, param_bytes)
    grads = _unit_numel(layouts, units, trainable_only=True)
    reducing = sum(1 for n in grads if n)  # frozen units reduce nothing
    grad_total = sum(grads)
    micro = options.microbatches
    syncs = micro if options.zero >= 2 and not pipelined else 1
    n_units = len(units)
    total = sum(gathered)
    root = gathered[-1]
    if options.zero == 0:
        axis = "+".join(data_axes)
        return (
            Collective(
                "all_reduce",
                axis,
                reducing * syncs,
                grad_total * reduce_bytes * syncs,
                "gradients, one per unit with trainable parameters",
            ),
        )
    replicate_axis, shard_axis = data_axes if len(data_axes) == 2 else (None, data_axes[0])
    gathers = micro if options.zero == 3 or (options.zero == 2 and not pipelined) else 1
    result: list[Collective]
    if pipelined and options.zero == 3:
        forward, backward = block_gathers
        result = list(_stage_zero3(shard_axis, n_units, total - root, root, forward, backward))
    else:
        result = [
            Collective(
                "all_gather",
                shard_axis,
                n_units * gathers,
                total * gathers,
                "parameters, one per unit in forward",
            )
        ]
    if options.zero == 3 and n_units > 1 and not pipelined:
        result.append(
            Collective(
                "all_gather",
                shard_axis,
                (n_units - 1) * micro,
                (total - root) * micro,
                "parameters again in backward (non-root units are resharded after forward; the root is kept)",
            )
        )
    result.append(
        Collective(
            "reduce_scatter",
            shard_axis,
            reducing * syncs,
            grad_total * reduce_bytes * syncs,
            "gradients, one per unit with trainable parameters per sync",
        )
    )
    if replicate_axis is not None:
        shard_total = sum(p.shard_numel for p in layouts if p.trainable)
        result.append(
            Collective(
                "all_reduce",
                replicate_axis,
                reducing * syncs,
                shard_total * reduce_bytes * syncs,
                "HSDP: gradient shards across replicas",
            )
        )
    return tuple(result)


def pipeline_step_scalars(
    mesh: Mesh, pipeline_axis: str, data_axes: Sequence[str]
) -> tuple[Collective, ...]:
    """The two scalar sums a pipelined step makes besides its schedule's traffic: its loss tokens
    over the data-parallel ranks (the loss is divided by the global count) and its loss over the
    pipeline and data-parallel ranks (every rank returns the global loss). One all-reduce each,
    of one float32, over the axes together.

    Example:
        >>> [(c.axis, c.count, c.bytes) for c in pipeline_step_scalars(
        ...     Mesh(("pp", "dp"), (2, 4)), "pp", ("dp",))]
        [('dp', 1, 4), ('pp+dp', 1, 4)]
    """
    scalar = torch.float32.itemsize
    tokens = mesh.joined(tuple(data_axes))
    rows = [Collective("all_reduce", tokens, 1, scalar, "the step's loss tokens")] if tokens else []
    rows.append(
        Collective(
            "all_reduce", mesh.joined((pipeline_axis, *data_axes)), 1, scalar,
            "the step's loss, returned on every rank",
        )
    )  # fmt: skip
    return tuple(rows)


def _stage_zero3(
    axis: str, n_units: int, blocks: int, root: int, forward: int, backward: int
) -> tuple[Collective, ...]:
    """A pipeline stage's parameter all-gathers under zero=3 (see ``estimate_collectives``);
    ``blocks`` and ``root`` are the bytes they gather."""
    n_blocks = n_units - 1
    return (
        Collective(
            "all_gather", axis, n_blocks * forward + 1, blocks * forward + root,
            "parameters in forward: the stage's root once, its blocks whenever resharded",
        ),
        Collective(
            "all_gather", axis, n_blocks * backward, blocks * backward,
            "parameters in backward: blocks resharded since their last backward",
        ),
    )  # fmt: skip


_HEADS = ("colwise_gathered", "loss_parallel_head")
_MARKED_INPUTS = (
    "backward: input gradients of pair parents and column-wise modules that mark their own input"
)
_ADAPTER_GRADS = (
    "backward: partial gradients of replicated LoRA adapters (lora_A of column-wise, lora_B of "
    "row-wise Linears), once per gradient sync"
)


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
) -> tuple[Collective, ...]:
    """Tensor-parallel collectives per optimizer step, with payloads when the batch is known.

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
    ``batch_size`` and ``seq_len``). Measured against real steps in the tests. ``pipelined``:
    the norm weights' partial gradients are reduced once per step (the schedule holds them).
    ``tied``: groups of names sharing one parameter (aliases take the first name's layout).

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
    weights = {
        fqn.removesuffix(".weight"): p for fqn, p in by_fqn.items() if fqn.endswith(".weight")
    }
    tokens = (options.batch_size or 0) * (options.seq_len or 0)
    act_bytes = tokens * getattr(torch, options.param_dtype).itemsize
    rows: dict[tuple[str, str], list[int]] = {}
    input_grad, output_grad = _gradient_flow(layouts)

    def add(kind: str, why: str, width: int) -> None:
        row = rows.setdefault((kind, why), [0, 0])
        row[0] += 1
        row[1] += width * act_bytes

    transposed = {s.fqn for s in styles if s.module_type == "Conv1D"}  # weight [in, out]

    def shape(fqn: str) -> tuple[int, ...]:
        """The weight's shape as a Linear stores it: [out, in]."""
        dims = weights[fqn].shape
        return (dims[1], dims[0]) if fqn in transposed else dims

    def child_in_width(parent: str) -> int:
        child = next(
            s.fqn for s in styles if s.style == "colwise" and s.fqn.startswith(parent + ".")
        )
        return shape(child)[1]

    sp = sequence_parallel
    split_at_block = any(s.style == "sequence_split_input" for s in styles)
    prepared = {s.fqn for s in styles if s.style == "prepare_input"}
    partial_kind = "reduce_scatter" if sp else "all_reduce"
    norms = norm_numel = 0
    adapters: list[ParamLayout] = []
    for style in styles:
        kind = style.style
        if style.module_type == "LoRALinear":
            prefix = f"{style.fqn}." if style.fqn else ""
            adapters += [
                p
                for name in ADAPTERS
                if (p := by_fqn.get(prefix + name)) is not None
                and p.trainable
                and tp_axis not in p.spec.axes
            ]
        if kind in ("rowwise", "rowwise_replicated_input"):
            add(
                partial_kind if kind == "rowwise" else "all_reduce",
                "forward: partial sums of row-wise outputs",
                shape(style.fqn)[0],
            )
            if sp and kind == "rowwise" and output_grad(style.fqn):
                add(
                    "all_gather",
                    "backward: output gradients of row-wise modules from sequence shards",
                    shape(style.fqn)[0],
                )
            if kind == "rowwise_replicated_input" and input_grad(style.fqn):
                add(
                    "all_gather",
                    "backward: input gradients of row-wise modules fed a replicated input",
                    shape(style.fqn)[1],
                )
        elif kind == "vocab_parallel_embedding":
            shards_out = sp and not split_at_block  # the embedding's output is a sequence shard
            add(
                partial_kind if shards_out else "all_reduce",
                "forward: partial sums of the vocab-parallel embedding",
                shape(style.fqn)[1],
            )
            if shards_out and output_grad(style.fqn):
                add(
                    "all_gather",
                    "backward: embedding output gradient from sequence shards",
                    shape(style.fqn)[1],
                )
        elif kind == "sequence_split_input":
            if input_grad(style.fqn):
                add(
                    "all_gather",
                    "backward: the first block's input gradient from sequence shards",
                    child_in_width(next(s.fqn for s in styles if s.style == "prepare_input")),
                )
        elif kind == "colwise" and not any(
            style.fqn.startswith(parent + ".") or not parent for parent in prepared
        ):
            # under a parent with other consumers of its input: marks its own plain input
            if input_grad(style.fqn):
                add("all_reduce", _MARKED_INPUTS, shape(style.fqn)[1])
        elif kind == "embedding_dim_parallel":
            add("all_gather", "forward: gathered column-wise outputs", shape(style.fqn)[1])
        elif kind == "prepare_input" or kind in _HEADS:
            width = child_in_width(style.fqn) if kind == "prepare_input" else shape(style.fqn)[1]
            if sp:
                add(
                    "all_gather",
                    "forward: inputs of pair parents and the head from sequence shards",
                    width,
                )
                if input_grad(style.fqn):
                    add(
                        "reduce_scatter",
                        "backward: input gradients of pair parents and the head to sequence shards",
                        width,
                    )
            elif input_grad(style.fqn):
                add("all_reduce", _MARKED_INPUTS, width)
            if kind == "colwise_gathered":
                add("all_gather", "forward: gathered column-wise outputs", shape(style.fqn)[0])
        elif kind == "sequence_parallel":
            trained = [p for p in layouts if p.fqn.rpartition(".")[0] == style.fqn and p.trainable]
            norms += len(trained)  # one all-reduce per parameter (a LayerNorm's weight and bias)
            norm_numel += sum(p.local_numel for p in trained)
    micro = options.microbatches
    sized = "" if tokens else " (activation-sized: give batch_size and seq_len to size it)"
    result = [
        Collective(kind, tp_axis, count * micro, payload * micro, why + sized)
        for (kind, why), (count, payload) in rows.items()
    ]
    syncs = micro if data_parallel and options.zero >= 2 and not pipelined else 1
    # FSDP2 accumulates the gradients of micro-batches it does not sync in the reduce dtype
    accumulated = data_parallel and micro > 1 and (options.zero <= 1 or pipelined)
    dtype = options.reduce_dtype if accumulated else options.param_dtype
    grad_bytes = getattr(torch, dtype).itemsize
    if norms:
        result.append(
            Collective(
                "all_reduce",
                tp_axis,
                norms * syncs,
                norm_numel * grad_bytes * syncs,
                "norm weights' partial gradients, one per parameter per gradient sync",
            )
        )
    if adapters:
        result.append(
            Collective(
                "all_reduce",
                tp_axis,
                len(adapters) * syncs,
                sum(p.local_numel for p in adapters) * grad_bytes * syncs,
                _ADAPTER_GRADS,
            )
        )
    return tuple(result)


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
