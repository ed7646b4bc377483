"""A one-device reference that computes as a plan does: parameters cast per unit for compute by
FSDP2's mixed-precision policy, over a mesh of one rank, so low-precision plans are compared with
a single device that rounds the same way.

Example (on every rank, for the harness's reference copy)::

    reference = one_device_reference(copy.deepcopy(model), plan)
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from meshtrain.plan.ir import Plan


def one_device_reference(model: nn.Module, plan: Plan) -> nn.Module:
    """``model`` itself under an fp32 plan; otherwise wrapped unit by unit (the plan's blocks,
    then the root) in FSDP2 over this rank alone with the plan's compute dtype, gradients reduced
    in fp32, its BatchNorms computing their statistics in fp32 as the plan's do."""
    if plan.options.precision == "fp32":
        return model
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            module.forward = functools.partial(_fp32_batch_norm, module)  # type: ignore[method-assign]
    dtype = getattr(torch, plan.options.param_dtype)
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    one = _one_rank_mesh(dist.get_world_size())
    for fqn in plan.blocks:
        fully_shard(model.get_submodule(fqn), mesh=one, mp_policy=policy)
    fully_shard(model, mesh=one, mp_policy=policy)
    return model


def _fp32_batch_norm(module: nn.modules.batchnorm._BatchNorm, x: torch.Tensor) -> torch.Tensor:
    """torch's own BatchNorm on the fp32 input and parameters, the result in the input's dtype:
    its statistics in fp32, as the plan's global-batch BatchNorm takes them (torch's CPU kernel
    refuses compute-dtype weights beside fp32 running statistics: "expected scalar type
    BFloat16 but found Float"). Written apart from the plan's (:mod:`meshtrain.lower.data.batch_norm`),
    so a bug there does not change both sides alike."""
    momentum = 0.0 if module.momentum is None else module.momentum
    batch_statistics = module.training or module.running_mean is None
    if module.training and module.track_running_stats and module.num_batches_tracked is not None:
        module.num_batches_tracked.add_(1)
        if module.momentum is None:
            momentum = 1.0 / float(module.num_batches_tracked)
    weight = module.weight.float() if module.weight is not None else None
    bias = module.bias.float() if module.bias is not None else None
    running = not module.training or module.track_running_stats
    y = F.batch_norm(
        x.float(),
        module.running_mean if running else None,
        module.running_var if running else None,
        weight,
        bias,
        batch_statistics,
        momentum,
        module.eps,
    )
    return y.to(x.dtype)


@functools.cache
def _one_rank_mesh(world: int) -> DeviceMesh:
    """Every rank's own one-rank mesh (made by all ranks together, once per process)."""
    return init_device_mesh("cpu", (world, 1), mesh_dim_names=("ref", "one"))["one"]
