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
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from meshtrain.plan.ir import Plan


def one_device_reference(model: nn.Module, plan: Plan) -> nn.Module:
    """``model`` itself under an fp32 plan; otherwise wrapped unit by unit (the plan's blocks,
    then the root) in FSDP2 over this rank alone with the plan's compute dtype, gradients reduced
    in fp32."""
    if plan.options.precision == "fp32":
        return model
    dtype = getattr(torch, plan.options.param_dtype)
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    one = _one_rank_mesh(dist.get_world_size())
    for fqn in plan.blocks:
        fully_shard(model.get_submodule(fqn), mesh=one, mp_policy=policy)
    fully_shard(model, mesh=one, mp_policy=policy)
    return model


@functools.cache
def _one_rank_mesh(world: int) -> DeviceMesh:
    """Every rank's own one-rank mesh (made by all ranks together, once per process)."""
    return init_device_mesh("cpu", (world, 1), mesh_dim_names=("ref", "one"))["one"]
