"""Held-out loss and perplexity on the plan a model trains with, without gradients.

Why: the training loss says how well a model fits what it has seen; a validation loss over
held-out data says whether it generalises, and it must be computed on the same plan (the same
shards, the same tensor-parallel loss) so no rank gathers the model to evaluate it.

:func:`evaluate` runs the applied model forward over batches (each data-parallel rank its share,
as training does; a pipelined model through its schedule's forward-only ``eval``, the last
stage's loss then passed to every stage), sums the cross-entropy and the loss tokens on every
rank and reduces both over the data-parallel ranks in one all-reduce: the mean loss per token over the whole validation
set, identical on every rank, and its perplexity ``exp(loss)``. Masked targets (``-100``:
prompts, document starts) count neither in the loss nor in the tokens.

Example (on every rank)::

    result = evaluate(plan, model, validation_loader.batches(), batches=8)
    result.loss, result.perplexity
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import islice
from typing import Any

import torch
import torch.distributed as dist

from meshtrain.errors import TrainingError
from meshtrain.lower import PipelinedModel
from meshtrain.lower.context.parallel import positions_keyword, shard_batch
from meshtrain.lower.groups import group_over, plan_device
from meshtrain.lower.pipeline import INPUTS
from meshtrain.lower.tensor.parallel import loss_parallel
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
        return {
            "val_loss": self.loss,
            "val_perplexity": self.perplexity,
            "val_tokens": float(self.tokens),
        }


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
    if isinstance(model, PipelinedModel):
        totals = _pipelined_totals(plan, model, islice(batches, batches_limit), loss_fn)
    else:
        totals = _flat_totals(plan, model, islice(batches, batches_limit), loss_fn)
    group = group_over(plan, plan.token_axes)
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


def _flat_totals(plan: Plan, model: Any, batches: Iterable[Batch], loss_fn: LossFn) -> torch.Tensor:
    """This data-parallel rank's summed loss and loss tokens, the model run forward per batch."""
    device = plan_device(plan)
    totals = torch.zeros(2, dtype=torch.float64, device=device)  # summed loss, tokens
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for batch in batches:
                batch = batch.to(device)
                # under context parallelism this rank's chunks of every sequence
                inputs, targets = shard_batch(plan, batch.inputs, batch.targets)
                keywords: dict[str, torch.Tensor] = {}
                if batch.token_positions is not None:  # packed documents, cut like the tokens
                    (positions,) = shard_batch(plan, batch.token_positions)
                    keywords = {positions_keyword(model): positions}
                with loss_parallel(plan):
                    summed = plain_loss(loss_fn(model(inputs, **keywords), targets))
                totals[0] += summed.double()
                totals[1] += loss_tokens(targets)
    finally:
        model.train(was_training)
    return totals


class _SummedLoss:
    """The loss an evaluation schedule calls on each micro-batch of the last stage: the summed
    token loss, no division, no scale (the totals are divided once, after the reduction)."""

    def __init__(self, loss_fn: LossFn) -> None:
        self.loss_fn = loss_fn

    def __call__(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        return plain_loss(self.loss_fn(output, target)).detach()


#: Each pipelined model's evaluation schedules, one per loss function (made on first use).
_EVAL_SCHEDULES: weakref.WeakKeyDictionary[PipelinedModel, dict[LossFn, Any]] = (
    weakref.WeakKeyDictionary()
)


def _pipelined_totals(
    plan: Plan, model: PipelinedModel, batches: Iterable[Batch], loss_fn: LossFn
) -> torch.Tensor:
    """This data-parallel rank's summed loss and loss tokens through the plan's pipeline
    schedule, forward only (``schedule.eval``): every stage receives the whole batch, as in
    training, the last stage sums the loss of each micro-batch, and the sum is passed to every
    stage of the pipeline (the other stages add zero) so each rank returns the same totals."""
    device = plan_device(plan)
    totals = torch.zeros(2, dtype=torch.float64, device=device)  # summed loss, tokens
    schedules = _EVAL_SCHEDULES.setdefault(model, {})
    if loss_fn not in schedules:
        schedules[loss_fn] = model.make_schedule(_SummedLoss(loss_fn))
    schedule = schedules[loss_fn]
    modes = [module.training for module in model.modules]
    for module in model.modules:
        module.eval()
    try:
        with torch.no_grad():
            for batch in batches:
                if batch.token_positions is not None:
                    raise TrainingError(
                        "the validation batches carry token positions (packed documents), "
                        "which pipeline stages do not pass on yet: evaluate without document "
                        "positions (data.document_mask = false) or without a pipeline."
                    )
                inputs, targets = batch.inputs.to(device), batch.targets.to(device)
                for loss in _forward_only(model, schedule, inputs, targets):
                    totals[0] += loss.double()
                totals[1] += loss_tokens(targets)
    finally:
        for module, mode in zip(model.modules, modes):
            module.train(mode)
    assert plan.pipeline is not None
    pipeline_group = group_over(plan, (plan.pipeline.axis,))
    if pipeline_group is not None:  # the last stage's sum to every stage
        loss_sum = totals[:1].clone()
        dist.all_reduce(loss_sum, group=pipeline_group)
        totals[0] = loss_sum[0]
    return totals


def _forward_only(
    model: PipelinedModel, schedule: Any, inputs: torch.Tensor, targets: torch.Tensor
) -> list[torch.Tensor]:
    """One batch through ``schedule.eval`` (micro-batches as in training, no backward), fed as
    :meth:`PipelinedModel.run` feeds a training step; the last stage's summed micro-batch losses
    (empty on other stages)."""
    losses: list[torch.Tensor] = []
    args = (inputs,) if model.has_first else ()
    kwargs: dict[str, Any] = {INPUTS: inputs}
    if model.has_last:
        kwargs.update(target=targets, losses=losses)
    with loss_parallel(model.plan):
        schedule.eval(*args, **kwargs)
    return losses
