"""Loss normalisation by the global number of loss tokens.

Divide the summed per-token loss of each micro-batch by the token count of the whole step
(summed over data-parallel ranks and micro-batches). With data-parallel gradients summed (as
``Plan.apply`` sets them), gradients then equal the single-device mean-loss gradients, whatever
the dp degree, micro-batch count or uneven token counts.

Example (on every rank)::

    tokens = global_token_count(plan, [(targets != ignore).sum() for targets in micro_batches])
    for targets in micro_batches:
        (loss_sum(targets) / tokens).backward()
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from meshtrain.plan.ir import Plan
from meshtrain.plan.lower import group_over, plan_device


def global_token_count(plan: Plan, local_counts: Sequence[torch.Tensor | int]) -> torch.Tensor:
    """Loss tokens of one step over every micro-batch and every data-parallel rank."""
    total = torch.tensor(float(sum(int(count) for count in local_counts)), device=plan_device(plan))
    return data_parallel_sum(plan, total)


def data_parallel_sum(plan: Plan, value: torch.Tensor) -> torch.Tensor:
    """``value`` summed in place over the plan's data-parallel ranks: one all-reduce, over all
    data axes together (HSDP's replicate and shard axes included)."""
    group = group_over(plan, plan.data_axes)
    if group is not None:
        dist.all_reduce(value, group=group)
    return value


def data_parallel_rank(plan: Plan) -> tuple[int, int]:
    """This rank's index among the plan's data-parallel ranks, and their number (tensor- and
    pipeline-parallel ranks of one data-parallel index share its data)."""
    coords = plan.mesh.coordinates(dist.get_rank())
    index, size = 0, 1
    for axis in plan.data_axes:
        index = index * plan.mesh.size(axis) + coords[axis]
        size *= plan.mesh.size(axis)
    return index, size
