"""The train step: ``step(state, batch) -> (state, metrics)`` for any plan.

One step, the same code for flat and pipelined plans, is: forward and backward over the plan's
micro-batches (the loss normalised by the step's loss tokens over every data-parallel rank and
micro-batch, counted once in :mod:`meshtrain.train.loss`; gradients synchronised once per step
under ZeRO 0/1, per micro-batch under ZeRO 2/3 so they stay sharded; a pipelined plan runs them
through its schedule), the global loss in one all-reduce, the global gradient norm and clipping, the learning rate from the schedule, then
the optimizer step — unless the loss or the gradients are not finite. Loss and gradient norm are
global values (every rank holds the same numbers), so the non-finite guard decides alike on every
rank: ``"skip"`` drops the step's update, ``"stop"`` raises :class:`~meshtrain.TrainingError`
everywhere. Under fp16 the :class:`~meshtrain.train.LossScaler` skips overflowing steps itself.

Example (on every rank)::

    applied = mt.apply(plan, model)
    optimizer = torch.optim.AdamW(applied.parameters(), lr=3e-4)
    step = make_train_step(plan, summed_cross_entropy, optimizer, WarmupCosine(3e-4, 100, 1000))
    state = TrainState.create(applied, optimizer)
    for batch in loader.batches(state.data):
        state, metrics = step(state, batch)
"""

from __future__ import annotations

import functools
import math
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from meshtrain.errors import TrainingError, format_shape
from meshtrain.lower.compute import compile_loss
from meshtrain.lower.context.parallel import positions_keyword, shard_batch
from meshtrain.lower.data.parallel import data_parallel_size, micro_batch
from meshtrain.lower.groups import plan_device
from meshtrain.lower.pipeline import PipelinedModel
from meshtrain.lower.tensor.parallel import loss_parallel
from meshtrain.plan.ir import Plan
from meshtrain.train.balance import after_optimizer_step, begin_step, set_aux_scale
from meshtrain.train.batch import Batch
from meshtrain.train.clip import global_grad_norm, scale_grads_
from meshtrain.train.guard import ON_NONFINITE, OnNonFinite
from meshtrain.train.loss import (
    LossFn,
    StepTokens,
    loss_tokens,
    plain_loss,
    reduce_loss,
    summed_cross_entropy,
)
from meshtrain.train.scaler import LossScaler
from meshtrain.train.state import TrainState

Schedule = Callable[[int], float]

__all__ = ["TrainStep", "forward_backward", "make_train_step"]


def make_train_step(
    plan: Plan,
    loss_fn: LossFn,
    optimizer: torch.optim.Optimizer,
    schedule: Schedule | None = None,
    *,
    max_norm: float | None = 1.0,
    on_nonfinite: OnNonFinite = "skip",
    scaler: LossScaler | None = None,
) -> TrainStep:
    """The train step of ``plan`` (see the module docstring).

    ``loss_fn(logits, targets)`` returns the *summed* loss of a micro-batch over its loss tokens
    (targets equal to ``meshtrain.train.IGNORE_INDEX`` = -100 carry no loss, as in ``F.cross_entropy``);
    :func:`summed_cross_entropy` is the usual one. ``schedule(step)`` gives the learning rate of
    each step (``None`` keeps the optimizer's). ``max_norm=None`` measures the gradient norm
    without clipping. Plain PyTorch optimizers work as they are.
    """
    if on_nonfinite not in ON_NONFINITE:
        raise TrainingError(
            f"on_nonfinite={on_nonfinite!r} is not a policy: use 'skip' (drop the step's update "
            "on every rank) or 'stop' (raise on every rank)."
        )
    if max_norm is not None and not max_norm > 0:
        raise TrainingError(f"max_norm={max_norm} must be positive, or None to not clip.")
    if plan.options.precision == "fp16" and scaler is None:
        scaler = LossScaler()
    return TrainStep(
        plan, compile_loss(plan, loss_fn), optimizer, schedule, max_norm, on_nonfinite, scaler
    )


@dataclass(frozen=True)
class TrainStep:
    """What :func:`make_train_step` returns; call it as ``step(state, batch)``."""

    plan: Plan
    loss_fn: LossFn
    optimizer: torch.optim.Optimizer
    schedule: Schedule | None
    max_norm: float | None
    on_nonfinite: OnNonFinite
    scaler: LossScaler | None

    def __call__(self, state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, float]]:
        if state.optimizer is not self.optimizer:
            raise TrainingError(
                "the TrainState's optimizer is not the one this train step was made with: build "
                "the state with TrainState.create(applied_model, optimizer) using the same "
                "optimizer you passed to make_train_step."
            )
        torch.set_rng_state(state.rng)
        lr = self.schedule(state.step) if self.schedule is not None else _lr(self.optimizer)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        # fp16: each rank's backward starts from the scaler's value, as one device's does; a
        # data-parallel mean then leaves the gradients scaled by value / ranks, and they are
        # unscaled by that. (Starting from value × ranks would overflow ranks× sooner.)
        scale = self.scaler.scale_value / backward_factor(self.plan) if self.scaler else 1.0
        loss, tokens = forward_backward(
            self.plan, state.model, batch, self.loss_fn, loss_scale=scale
        )
        params: list[Any] = [p for p in state.params.values() if p.grad is not None]
        finite_grads = self.scaler.unscale_(params, scale) if self.scaler is not None else True
        norm = self._grad_norm(params, state.params) if finite_grads else math.inf
        finite = math.isfinite(loss) and math.isfinite(norm)
        if not finite and self.on_nonfinite == "stop" and self.scaler is None:
            raise TrainingError(
                f"step {state.step}: the loss ({loss}) or the global gradient norm ({norm}) is "
                "not finite (every rank sees the same values and stops). Lower the learning "
                "rate, check the data at position "
                f"{batch.position}, or train with on_nonfinite='skip' to drop such steps."
            )
        if finite:
            self.optimizer.step()
            after_optimizer_step(state.model)  # MoE loss-free balancing from global counts
        self.optimizer.zero_grad(set_to_none=True)
        metrics = {
            "loss": loss,
            "grad_norm": norm,
            "lr": lr,
            "tokens": tokens,
            "skipped": float(not finite),
        }
        if self.scaler is not None:
            metrics["loss_scale"] = self.scaler.scale_value
            self.scaler.update()
        return state.advance(data=batch.position, rng=torch.get_rng_state()), metrics

    def _grad_norm(self, params: list[Any], named: Mapping[str, Any]) -> float:
        pipelined = self.plan if self.plan.pipeline is not None else None
        names = {id(param): fqn for fqn, param in named.items()}
        norm = float(global_grad_norm(params, plan=pipelined, names=names))
        if self.max_norm is not None and math.isfinite(norm):
            scale_grads_(params, norm, self.max_norm)
        return norm


def forward_backward(
    plan: Plan,
    model: Any,
    batch: Batch,
    loss_fn: LossFn = summed_cross_entropy,
    *,
    loss_scale: float = 1.0,
) -> tuple[float, float]:
    """Forward and backward of one step's batch on this rank; returns the global mean loss and
    the global loss-token count (the same on every rank).

    ``model`` is what ``mt.apply`` returned; ``batch`` is this data-parallel rank's share of the
    step, split along dim 0 into the plan's micro-batches (pipelined or accumulated); under
    context parallelism its sequences are whole, and this rank keeps its chunks of them.
    ``loss_fn(output, targets)`` returns a micro-batch's *summed* loss; it is divided by the
    step's loss tokens over every data-parallel rank and micro-batch (and scaled by
    :func:`backward_factor` under the plan's ``grad_reduction``), so gradients equal one
    device's mean-loss gradients. Gradients are left in ``.grad`` (multiplied by ``loss_scale``),
    synchronised as the plan says. Under a compiling plan pass ``compile_loss(plan, loss_fn)``.
    The batch's ``token_positions`` (packed documents) reach the model as ``positions`` or
    ``position_ids`` (:func:`~meshtrain.lower.context.parallel.positions_keyword`), cut like the
    tokens.
    """
    # under context parallelism this rank computes its chunks of every sequence
    inputs, targets, positions = _sharded(plan, batch)
    micro = plan.pipeline.microbatches if plan.pipeline is not None else plan.options.microbatches
    if inputs.shape[0] % micro or targets.shape[0] != inputs.shape[0]:
        raise TrainingError(
            f"a batch of shape {format_shape(tuple(inputs.shape))} (targets "
            f"{format_shape(tuple(targets.shape))}) does not split into the plan's {micro} "
            f"micro-batches along dim 0: give each data-parallel rank a multiple of {micro} "
            "sequences per step, with as many targets."
        )
    tokens = StepTokens(plan, loss_tokens(targets))
    scale = loss_scale * backward_factor(plan)
    # an MoE's balance loss: its share on each token rank and micro-batch (train/balance.py)
    set_aux_scale(model, scale / (data_parallel_size(plan) * micro))
    begin_step(model)  # MoE statistics count the step's whole batch, every micro-batch
    if plan.pipeline is None:
        forwards = _forwards(model, inputs.chunk(micro), positions, micro)
        summed = _accumulate(plan, model, forwards, targets.chunk(micro), loss_fn, tokens, scale)
    else:
        summed = _pipelined(plan, model, inputs, targets, loss_fn, tokens, scale)
    return float(reduce_loss(plan, summed)), float(tokens.value)


def _sharded(plan: Plan, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """This rank's inputs, targets and token positions (``None`` if the batch has none),
    cut along the sequence under context parallelism."""
    if batch.token_positions is None:
        inputs, targets = shard_batch(plan, batch.inputs, batch.targets)
        return inputs, targets, None
    if plan.pipeline is not None:
        raise TrainingError(
            "the batch carries token positions (packed documents attending within themselves), "
            "which pipeline stages do not pass on yet: train this plan without document "
            "positions (data.document_mask = false) or without pipeline parallelism."
        )
    if batch.token_positions.shape != batch.inputs.shape:
        raise TrainingError(
            f"the batch's token positions {format_shape(tuple(batch.token_positions.shape))} "
            f"must have the shape of its inputs {format_shape(tuple(batch.inputs.shape))}: one "
            "position per token."
        )
    inputs, targets, positions = shard_batch(
        plan, batch.inputs, batch.targets, batch.token_positions
    )
    return inputs, targets, positions


def _forwards(
    model: Any, inputs: Sequence[torch.Tensor], positions: torch.Tensor | None, micro: int
) -> list[Callable[[], Any]]:
    """One call of ``model`` per micro-batch, with its token positions when the batch has
    them."""
    if positions is None:
        return [functools.partial(model, x) for x in inputs]
    keyword = positions_keyword(model)
    return [
        functools.partial(model, x, **{keyword: p})
        for x, p in zip(inputs, positions.chunk(micro), strict=True)
    ]


def backward_factor(plan: Plan) -> float:
    """What the loss divided by the global tokens is multiplied by before backward so that the
    data-parallel reduction yields one device's gradients: 1 when the plan sums gradients, the
    number of data-parallel ranks when it averages them (PyTorch's default)."""
    return 1.0 if plan.options.grad_reduction == "sum" else float(data_parallel_size(plan))


def _accumulate(
    plan: Plan,
    model: Any,
    forwards: Sequence[Callable[[], Any]],
    targets: Sequence[torch.Tensor],
    loss_fn: LossFn,
    tokens: StepTokens,
    loss_scale: float,
) -> torch.Tensor:
    """Micro-batches one after another (gradient accumulation); this rank's summed loss."""
    summed = torch.zeros((), dtype=torch.float32, device=plan_device(plan))
    for i, (forward, y) in enumerate(zip(forwards, targets)):
        with micro_batch(plan, model, last=i == len(forwards) - 1), loss_parallel(plan):
            output = forward()
            loss = loss_fn(output, y) / tokens.value
            (loss * loss_scale).backward()
        summed += plain_loss(loss)
    return summed


class _ScheduleLoss:
    """The loss a pipeline schedule calls on each micro-batch of the last stage: the summed loss
    over the step's tokens, times the loss scale backward starts from."""

    def __init__(self, loss_fn: LossFn) -> None:
        self.loss_fn = loss_fn
        self.tokens: StepTokens | None = None
        self.scale = 1.0

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        assert self.tokens is not None
        return (self.loss_fn(output, target) / self.tokens.value) * self.scale


#: Each pipelined model's schedules, one per loss function (made on first use, by every rank).
_SCHEDULES: weakref.WeakKeyDictionary[PipelinedModel, dict[LossFn, tuple[Any, _ScheduleLoss]]] = (
    weakref.WeakKeyDictionary()
)


def _pipelined(
    plan: Plan,
    model: PipelinedModel,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    loss_fn: LossFn,
    tokens: StepTokens,
    loss_scale: float,
) -> torch.Tensor:
    """The schedule over this rank's stages; the summed loss of its last stage (0 elsewhere)."""
    schedules = _SCHEDULES.setdefault(model, {})
    if loss_fn not in schedules:
        step_loss = _ScheduleLoss(loss_fn)
        schedules[loss_fn] = (model.make_schedule(step_loss), step_loss)
    schedule, step_loss = schedules[loss_fn]
    step_loss.tokens, step_loss.scale = tokens, float(loss_scale)
    losses = model.run(schedule, inputs, targets)
    tokens.value  # noqa: B018 — stages without the loss wait for the count here
    summed = torch.zeros((), dtype=torch.float32, device=plan_device(plan))
    for loss in losses:
        summed += plain_loss(loss)
    return summed / step_loss.scale


def _lr(optimizer: torch.optim.Optimizer) -> float:
    return float(optimizer.param_groups[0]["lr"])
