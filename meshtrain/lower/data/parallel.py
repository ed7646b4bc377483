"""Data parallelism: FSDP2 (``fully_shard``) per unit, or DDP-like ``replicate`` under zero 0,
with the plan's mixed-precision and offload policies; and the per-micro-batch gradient-sync
policy of each ZeRO stage.

Data-parallel gradients are averaged over the data-parallel ranks by default, as DDP and FSDP do
(a loop written for them trains unchanged: FSDP2's and ``replicate``'s own default), or summed
under ``grad_reduction="sum"`` (for a loss normalised by the global token count: divide factor 1,
plain sums on the wire).

Example (inside :func:`~meshtrain.lower.apply`)::

    apply_data_parallel(plan, model)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)

from meshtrain.errors import PlanError
from meshtrain.lower.experts.parallel import experts_ignored, experts_of
from meshtrain.lower.groups import device_mesh, hsdp_mesh_over, mesh_over
from meshtrain.lower.tensor.parallel import PartialGradSync
from meshtrain.plan.ir import Plan


def apply_data_parallel(plan: Plan, model: nn.Module) -> None:
    """FSDP2 (``replicate`` under zero 0) on every unit of the plan, blocks first, root last,
    over :func:`data_parallel_mesh`; the experts, each its own unit, over the data axes (the
    ranks outside the expert axis: two under HSDP); gradients averaged over the token ranks (or
    summed under ``grad_reduction="sum"``)."""
    dp_mesh = data_parallel_mesh(plan)
    options = plan.options
    mp_policy = MixedPrecisionPolicy(
        param_dtype=getattr(torch, options.param_dtype),
        reduce_dtype=getattr(torch, options.reduce_dtype),
    )
    modules = dict(model.named_modules())
    wrapped: list[FSDPModule] = []
    expert_mesh = _experts_mesh(plan)
    ignored = experts_ignored(plan, model) if plan.expert_axis and expert_mesh is None else None
    for unit in plan.units:
        module = modules[unit.fqn]
        decisions = unit.decisions
        for inner in experts_of(plan, unit.fqn) if expert_mesh is not None else ():
            fully_shard(
                modules[inner],
                mesh=expert_mesh,
                mp_policy=mp_policy,
                reshard_after_forward=decisions.reshard_after_forward,
                offload_policy=_offload_policy(decisions.offload),
            )
            wrapped.append(modules[inner])
        if decisions.wrapper == "replicate":
            from torch.distributed._composable.replicate_with_fsdp import replicate

            replicate(module, mesh=dp_mesh, mp_policy=mp_policy)
        else:
            fully_shard(
                module,
                mesh=dp_mesh,
                reshard_after_forward=decisions.reshard_after_forward,
                mp_policy=mp_policy,
                offload_policy=_offload_policy(decisions.offload),
                ignored_params=ignored,
            )
        wrapped.append(module)
    if options.grad_reduction == "sum":  # plain sums on the wire (gloo has no PREMUL_SUM)
        for module in wrapped:
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    # "mean" is FSDP2's and replicate's own default. (torch 2.13's replicate divides twice when
    # given a divide factor other than 1 with forced sums, so the mean is left to them.)


def data_parallel_mesh(plan: Plan) -> DeviceMesh:
    """The mesh FSDP2 wraps the parameters outside the experts over: the data axes (two: HSDP,
    replicated over the first, sharded over the second, whatever their order in the mesh), or the
    size-1 axes that carry the mixed-precision policy; under expert or context parallelism the
    shard axis and the expert or context axis together, one flattened dim (torchtitan's
    ``dp_shard_cp``), beside the replicate axis under HSDP. Under ZeRO 0 (``replicate``, which
    takes one dim and shards nothing) two data axes are one flattened dim with the rest. FSDP2
    averages over every rank of it: all the token ranks.

    Example (on every rank of an 8-rank job)::

        plan = mt.plan(model, mt.make_mesh(rep=2, dp=2, cp=2), rules)  # fsdp=("rep", "dp")
        data_parallel_mesh(plan).mesh_dim_names                        # ('rep', 'dp+cp')
    """
    if len(plan.data_axes) == 2 and plan.options.decisions.wrapper == "replicate":
        return mesh_over(plan, plan.token_axes)  # nothing sharded: one flat dim, as DDP
    if len(plan.data_axes) == 2:
        replicate = plan.data_axes[0]
        return hsdp_mesh_over(plan, replicate, [a for a in plan.token_axes if a != replicate])
    if not (plan.expert_axis or plan.context_axis):
        return device_mesh(plan.mesh)[plan.data_axes or plan.cast_axes]
    return mesh_over(plan, plan.token_axes)


def _experts_mesh(plan: Plan) -> DeviceMesh | None:
    """The mesh FSDP2 wraps each experts module over: the data axes and the context axis (the
    token ranks outside the expert axis, whose gradients the experts sum; under HSDP replicated
    over the first data axis, sharded over the second and the context axis), or none."""
    context = (plan.context_axis,) if plan.context_axis else ()
    if len(plan.data_axes) == 2:
        return hsdp_mesh_over(plan, plan.data_axes[0], (*plan.data_axes[1:], *context))
    axes = (*plan.data_axes, *context)
    return mesh_over(plan, axes) if axes else None


def _offload_policy(offload: bool) -> OffloadPolicy:
    """FSDP2's CPU offload (pinned host memory where CUDA is present), or none."""
    return CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if offload else OffloadPolicy()


def data_parallel_size(plan: Plan) -> int:
    """The number of ranks gradients are reduced over (the product of the plan's token axes: the
    data axes, the expert axis and the context axis)."""
    size = 1
    for axis in plan.token_axes:
        size *= plan.mesh.size(axis)
    return size


@contextlib.contextmanager
def micro_batch(plan: Plan, model: nn.Module, *, last: bool) -> Iterator[None]:
    """Gradient-sync policy for one micro-batch of a step.

    Each unit does what its decisions say (:func:`~meshtrain.plan.decisions.fsdp_decisions`):
    zero 0 and 1 reduce gradients once per step (on the last micro-batch), zero 1 keeps
    parameters gathered between micro-batches; zero 2 and 3 reduce every micro-batch so
    gradients stay sharded. Wrap each micro-batch's forward and backward in this context.
    """
    if plan.pipeline is not None:
        raise PlanError(
            "a pipelined plan runs its micro-batches inside the schedule: train what mt.apply "
            "returned with meshtrain.train.forward_backward (or make_train_step) instead of "
            "mt.micro_batch."
        )
    sync = getattr(model, "_meshtrain_partial_grads", None)
    if isinstance(sync, PartialGradSync):
        sync.enabled = last
    # every unit shares these decisions (only reshard-after-forward differs between units)
    decisions = plan.units[-1].decisions if plan.token_axes and plan.units else None
    if decisions is not None and not decisions.sync_every_microbatch:
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_requires_gradient_sync(last, recurse=False)
                if decisions.gathered_across_microbatches:
                    module.set_reshard_after_backward(last, recurse=False)
    yield
