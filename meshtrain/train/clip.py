"""Gradient clipping by the global norm over every mesh axis (equal to the single-device norm).

Each gradient is a DTensor on some mesh (TP weights on the (dp, tp) mesh, others on dp only) or
a plain tensor. Squares are summed locally, grouped by (mesh, axes the gradient is sharded over),
and each group is all-reduced only over its sharded axes: replicated copies are counted once.

Example (on every rank, after backward)::

    norm = clip_grad_norm_(model.parameters(), max_norm=1.0)
    norm = clip_grad_norm_(pipelined.parameters(), max_norm=1.0, plan=plan)  # pipelined plan
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial

from meshtrain.errors import TrainingError
from meshtrain.lower.groups import group_over, plan_device
from meshtrain.plan.ir import Plan
from meshtrain.spec.placements import is_sharded


def global_grad_norm(
    parameters: Iterable[torch.nn.Parameter],
    *,
    plan: Plan | None = None,
    names: Mapping[int, str] | None = None,
) -> torch.Tensor:
    """The L2 norm of all gradients, as one device would compute it (on every rank).

    Under a pipelined ``plan`` each rank holds some stages' parameters only: the squares are
    summed over the pipeline axis as well. ``names`` (``id(parameter)`` → FQN) lets an error name
    the parameter.
    """
    params = [p for p in parameters if p.grad is not None]
    device = plan_device(plan) if plan is not None else _grad_device(params)
    groups: dict[tuple[object, tuple[int, ...]], torch.Tensor] = {}
    plain = torch.zeros((), dtype=torch.float64, device=device)
    for param in params:
        grad = param.grad
        if grad is None:
            continue
        if isinstance(grad, DTensor):
            if any(isinstance(p, Partial) for p in grad.placements):
                raise TrainingError(_partial_message(param, grad, names))
            sharded = tuple(i for i, p in enumerate(grad.placements) if is_sharded(p))
            key = (grad.device_mesh, sharded)
            local = grad.to_local().detach().double().pow(2).sum()
            groups[key] = (
                groups.get(key, torch.zeros((), dtype=torch.float64, device=device)) + local
            )
        else:
            plain = plain + grad.detach().double().pow(2).sum()
    total = plain
    for (mesh, sharded), squares in groups.items():
        for dim in sharded:
            dist.all_reduce(squares, group=mesh.get_group(dim))  # type: ignore[attr-defined]
        total = total + squares
    pipeline_group = (
        group_over(plan, (plan.pipeline.axis,)) if plan is not None and plan.pipeline else None
    )
    if pipeline_group is not None:
        dist.all_reduce(total, group=pipeline_group)
    return total.sqrt().float()


def _grad_device(params: list[torch.nn.Parameter]) -> torch.device:
    """Where the gradients live (their squares are reduced there: NCCL wants CUDA tensors)."""
    for param in params:
        grad = param.grad
        assert grad is not None
        return (grad.to_local() if isinstance(grad, DTensor) else grad).device
    return torch.device("cpu")


def _partial_message(
    param: torch.nn.Parameter, grad: DTensor, names: Mapping[int, str] | None
) -> str:
    name = (names or {}).get(id(param))
    what = f"parameter {name!r}" if name else "a parameter"
    shape = "×".join(str(size) for size in grad.shape)
    return (
        f"the gradient of {what} (shape {shape}, placements {tuple(grad.placements)} on "
        f"{grad.device_mesh}) is still a partial sum: a reduction the plan needs was not "
        "applied before clipping. Reduce it (redistribute to Replicate) or apply the plan with "
        "mt.apply, which adds the reductions it derives."
    )


@torch.no_grad()
def clip_grad_norm_(
    parameters: Iterable[torch.nn.Parameter], max_norm: float, *, plan: Plan | None = None
) -> torch.Tensor:
    """Scale gradients so their global norm is at most ``max_norm``; return the norm before.

    Pass the ``plan`` when it is pipelined, so the norm covers every stage.
    """
    params = [p for p in parameters if p.grad is not None]
    norm = global_grad_norm(params, plan=plan)
    scale_grads_(params, float(norm), max_norm)
    return norm


@torch.no_grad()
def scale_grads_(parameters: Iterable[torch.nn.Parameter], norm: float, max_norm: float) -> None:
    """Clip gradients whose global norm ``norm`` is already known (no collective) to ``max_norm``."""
    scale = min(1.0, max_norm / (norm + 1e-6))
    for param in parameters:
        if param.grad is not None:
            param.grad.mul_(scale)
