"""The train step: ``step(state, batch) -> (state, metrics)`` for any plan.

One step is: forward and backward over the plan's micro-batches (the loss normalised by the
step's loss tokens over every data-parallel rank and micro-batch; gradients synchronised once per
step under ZeRO 0/1, per micro-batch under ZeRO 2/3 so they stay sharded; a pipelined plan runs
its schedule), the global gradient norm and clipping, the learning rate from the schedule, then
the optimizer step — unless the loss or the gradients are not finite. Loss and gradient norm are
global values (every rank holds the same numbers), so the non-finite guard decides alike on every
rank: ``"skip"`` drops the step's update, ``"stop"`` raises :class:`~meshtrain.TrainingError`
everywhere. Under fp16 the :class:`~meshtrain.train.LossScaler` skips overflowing steps itself.

Example (on every rank)::

    applied = plan.apply(model)
    optimizer = torch.optim.AdamW(applied.parameters(), lr=3e-4)
    step = make_train_step(plan, summed_cross_entropy, optimizer, WarmupCosine(3e-4, 100, 1000))
    state = TrainState.create(applied, optimizer)
    for batch in loader.batches(state.data):
        state, metrics = step(state, batch)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch.distributed.tensor import DTensor

from meshtrain.plan.ir import Plan
from meshtrain.plan.lower import plan_device
from meshtrain.plan.lower_pipeline import summed_cross_entropy
from meshtrain.spec.errors import TrainingError
from meshtrain.train.batch import Batch
from meshtrain.train.clip import global_grad_norm, scale_grads_
from meshtrain.train.loss import data_parallel_sum, global_token_count
from meshtrain.train.scaler import LossScaler
from meshtrain.train.state import TrainState

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Schedule = Callable[[int], float]
OnNonFinite = Literal["skip", "stop"]
IGNORE_INDEX = -100

__all__ = ["IGNORE_INDEX", "TrainStep", "forward_backward", "make_train_step",
           "summed_cross_entropy"]  # fmt: skip


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
    (targets equal to ``IGNORE_INDEX`` = -100 carry no loss, as in ``F.cross_entropy``);
    :func:`summed_cross_entropy` is the usual one. ``schedule(step)`` gives the learning rate of
    each step (``None`` keeps the optimizer's). ``max_norm=None`` measures the gradient norm
    without clipping. Plain PyTorch optimizers work as they are.
    """
    if on_nonfinite not in ("skip", "stop"):
        raise TrainingError(
            f"on_nonfinite={on_nonfinite!r} is not a policy: use 'skip' (drop the step's update "
            "on every rank) or 'stop' (raise on every rank)."
        )
    if max_norm is not None and not max_norm > 0:
        raise TrainingError(f"max_norm={max_norm} must be positive, or None to not clip.")
    if plan.options.precision == "fp16" and scaler is None:
        scaler = LossScaler()
    if plan.pipeline is None:
        loss_fn = plan.compile_loss(loss_fn)  # a pipelined model compiles its own
    return TrainStep(plan, loss_fn, optimizer, schedule, max_norm, on_nonfinite, scaler)


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
        scale = self.scaler.scale_value if self.scaler is not None else 1.0
        loss, tokens = forward_backward(
            self.plan, state.model, batch, self.loss_fn, loss_scale=scale
        )
        params: list[Any] = [p for p in state.params.values() if p.grad is not None]
        finite_grads = self.scaler.unscale_(params) if self.scaler is not None else True
        norm = self._grad_norm(params) if finite_grads else math.inf
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
        self.optimizer.zero_grad(set_to_none=True)
        metrics = {"loss": loss, "grad_norm": norm, "lr": lr, "tokens": tokens,
                   "skipped": float(not finite)}  # fmt: skip
        if self.scaler is not None:
            metrics["loss_scale"] = self.scaler.scale_value
            self.scaler.update()
        return state.advance(data=batch.position, rng=torch.get_rng_state()), metrics

    def _grad_norm(self, params: list[Any]) -> float:
        pipelined = self.plan if self.plan.pipeline is not None else None
        norm = float(global_grad_norm(params, plan=pipelined))
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

    ``model`` is what ``plan.apply`` returned; gradients are left in ``.grad`` (multiplied by
    ``loss_scale``), synchronised as the plan says. Under a compiling plan pass
    ``plan.compile_loss(loss_fn)`` (a pipelined model compiles the loss itself).
    """
    inputs, targets = batch.inputs, batch.targets
    if plan.pipeline is not None:
        local = int((targets != IGNORE_INDEX).sum())
        loss = model.step(inputs, targets, loss_fn, token_count=local, loss_scale=loss_scale)
        return float(loss), model.step_tokens
    micro = plan.options.microbatches
    if inputs.shape[0] % micro:
        raise TrainingError(
            f"a batch of {inputs.shape[0]} sequences does not split into the plan's {micro} "
            "micro-batches: give each data-parallel rank a multiple of "
            f"{micro} sequences per step."
        )
    pairs = list(zip(inputs.chunk(micro), targets.chunk(micro)))
    total = global_token_count(plan, [(y != IGNORE_INDEX).sum() for _, y in pairs])
    summed = torch.zeros((), dtype=torch.float32, device=plan_device(plan))
    for i, (x, y) in enumerate(pairs):
        with plan.micro_batch(model, last=i == len(pairs) - 1), plan.loss_parallel():
            loss = loss_fn(model(x), y) / total
            (loss * loss_scale).backward()
        detached = loss.detach()
        summed += (detached.full_tensor() if isinstance(detached, DTensor) else detached).float()
    return float(data_parallel_sum(plan, summed)), float(total)


def _lr(optimizer: torch.optim.Optimizer) -> float:
    return float(optimizer.param_groups[0]["lr"])
