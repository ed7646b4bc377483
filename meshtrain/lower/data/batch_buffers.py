"""Buffers a forward writes from the batch, averaged over the batch axes (``batch_buffers=
"average"``): the plan-time abstract run found them (``Plan.averaged_buffers``); after each
forward of the module that writes one, every rank's value is replaced by the mean over the ranks
of the plan's token axes (data, expert and context ranks: those holding different rows or
tokens). For a statistic linear in the batch (a running mean ``m ← a·m + (1 - a)·mean(x)``) with
equal rows per rank this is one device's update on the whole batch, as SyncBatchNorm's statistics
are. One all-reduce per buffer per forward, counted in the plan's collectives.

Example (inside :func:`~meshtrain.lower.flat.parallelize`)::

    average_batch_buffers(plan, model)
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from meshtrain.lower.groups import group_over
from meshtrain.plan.ir import Plan


def average_batch_buffers(plan: Plan, model: nn.Module) -> None:
    """Hook each writer of the plan's averaged buffers that ``model`` holds (see module doc)."""
    group = group_over(plan, plan.token_axes) if plan.averaged_buffers else None
    if group is None:
        return
    modules = dict(model.named_modules())
    for fqn, writer in plan.averaged_buffers:
        owner, _, name = fqn.rpartition(".")
        if owner in modules and writer in modules:
            hook = functools.partial(_average, group, modules[owner], name)
            modules[writer].register_forward_hook(hook)


def _average(
    group: ProcessGroup, owner: nn.Module, name: str, module: nn.Module, args: Any, output: Any
) -> None:
    buffer = owner._buffers.get(name)
    if buffer is None:
        return
    with torch.no_grad():
        summed = buffer.detach().clone()
        dist.all_reduce(summed, group=group)
        buffer.copy_(summed / dist.get_world_size(group))
