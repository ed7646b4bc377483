"""Held-out loss and perplexity on the plan a model trains with, without gradients.

Why: the training loss says how well a model fits what it has seen; a validation loss over
held-out data says whether it generalises, and it must be computed on the same plan (the same
shards, the same tensor-parallel loss) so no rank gathers the model to evaluate it.

:func:`evaluate` runs the applied model forward over batches (each data-parallel rank its share,
as training does), sums the cross-entropy and the loss tokens on every rank and reduces both over
the data-parallel ranks in one all-reduce: the mean loss per token over the whole validation
set, identical on every rank, and its perplexity ``exp(loss)``. Masked targets (``-100``:
prompts, document starts) count neither in the loss nor in the tokens.

Example (on every rank)::

    result = evaluate(plan, model, validation_loader.batches(), batches=8)
    result.loss, result.perplexity
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import islice
from typing import Any

import torch
import torch.distributed as dist

from meshtrain.errors import TrainingError
from meshtrain.lower import PipelinedModel
from meshtrain.lower.groups import group_over, plan_device
from meshtrain.lower.tensor_parallel import loss_parallel
from meshtrain.plan.ir import Plan
from meshtrain.train.batch import Batch
from meshtrain.train.loss import LossFn, loss_tokens, plain_loss, summed_cross_entropy

__all__ = ["EvalResult", "evaluate"]


@dataclass(frozen=True)
class EvalResult:
    """The mean loss per token over the evaluated batches, its perplexity and the token count."""

    loss: float
    perplexity: float
    tokens: int

    def metrics(self) -> dict[str, float]:
        """As logged: ``val_loss``, ``val_perplexity``, ``val_tokens``."""
        return {"val_loss": self.loss, "val_perplexity": self.perplexity,
                "val_tokens": float(self.tokens)}  # fmt: skip


def evaluate(
    plan: Plan,
    model: Any,
    batches: Iterable[Batch],
    *,
    batches_limit: int | None = None,
    loss_fn: LossFn = summed_cross_entropy,
) -> EvalResult:
    """The validation loss of ``model`` (what ``mt.apply(plan, ...)`` returned) over
    ``batches`` (at most ``batches_limit``); see the module docstring. Every rank calls it."""
    if isinstance(model, PipelinedModel) or plan.pipeline is not None:
        raise TrainingError(
            "evaluation runs a flat plan's model forward; this plan is pipelined. Evaluate "
            "the exported model on one process, or remove [eval] from a pipelined recipe."
        )
    device = plan_device(plan)
    totals = torch.zeros(2, dtype=torch.float64, device=device)  # summed loss, tokens
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for batch in islice(batches, batches_limit):
                inputs, targets = batch.inputs.to(device), batch.targets.to(device)
                with loss_parallel(plan):
                    summed = plain_loss(loss_fn(model(inputs), targets))
                totals[0] += summed.double()
                totals[1] += loss_tokens(targets)
    finally:
        model.train(was_training)
    group = group_over(plan, plan.data_axes)
    if group is not None:
        dist.all_reduce(totals, group=group)
    loss_sum, tokens = float(totals[0]), int(totals[1])
    if tokens == 0:
        raise TrainingError(
            "the validation batches hold no loss tokens (every target masked). Raise "
            "[eval] batches or data.validation."
        )
    loss = loss_sum / tokens
    return EvalResult(loss, math.exp(min(loss, 80.0)), tokens)
