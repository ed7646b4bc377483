"""Tensor parallelism inside experts modules (:mod:`meshtrain.plan.experts.tensor`): each rank
holds ``I / tp`` of every expert's intermediate features — ``gate_up_proj`` as transformers'
``packed_colwise`` lays it out (``_StridedShard(1, split_factor=2)``: rank ``r`` holds shard
``r`` of the gate rows and of the up rows), ``down_proj`` as ``Shard(2)`` — and runs the module's
own forward on them. Its inputs are the same on every tensor-parallel rank, its output a partial
sum: the output is all-reduced forward, the input's (and the routing weights') gradients are
all-reduced backward. Under expert parallelism the dispatch
(:class:`~meshtrain.lower.experts.parallel.ExpertDispatch`) does the same around the rows each
rank received, with the weights split over the expert and tensor-parallel axes together.

Example (inside :func:`~meshtrain.lower.tensor.parallel.apply_tensor_parallel`)::

    parallelize_module(model, tp_mesh, {"layers.1.mlp.experts": ExpertsTensorParallel()})
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle
from torch.distributed.tensor.placement_types import _StridedShard

from meshtrain.plan.experts.tensor import PACKED, PACKED_PARTS, ROWWISE


def tensor_placement(name: str) -> Placement:
    """The tensor-parallel placement of an experts module's parameter ``name``.

    Example:
        >>> tensor_placement("down_proj")
        Shard(dim=2)
    """
    if name == PACKED:
        return _StridedShard(1, split_factor=PACKED_PARTS)
    if name == ROWWISE:
        return Shard(2)
    raise ValueError(f"no tensor-parallel placement for experts parameter {name!r}")


class _SumBackward(torch.autograd.Function):
    """Identity forward; the gradient all-reduced (summed) over ``group`` backward."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return funcol.wait_tensor(funcol.all_reduce(grad.contiguous(), "sum", ctx.group)), None


class _SumForward(torch.autograd.Function):
    """The tensor all-reduced (summed) over ``group`` forward; the gradient as is backward."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        return funcol.wait_tensor(funcol.all_reduce(tensor.contiguous(), "sum", group))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def sum_backward(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``tensor`` unchanged, its gradient summed over ``group`` (a replicated input of partial
    computations)."""
    return _SumBackward.apply(tensor, group)


def sum_forward(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``tensor`` summed over ``group`` (partial sums made whole)."""
    return _SumForward.apply(tensor, group)


class LocalExperts:
    """An experts module as its own forward sees it on one rank: the local weights and counts in
    ``overrides`` (``num_experts``, ``intermediate_dim`` where the module keeps it), everything
    else the module's own; its methods see the local view too."""

    def __init__(self, module: nn.Module, overrides: dict[str, Any]) -> None:
        self.__dict__.update(overrides)
        self.__dict__["_module"] = module

    def __getattr__(self, name: str) -> Any:
        module = self.__dict__["_module"]
        value = getattr(module, name)
        if isinstance(value, types.MethodType) and value.__self__ is module:
            return types.MethodType(value.__func__, self)
        return value


def local_intermediate(module: nn.Module, ways: int) -> dict[str, int]:
    """The intermediate-size attributes of ``module`` (transformers' ``intermediate_dim``) at
    their per-rank value under ``ways``-way tensor parallelism inside the experts."""
    inter = getattr(module, ROWWISE).shape[2]
    return {
        name: inter // ways
        for name in ("intermediate_dim", "intermediate_size")
        if getattr(module, name, None) == inter
    }


class ExpertsTensorParallel(ParallelStyle):
    """Split an experts module inside over a one-axis tensor-parallel mesh (see module doc)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name in (PACKED, ROWWISE):
            param = getattr(module, name)
            shard = distribute_tensor(
                param.detach(), device_mesh, [tensor_placement(name)], src_data_rank=None
            )
            module.register_parameter(name, nn.Parameter(shard, param.requires_grad))
        module.forward = _SplitForward(module, device_mesh)
        return module


class _SplitForward:
    """The experts module's forward over local weights: inputs' gradients and the output summed
    over the tensor-parallel ranks."""

    def __init__(self, module: nn.Module, device_mesh: DeviceMesh) -> None:
        self.module, self.device_mesh = module, device_mesh
        self.own_forward: Callable[..., torch.Tensor] = type(module).forward
        self.sizes = local_intermediate(module, device_mesh.size())

    def __call__(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        group = self.device_mesh.get_group()
        weights = {name: _local(getattr(self.module, name)) for name in (PACKED, ROWWISE)}
        local = LocalExperts(self.module, {**weights, **self.sizes})
        hidden = sum_backward(hidden_states, group)
        routing = sum_backward(top_k_weights, group)
        return sum_forward(self.own_forward(local, hidden, top_k_index, routing), group)


def _local(weight: torch.Tensor) -> torch.Tensor:
    return weight.to_local() if isinstance(weight, DTensor) else weight
