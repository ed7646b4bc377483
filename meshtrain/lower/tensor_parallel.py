"""Tensor and sequence parallelism: the plan's module styles lowered to PyTorch's
``parallelize_module`` over the tensor-parallel axis, and the loss context for vocab-sharded
logits.

Example (inside :func:`~meshtrain.lower.apply`)::

    apply_tensor_parallel(plan, model, device_mesh(plan.mesh)[plan.tp_axis])
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.parallel import (
    loss_parallel as torch_loss_parallel,
)

from meshtrain.errors import PlanError, format_shape
from meshtrain.plan.ir import Plan


def apply_tensor_parallel(plan: Plan, model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """``parallelize_module`` with the plan's styles over the tensor-parallel axis, the run-time
    checks of paired Linears and sequence lengths, and partial-gradient reduction without FSDP2."""
    styles = _tp_styles(plan)
    root = styles.pop("", None)
    if styles:
        parallelize_module(model, tp_mesh, styles)
    if root is not None:  # a pair directly under the root: the root prepares its own input
        parallelize_module(model, tp_mesh, root)
    modules = dict(model.named_modules())
    for style in plan.styles:
        if style.style == "rowwise":
            check = functools.partial(_check_pair_input, style.fqn, tp_mesh.size())
            modules[style.fqn].register_forward_pre_hook(check, prepend=True)
    if plan.sequence_parallel:
        for style in plan.styles:
            if style.module_type == "Embedding":
                check = functools.partial(_check_sequence, style.fqn, plan.tp_axis, tp_mesh.size())
                modules[style.fqn].register_forward_pre_hook(check)
        if not plan.data_axes:  # FSDP2 reduces these itself when it wraps the model
            sync = PartialGradSync()
            for style in plan.styles:
                if style.style == "sequence_parallel":
                    for param in modules[style.fqn].parameters():
                        param.register_post_accumulate_grad_hook(sync)
            model._meshtrain_partial_grads = sync  # type: ignore[assignment]


def _check_pair_input(fqn: str, ways: int, module: nn.Module, args: Any) -> None:
    """A row-wise Linear paired by structure must consume its column-wise siblings' local output.

    Pairs are inferred from module structure (same parent, or a projection group under it); the
    data flow is checked here, on every rank alike, before the module issues any collective.
    """
    x = args[0] if args else None
    in_features = getattr(module, "in_features", None)
    if not isinstance(x, torch.Tensor) or not isinstance(in_features, int):
        return
    local = in_features // ways
    if isinstance(x, DTensor) or x.shape[-1] != local:
        parent = fqn.rpartition(".")[0]
        raise PlanError(
            f"'{fqn}' is lowered row-wise because it shares parent '{parent}' with column-wise "
            f"Linears, which assumes it consumes their sharded output (last dim {local} = "
            f"{in_features}/{ways}); it received a {'DTensor' if isinstance(x, DTensor) else 'tensor'}"
            f" of shape {format_shape(tuple(x.shape))} instead. meshtrain pairs Linears by "
            "module structure: shard the projection that reads the block's input column-wise "
            f"and the one that consumes its output row-wise, or replicate '{fqn}.weight'."
        )


def _check_sequence(fqn: str, axis: str | None, ways: int, module: nn.Module, args: Any) -> None:
    tokens = args[0] if args else None
    if not isinstance(tokens, torch.Tensor):
        return
    if tokens.dim() < 2:
        raise PlanError(
            f"input of '{fqn}' has shape {format_shape(tuple(tokens.shape))}, but sequence "
            "parallelism slices dim 1 of every embedding's output as the sequence: feed it "
            "[batch, seq] indices (e.g. positions[None]), or drop the ('seq', ...) activation rule."
        )
    if tokens.shape[1] % ways:
        raise PlanError(
            f"input of '{fqn}' has sequence length {tokens.shape[1]} (shape "
            f"{format_shape(tuple(tokens.shape))}), which does not divide over tensor-parallel "
            f"axis '{axis}' of size {ways} under sequence parallelism. Pad or cut sequences to a "
            f"multiple of {ways}."
        )


class PartialGradSync:
    """Reduces the partial-sum gradients of sequence-parallel norm weights to replicated ones.

    A norm on sequence shards computes its weight's gradient from its shard of the sequence only
    (a ``Partial`` DTensor). Without FSDP2 (which reduces them itself) this hook all-reduces them
    over the tensor-parallel axis once per step, on the last micro-batch, so that clipping and the
    optimizer see the same gradient as one device.
    """

    def __init__(self) -> None:
        self.enabled = True

    def __call__(self, param: torch.Tensor) -> None:
        grad = param.grad
        if (
            self.enabled
            and isinstance(grad, DTensor)
            and any(isinstance(p, Partial) for p in grad.placements)
        ):
            param.grad = grad.redistribute(placements=[Replicate()] * len(grad.placements))


def _tp_styles(plan: Plan) -> dict[str, ParallelStyle]:
    """PyTorch's parallel style per module FQN; activations between blocks are sequence shards
    (``Shard(1)``) under sequence parallelism, otherwise replicated."""
    stream: Placement = Shard(1) if plan.sequence_parallel else Replicate()
    styles: dict[str, ParallelStyle] = {}
    for style in plan.styles:
        if style.style == "colwise":
            styles[style.fqn] = ColwiseParallel()
        elif style.style == "rowwise":
            styles[style.fqn] = RowwiseParallel(output_layouts=stream)
        elif style.style == "rowwise_replicated_input":
            styles[style.fqn] = RowwiseParallel(input_layouts=Replicate())
        elif style.style == "colwise_gathered":
            styles[style.fqn] = ColwiseParallel(input_layouts=stream, output_layouts=Replicate())
        elif style.style == "loss_parallel_head":
            styles[style.fqn] = ColwiseParallel(
                input_layouts=stream, output_layouts=Shard(-1), use_local_output=False
            )
        elif style.style == "vocab_parallel_embedding":
            styles[style.fqn] = RowwiseParallel(input_layouts=Replicate(), output_layouts=stream)
        elif style.style == "embedding_dim_parallel":
            styles[style.fqn] = ColwiseParallel(
                input_layouts=Replicate(), output_layouts=Replicate()
            )
        elif style.style == "prepare_input":
            styles[style.fqn] = _PrepareFirstInput(
                input_layouts=stream, desired_input_layouts=Replicate()
            )
        elif style.style == "sequence_parallel":
            styles[style.fqn] = SequenceParallel(sequence_dim=1)
        elif style.style == "sequence_split":
            styles[style.fqn] = PrepareModuleOutput(
                output_layouts=Replicate(), desired_output_layouts=Shard(1), use_local_output=True
            )
        else:
            raise PlanError(
                f"module '{style.fqn}' has style {style.style!r}, which this version cannot lower."
            )
    return styles


class _PrepareFirstInput(PrepareModuleInput):
    """``PrepareModuleInput`` for the first positional input only, whatever else is passed.

    The parent of a column-/row-wise pair (attention, MLP) turns its activation input into one
    replicated DTensor that all its column-wise children share, so backward reduces their input
    gradients once (all-reduce, or reduce-scatter to sequence shards) instead of once per child.
    Other arguments (rotary tables, masks) pass through untouched.
    """

    def _prepare_input_fn(self, inputs: Any, device_mesh: DeviceMesh) -> Any:
        inputs = inputs if isinstance(inputs, tuple) else (inputs,)
        assert self.input_layouts is not None and self.desired_input_layouts is not None
        if not inputs or not isinstance(inputs[0], torch.Tensor):
            raise PlanError(
                "a module whose tensor-parallel children form a column-/row-wise pair must take "
                "its activation as the first positional argument (got "
                f"{type(inputs[0]).__name__ if inputs else 'no positional arguments'}); pass it "
                "positionally."
            )
        first = self._prepare_input_arg(
            inputs[0], device_mesh, self.input_layouts[0], self.desired_input_layouts[0]
        )
        return (first, *inputs[1:])


def loss_parallel(plan: Plan) -> contextlib.AbstractContextManager[None]:
    """Context for the loss: PyTorch's ``loss_parallel()`` when the plan keeps the head's logits
    vocab-sharded (cross-entropy then runs on the shards, never gathering them), else a no-op.

    Example::

        with loss_parallel(plan):
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    """
    if any(style.style == "loss_parallel_head" for style in plan.styles):
        return torch_loss_parallel()
    return contextlib.nullcontext()
