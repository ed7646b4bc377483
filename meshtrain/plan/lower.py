"""Lowering: Plan → parallelised module, with PyTorch's own APIs in a fixed order.

This is the only module that calls ``parallelize_module``, ``fully_shard`` and ``replicate``.
Order (as torchtitan applies it): tensor parallel over the TP axis first, then data parallel
per FSDP unit (repeated blocks) and finally the root.

Data-parallel gradients are **summed**, not averaged (FSDP's divide factor is 1 and reductions
use SUM, which gloo supports): the loss is normalised by the global token count instead, so the
result does not depend on the data-parallel degree or the number of micro-batches.

Example (on every rank of a 4-rank job)::

    plan = mt.plan(model, mt.make_mesh(dp=2, tp=2), rules)
    model = plan.apply(model)            # model holds full, identically initialised weights
    with plan.loss_parallel():
        loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten(), reduction="sum")
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from meshtrain.plan.functional import track
from meshtrain.plan.ir import Plan
from meshtrain.plan.lower_compute import apply_checkpointing, compile_blocks, compile_model
from meshtrain.spec.errors import PlanError, format_shape


def apply(plan: Plan, model: nn.Module) -> Any:
    """Parallelise ``model`` in place as ``plan`` says and return it (under a pipeline: this
    rank's stages as a :class:`~meshtrain.plan.lower_pipeline.PipelinedModel`).

    ``model`` must hold its full, initialised weights on every rank (the same on all ranks), or be
    on the meta device (then call ``to_empty`` and initialise afterwards).
    """
    _check_model(plan, model)
    device_mesh = plan.mesh.device_mesh
    if device_mesh is None:
        raise PlanError(
            f"cannot apply a plan on the abstract mesh {plan.mesh}: build the mesh with "
            "mt.make_mesh(...) under the launcher (without abstract=True), then plan again."
        )
    if plan.pipeline is not None:
        from meshtrain.plan.lower_pipeline import apply_pipeline

        return apply_pipeline(plan, model)
    return parallelize(plan, model)


def parallelize(plan: Plan, model: nn.Module) -> nn.Module:
    """Tensor parallel, checkpointing, per-block compile, data parallel (FSDP2, also over size-1
    axes that carry the mixed-precision policy), whole-model compile, then the scope
    ``mt.constrain`` reads (no pipeline)."""
    device_mesh = plan.mesh.device_mesh
    assert device_mesh is not None
    if plan.tp_axis is not None:  # only set when its size is > 1
        _apply_tensor_parallel(plan, model, device_mesh[plan.tp_axis])
    apply_checkpointing(plan, model)
    compile_blocks(plan, model)
    if plan.data_axes or plan.cast_axes:
        _apply_data_parallel(plan, model)
    compile_model(plan, model)
    track(plan, model)
    return model


def _apply_tensor_parallel(plan: Plan, model: nn.Module, tp_mesh: DeviceMesh) -> None:
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
            sync = _PartialGradSync()
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


class _PartialGradSync:
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


def _apply_data_parallel(plan: Plan, model: nn.Module) -> None:
    assert plan.mesh.device_mesh is not None
    dp_mesh = plan.mesh.device_mesh[plan.data_axes or plan.cast_axes]
    options = plan.options
    mp_policy = MixedPrecisionPolicy(
        param_dtype=getattr(torch, options.param_dtype),
        reduce_dtype=getattr(torch, options.reduce_dtype),
    )
    offload: OffloadPolicy = (
        CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
        if options.offload
        else OffloadPolicy()
    )
    modules = dict(model.named_modules())
    wrapped: list[FSDPModule] = []
    for unit in plan.units:
        module = modules[unit.fqn]
        if options.zero == 0:
            from torch.distributed._composable.replicate_with_fsdp import replicate

            replicate(module, mesh=dp_mesh, mp_policy=mp_policy)
        else:
            fully_shard(
                module,
                mesh=dp_mesh,
                # The root's parameters are needed again first thing in backward: keep them.
                reshard_after_forward=options.zero == 3 and unit.fqn != "",
                mp_policy=mp_policy,
                offload_policy=offload,
            )
        wrapped.append(module)
    for module in wrapped:
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)


@contextlib.contextmanager
def micro_batch(plan: Plan, model: nn.Module, *, last: bool) -> Iterator[None]:
    """Gradient-sync policy for one micro-batch of a step.

    zero 0 and 1 reduce gradients once per step (on the last micro-batch) and keep parameters
    gathered between micro-batches; zero 2 and 3 reduce every micro-batch so gradients stay
    sharded. Wrap each micro-batch's forward and backward in this context.
    """
    if plan.pipeline is not None:
        raise PlanError(
            "a pipelined plan runs its micro-batches inside the schedule: call "
            "model.step(inputs, targets) on what plan.apply returned instead of plan.micro_batch."
        )
    sync = getattr(model, "_meshtrain_partial_grads", None)
    if isinstance(sync, _PartialGradSync):
        sync.enabled = last
    if plan.data_axes and plan.options.zero <= 1:
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_requires_gradient_sync(last, recurse=False)
                if plan.options.zero == 1:
                    module.set_reshard_after_backward(last, recurse=False)
    yield


def plan_device(plan: Plan) -> torch.device:
    """The device this rank computes on under ``plan`` (the current CUDA device on a CUDA mesh);
    scalars that go through the plan's collectives live there (NCCL reduces CUDA tensors only)."""
    if plan.mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(plan.mesh.device_type)


def group_over(plan: Plan, axes: Sequence[str]) -> ProcessGroup | None:
    """This rank's process group over ``axes`` of the plan's mesh together, so one collective
    reduces over all of them; ``None`` when they span this rank alone. One axis is its own group;
    several are the ``DeviceMesh`` flattened over them (created by every rank on first use, then
    cached on the mesh by torch), named as :meth:`~meshtrain.spec.mesh.Mesh.joined` names it.
    ``DeviceMesh._flatten`` is private in torch 2.13 (FSDP2's HSDP and torchtitan use it too);
    this is meshtrain's only call of it.
    """
    device_mesh = plan.mesh.device_mesh
    name = plan.mesh.joined(tuple(axes))
    if device_mesh is None or not name:
        return None
    names = tuple(name.split("+"))
    if len(names) == 1:
        return device_mesh.get_group(names[0])
    return device_mesh[names]._flatten(name).get_group()


def loss_context(plan: Plan) -> contextlib.AbstractContextManager[None]:
    """``loss_parallel()`` when the plan keeps the head's logits vocab-sharded, else a no-op."""
    if any(style.style == "loss_parallel_head" for style in plan.styles):
        return loss_parallel()
    return contextlib.nullcontext()


def _check_model(plan: Plan, model: nn.Module) -> None:
    shapes = {fqn: tuple(param.shape) for fqn, param in model.named_parameters()}
    planned = {p.fqn: p.shape for p in plan.params}
    if shapes != planned:
        missing = sorted(set(planned) - set(shapes))[:3]
        extra = sorted(set(shapes) - set(planned))[:3]
        changed = [
            f"'{f}' {format_shape(shapes[f])} vs planned {format_shape(planned[f])}"
            for f in shapes
            if f in planned and shapes[f] != planned[f]
        ][:3]
        raise PlanError(
            f"the model does not match the plan: missing {missing}, unexpected {extra}, shapes "
            f"{changed}. Plan and apply the same model (build it the same way on every rank)."
        )
