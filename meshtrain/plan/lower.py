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
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    loss_parallel,
    parallelize_module,
)

from meshtrain.plan.ir import Plan
from meshtrain.spec.errors import PlanError, format_shape


def apply(plan: Plan, model: nn.Module) -> nn.Module:
    """Parallelise ``model`` in place as ``plan`` says and return it.

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
    if plan.tp_axis is not None:  # only set when its size is > 1
        parallelize_module(model, device_mesh[plan.tp_axis], _tp_styles(plan))
    if plan.data_axes:
        _apply_data_parallel(plan, model)
    return model


def _tp_styles(plan: Plan) -> dict[str, ParallelStyle]:
    styles: dict[str, ParallelStyle] = {}
    for style in plan.styles:
        if style.style == "colwise":
            styles[style.fqn] = ColwiseParallel()
        elif style.style == "rowwise":
            styles[style.fqn] = RowwiseParallel()
        elif style.style == "rowwise_replicated_input":
            styles[style.fqn] = RowwiseParallel(input_layouts=Replicate())
        elif style.style == "colwise_gathered":
            styles[style.fqn] = ColwiseParallel(output_layouts=Replicate())
        elif style.style == "loss_parallel_head":
            styles[style.fqn] = ColwiseParallel(use_local_output=False)
        elif style.style == "vocab_parallel_embedding":
            styles[style.fqn] = RowwiseParallel(input_layouts=Replicate())
        elif style.style == "embedding_dim_parallel":
            styles[style.fqn] = ColwiseParallel(
                input_layouts=Replicate(), output_layouts=Replicate()
            )
        else:
            raise PlanError(
                f"module '{style.fqn}' has style {style.style!r}, which this version cannot lower."
            )
    return styles


def _apply_data_parallel(plan: Plan, model: nn.Module) -> None:
    assert plan.mesh.device_mesh is not None
    dp_mesh = plan.mesh.device_mesh[plan.data_axes]
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
    if plan.data_axes and plan.options.zero <= 1:
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_requires_gradient_sync(last, recurse=False)
                if plan.options.zero == 1:
                    module.set_reshard_after_backward(last, recurse=False)
    yield


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
