"""The loss accounting of a step, for flat and pipelined plans alike: the summed token loss, the
step's loss tokens over every data-parallel rank and micro-batch, and the global loss.

Divide the summed per-token loss of each micro-batch by the token count of the whole step
(summed over data-parallel ranks and micro-batches). With data-parallel gradients summed (as
``mt.apply`` sets them), gradients then equal the single-device mean-loss gradients, whatever
the dp degree, micro-batch count or uneven token counts.

Example (on every rank)::

    tokens = global_token_count(plan, [(targets != IGNORE_INDEX).sum() for targets in micro])
    for inputs, targets in micro:
        (summed_cross_entropy(model(inputs), targets) / tokens).backward()
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

from meshtrain.lower.gather import full_tensor
from meshtrain.lower.groups import group_over, plan_device
from meshtrain.plan.ir import Plan
from meshtrain.plan.layers import main_output

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
#: Targets equal to this carry no loss (as in ``F.cross_entropy``).
IGNORE_INDEX = -100


def summed_cross_entropy(logits: Any, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy summed over a micro-batch's loss tokens (logits ``[..., classes]``, computed
    in fp32; targets equal to :data:`IGNORE_INDEX` carry no loss). A model output that is not a
    tensor — a Hugging Face ``ModelOutput``, a tuple — gives its ``logits`` (or first tensor).

    Example:
        >>> logits, targets = torch.zeros(2, 3, 5), torch.tensor([[1, 2, -100], [0, 4, 3]])
        >>> round(float(summed_cross_entropy(logits, targets)), 4)  # 5 tokens × ln 5
        8.0472
    """
    logits = main_output(logits)
    return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten(), reduction="sum")


def loss_tokens(targets: torch.Tensor) -> int:
    """The targets that carry loss (not :data:`IGNORE_INDEX`)."""
    return int((targets != IGNORE_INDEX).sum())


class StepTokens:
    """The step's loss tokens over every data-parallel rank, summed as a functional collective
    when the step starts and waited for where it is first read (after the first forward, or in
    the last pipeline stage's loss), so no rank blocks on it beforehand."""

    def __init__(self, plan: Plan, local: int) -> None:
        count = torch.tensor(float(local), device=plan_device(plan))
        group = group_over(plan, plan.token_axes)
        self._pending: torch.Tensor | None = (
            funcol.all_reduce(count, "sum", group) if group is not None else count
        )
        self._value: torch.Tensor | None = None

    @property
    def value(self) -> torch.Tensor:
        """The global count (a plain scalar tensor, waited for on first use)."""
        if self._value is None:
            assert self._pending is not None
            self._value = funcol.wait_tensor(self._pending)
            self._pending = None
        return self._value


def global_token_count(plan: Plan, local_counts: Sequence[torch.Tensor | int]) -> torch.Tensor:
    """Loss tokens of one step over every micro-batch and every data-parallel rank."""
    return StepTokens(plan, sum(int(count) for count in local_counts)).value


def plain_loss(loss: torch.Tensor) -> torch.Tensor:
    """A detached fp32 loss as a plain tensor (a loss-parallel loss is a replicated DTensor)."""
    return full_tensor(loss.detach()).float()


def loss_axes(plan: Plan) -> tuple[str, ...]:
    """The axes a step's loss is summed over: the data axes (and the context axis, whose ranks
    hold chunks of the same sequences), and the pipeline axis (only the last stage computes a
    loss, and every rank returns it)."""
    if plan.pipeline is None:
        return plan.token_axes
    return (plan.pipeline.axis, *plan.token_axes)


def reduce_loss(plan: Plan, value: torch.Tensor) -> torch.Tensor:
    """``value`` (this rank's share of the step's mean loss) summed in place over
    :func:`loss_axes` in one all-reduce: the global mean loss, on every rank."""
    group = group_over(plan, loss_axes(plan))
    if group is not None:
        dist.all_reduce(value, group=group)
    return value


def data_parallel_rank(plan: Plan) -> tuple[int, int]:
    """This rank's index among the plan's data-parallel ranks, and their number (tensor- and
    pipeline-parallel ranks of one data-parallel index share its data)."""
    coords = plan.mesh.coordinates(dist.get_rank())
    index, size = 0, 1
    for axis in plan.batch_axes:
        index = index * plan.mesh.size(axis) + coords[axis]
        size *= plan.mesh.size(axis)
    return index, size
