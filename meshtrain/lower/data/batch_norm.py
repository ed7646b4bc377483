"""BatchNorm over the global batch: statistics summed over every data-parallel rank.

A BatchNorm under data parallelism would otherwise normalise each rank's share of the batch with
that share's statistics (PyTorch's ``DistributedDataParallel`` does so unless the model is
converted to ``SyncBatchNorm``, which in torch 2.13 runs on GPUs only). Here each BatchNorm's
training forward computes the mean and the biased variance per channel from sums all-reduced over
the plan's data axes (differentiably, so backward matches one device), normalises with them and
updates its running statistics with the unbiased variance, exactly as one device would on the
whole batch — so the buffers stay identical on every data-parallel rank. Evaluation mode uses the
running statistics unchanged.

Example (inside :func:`~meshtrain.lower.flat.parallelize`)::

    sync_batch_norms(plan, model)
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed import ProcessGroup

from meshtrain.lower.groups import group_over
from meshtrain.plan.ir import Plan


def sync_batch_norms(plan: Plan, model: nn.Module) -> None:
    """Make every BatchNorm the plan lists (and this model holds) use global-batch statistics."""
    group = group_over(plan, plan.data_axes) if plan.data_axes else None
    if group is None:
        return
    modules = dict(model.named_modules())
    for fqn in plan.batch_norms:
        module = modules.get(fqn)
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            module.forward = functools.partial(_forward, module, module.forward, group)  # type: ignore[method-assign]


def _forward(
    module: nn.modules.batchnorm._BatchNorm,
    local_forward: Callable[[torch.Tensor], torch.Tensor],
    group: ProcessGroup,
    x: torch.Tensor,
) -> torch.Tensor:
    batch_statistics = module.training or module.running_mean is None
    if not batch_statistics:
        return local_forward(x)  # running statistics: the same on every rank
    dims = [0, *range(2, x.dim())]
    count = torch.tensor(float(x.numel() // x.shape[1]), device=x.device, dtype=torch.float32)
    stacked = torch.cat([x.float().sum(dims), count.reshape(1)])
    stacked = _summed(stacked, group)
    total, n = stacked[:-1], stacked[-1]
    mean = total / n
    centred = x.float() - _channels(mean, x)
    squares = _summed(centred.pow(2).sum(dims), group)
    var = squares / n
    if module.training and module.track_running_stats:
        _update_running(module, mean.detach(), var.detach(), float(n.detach()))
    y = centred / torch.sqrt(_channels(var, x) + module.eps)
    if module.affine:
        y = y * _channels(module.weight, x) + _channels(module.bias, x)
    return y.to(x.dtype)


def _summed(value: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """``value`` summed over ``group``, differentiably (backward sums the gradients too)."""
    return funcol.wait_tensor(funcol.all_reduce(value, "sum", group))


def _channels(values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Per-channel values shaped to broadcast over ``[N, C, *]``."""
    return values.reshape(1, -1, *([1] * (like.dim() - 2)))


@torch.no_grad()
def _update_running(
    module: nn.modules.batchnorm._BatchNorm, mean: torch.Tensor, var: torch.Tensor, n: float
) -> None:
    assert module.running_mean is not None and module.running_var is not None
    assert module.num_batches_tracked is not None
    module.num_batches_tracked.add_(1)
    momentum: Any = module.momentum
    factor = 1.0 / float(module.num_batches_tracked) if momentum is None else momentum
    unbiased = var * (n / max(n - 1.0, 1.0))
    module.running_mean.mul_(1 - factor).add_(mean.to(module.running_mean.dtype), alpha=factor)
    module.running_var.mul_(1 - factor).add_(unbiased.to(module.running_var.dtype), alpha=factor)
