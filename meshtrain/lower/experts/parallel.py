"""Expert parallelism: each experts module's weights split over the expert axis (``Shard(0)``,
``E / ep`` experts per rank) and its forward wrapped in a dropless token dispatch.

For each token slot (token ``t``, choice ``j`` of its ``k`` experts) the wrapper:

1. sorts the slots by expert (stable, so by destination rank, tokens in order within one expert),
   exchanges the tokens per expert (each rank learns how many rows every rank sends to each of
   its local experts, so the rows' local expert ids follow), then the tokens, by all-to-all over
   the expert axis (``all_to_all_single_autograd``: uneven splits, differentiable);
2. on the owner rank calls the module's *own* forward on the received tokens, with its local
   expert slice, ``num_experts = E / ep``, one expert per row and combine weight 1;
3. sends the results back by the reverse all-to-all, multiplies each by its combine weight (the
   product one device forms inside its forward) and sums each token's ``k`` products in
   ascending expert order, starting from zero in the output's dtype, as transformers' loop over
   experts does.

Every token reaches its expert (nothing is dropped) and routing is the model's own router's, so
the same tokens meet the same experts as on one device; what changes is which rows each expert's
matrix multiplies see together, and the order its weight gradient sums them
(:func:`meshtrain.testing.contract.contract_for`). The all-to-all's backward sums every expert
rank's tokens into the expert's gradient; a gradient scale of ``1 / ep`` on the expert weights
(under the data-parallel mean) makes them average over the batch ranks like every other
parameter (the loss is scaled by the number of batch ranks, ``Plan.batch_axes``).

Example (inside :func:`~meshtrain.lower.apply`, before data parallelism)::

    apply_expert_parallel(plan, model)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from meshtrain.lower.compute import eager_island
from meshtrain.lower.experts.tensor import (
    LocalExperts,
    local_intermediate,
    sum_backward,
    sum_forward,
    tensor_placement,
)
from meshtrain.lower.groups import device_mesh, group_over
from meshtrain.plan.ir import ExpertGroup, Plan


def apply_expert_parallel(plan: Plan, model: nn.Module) -> None:
    """Split every planned experts module over the expert axis and wrap its forward."""
    if plan.expert_axis is None:
        return
    ep_mesh = device_mesh(plan.mesh)[plan.expert_axis]
    scale = expert_grad_scale(plan)
    dtype = None if plan.options.precision == "fp32" else getattr(torch, plan.options.param_dtype)
    for group in plan.experts:
        module = model.get_submodule(group.fqn)
        inside = group.tensor_axis
        tensor_mesh = device_mesh(plan.mesh)[inside] if inside else None
        mesh = device_mesh(plan.mesh)[(plan.expert_axis, inside)] if inside else ep_mesh
        for fqn in group.params:
            name = fqn.rpartition(".")[2]
            param = getattr(module, name)
            placements = [Shard(0)] + ([tensor_placement(name)] if tensor_mesh else [])
            shard = distribute_tensor(param.detach(), mesh, placements, src_data_rank=None)
            module.register_parameter(name, nn.Parameter(shard, param.requires_grad))
        module.forward = ExpertDispatch(module, group, ep_mesh, scale, dtype, tensor_mesh)


def expert_grad_scale(plan: Plan) -> float:
    """What the expert weights' gradient is multiplied by: ``1 / ep`` when data-parallel gradients
    are averaged (the loss is scaled by every batch rank, the all-to-all's backward already sums
    the expert ranks' tokens, and FSDP2 averages over the data ranks only), 1 when summed."""
    if plan.expert_axis is None or plan.options.grad_reduction == "sum":
        return 1.0
    return 1.0 / plan.mesh.size(plan.expert_axis)


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient multiplied by ``scale`` backward."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


class ExpertDispatch:
    """The experts module's forward under expert parallelism (see the module docstring); it
    keeps the tokens each local expert received in the last forward (``last_counts``, global
    expert ids ``[E]``, this rank's routing only) for :func:`tokens_per_expert`."""

    def __init__(
        self,
        module: nn.Module,
        group: ExpertGroup,
        ep_mesh: DeviceMesh,
        grad_scale: float,
        dtype: torch.dtype | None,
        tensor_mesh: DeviceMesh | None = None,
    ) -> None:
        self.module = module
        self.tensor_mesh = tensor_mesh  # the axis that also splits each expert inside, if any
        self.sizes = local_intermediate(module, tensor_mesh.size()) if tensor_mesh else {}
        self.group = group
        self.ep_mesh = ep_mesh
        self.grad_scale = grad_scale
        self.dtype = dtype
        self.own_forward: Callable[..., torch.Tensor] = type(module).forward
        self.names = tuple(fqn.rpartition(".")[2] for fqn in group.params)
        self.last_counts: torch.Tensor | None = None

    # An eager island under torch.compile: the all-to-all sizes are this step's routing counts.
    @eager_island
    def __call__(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        tokens, k = top_k_index.shape
        experts = top_k_index.reshape(-1)
        order = torch.argsort(experts, stable=True)
        per_expert = torch.bincount(experts, minlength=self.group.num_experts)
        self.last_counts = per_expert.detach()
        sent, received, x, ids = self._dispatch(hidden_states, order, per_expert, k)
        y = self._compute(x, ids, received)
        back = funcol.all_to_all_single_autograd(y, sent, received, self._group())
        rows = back[_inverse(order)]
        products = rows.view(tokens, k, -1) * top_k_weights.view(tokens, k, 1)
        ascending = torch.argsort(top_k_index, dim=1, stable=True)
        products = products.gather(1, ascending.unsqueeze(-1).expand_as(products))
        out = torch.zeros_like(hidden_states)
        for j in range(k):
            out = out + products[:, j].to(out.dtype)
        return out

    def _group(self) -> dist.ProcessGroup:
        return self.ep_mesh.get_group()

    def _dispatch(
        self, hidden: torch.Tensor, order: torch.Tensor, per_expert: torch.Tensor, k: int
    ) -> tuple[list[int], list[int], torch.Tensor, torch.Tensor]:
        """The tokens per expert first (each rank receives, from every rank, how many rows go
        to each of its local experts), then the rows (differentiable). A source's rows arrive
        sorted by expert, so each row's local expert id follows from those counts."""
        group, local = self._group(), self.group.local_experts
        incoming = funcol.all_to_all_single(per_expert.contiguous(), None, None, group)
        incoming = funcol.wait_tensor(incoming) if isinstance(incoming, torch.Tensor) else incoming
        by_source = incoming.view(-1, local)  # [ep, local experts]
        sent = per_expert.view(-1, local).sum(1).tolist()
        received = by_source.sum(1).tolist()
        x = funcol.all_to_all_single_autograd(hidden[order // k], received, sent, group)
        experts = torch.arange(local, device=hidden.device).repeat(by_source.shape[0])
        ids = experts.repeat_interleave(by_source.flatten().to(hidden.device))
        return sent, received, x, ids

    def _compute(self, x: torch.Tensor, ids: torch.Tensor, received: list[int]) -> torch.Tensor:
        """The module's own forward on this rank's received rows, with its local experts."""
        overrides: dict[str, Any] = {"num_experts": self.group.local_experts, **self.sizes}
        for name in self.names:
            weight = getattr(self.module, name)
            weight = weight.to_local() if isinstance(weight, DTensor) else weight
            if self.dtype is not None and weight.dtype != self.dtype:
                weight = weight.to(self.dtype)
            overrides[name] = _ScaleGrad.apply(weight, self.grad_scale)
        ones = torch.ones(x.shape[0], 1, dtype=x.dtype, device=x.device)
        tensor_group = self.tensor_mesh.get_group() if self.tensor_mesh is not None else None
        if tensor_group is not None:  # the same rows on every tp rank, each a part of I
            x = sum_backward(x, tensor_group)
        y = self.own_forward(LocalExperts(self.module, overrides), x, ids.view(-1, 1), ones)
        if not sum(received):  # no rows: keep the local weights in the graph (zero gradients)
            y = y + sum(overrides[name].sum() for name in self.names) * 0
        return sum_forward(y, tensor_group) if tensor_group is not None else y


def _inverse(order: torch.Tensor) -> torch.Tensor:
    """The permutation that undoes ``order``."""
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return inverse


def experts_ignored(plan: Plan, model: nn.Module) -> set[nn.Parameter]:
    """The expert weights, which FSDP2 over the data and expert axes must not take (they are
    wrapped over the data axes alone, or stay expert-sharded when there is no data axis)."""
    return {model.get_parameter(fqn) for group in plan.experts for fqn in group.params}


def tokens_per_expert(plan: Plan, model: nn.Module) -> dict[str, torch.Tensor]:
    """Tokens routed to each expert in the last forward, summed over every token rank
    (the data, expert and context axes, as the count reducer sums): experts module FQN →
    ``[num_experts]`` counts (a collective: every rank calls it alike).

    Example (on every rank, after a step)::

        load = tokens_per_expert(plan, model)   # {"model.layers.0.mlp.experts": tensor([...])}
    """
    found: dict[str, torch.Tensor] = {}
    group = group_over(plan, plan.token_axes)
    for spec in plan.experts:
        forward = model.get_submodule(spec.fqn).forward
        counts = getattr(forward, "last_counts", None)
        total = (
            counts if counts is not None else torch.zeros(spec.num_experts, dtype=torch.long)
        ).clone()
        if group is not None:
            dist.all_reduce(total, group=group)
        found[spec.fqn] = total
    return found


def experts_of(plan: Plan, unit: str) -> tuple[str, ...]:
    """The planned experts modules inside FSDP unit ``unit`` (the root, ``''``, holds those in
    no block), wrapped by FSDP2 over the data axes before it."""
    blocks = [u.fqn for u in plan.units if u.fqn]
    found = []
    for group in plan.experts:
        owner = max((b for b in blocks if group.fqn.startswith(b + ".")), key=len, default="")
        if owner == unit:
            found.append(group.fqn)
    return tuple(found)


def router_metrics(plan: Plan, model: nn.Module) -> dict[str, float]:
    """Per-step router statistics for the metrics sinks, from :func:`tokens_per_expert` (a
    collective: every rank calls it alike): the fewest and most tokens any expert of any layer
    received over the batch ranks, and the worst layer's imbalance (its busiest expert's tokens
    over its mean); empty without expert parallelism.

    Example (on every rank, after a step)::

        sinks.log(step, {**metrics, **router_metrics(plan, model)})
    """
    loads = tokens_per_expert(plan, model)
    if not loads:
        return {}
    counts = torch.stack([load.double() for load in loads.values()])
    imbalance = counts.max(dim=1).values / counts.mean(dim=1).clamp_min(1e-12)
    return {
        "moe/tokens_per_expert_min": float(counts.min()),
        "moe/tokens_per_expert_max": float(counts.max()),
        "moe/load_imbalance": float(imbalance.max()),
    }
