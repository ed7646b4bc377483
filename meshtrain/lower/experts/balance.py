"""Balance statistics over the whole batch: a count reducer over the plan's token ranks, installed
on every module that takes one (``set_count_reducer``: meshtrain's MoE layers), so the balance
loss, the loss-free bias update and the router statistics count every rank's tokens as one device
counts its whole batch (see :func:`meshtrain.models.moe_experts.load_balance_loss`).

The token ranks (``Plan.token_axes``: the data axes, the expert axis and the context axis) are
the ranks that route different tokens; tensor- and pipeline-parallel ranks share theirs.

Example (inside :func:`~meshtrain.lower.apply`)::

    install_count_reducer(plan, model)
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn

from meshtrain.lower.groups import group_over
from meshtrain.plan.ir import Plan

__all__ = ["BatchSum", "install_count_reducer"]


class BatchSum:
    """Sums a tensor elementwise over one process group (a functional all-reduce, waited for:
    traceable by ``torch.compile``); every rank of the group calls it alike."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        return funcol.wait_tensor(funcol.all_reduce(tensor.contiguous(), "sum", self.group))

    def __repr__(self) -> str:
        return f"BatchSum(ranks={dist.get_world_size(self.group)})"


def install_count_reducer(plan: Plan, model: nn.Module) -> BatchSum | None:
    """Give every module of ``model`` with a ``set_count_reducer`` method a :class:`BatchSum`
    over the plan's token ranks; nothing (and ``None``) when they are this rank alone."""
    group = group_over(plan, plan.token_axes)
    if group is None:
        return None
    reducer = BatchSum(group)
    for module in model.modules():
        setter = getattr(module, "set_count_reducer", None)
        if callable(setter):
            setter(reducer)
    return reducer
