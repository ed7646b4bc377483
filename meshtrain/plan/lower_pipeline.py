"""Lowering a pipelined plan: stage modules, ``torch.distributed.pipelining`` stages and schedule.

A stage is the full model with the other stages' units removed (blocks deleted from their
container, root-level units set to ``None``), so parameter FQNs — and checkpoints — do not depend
on the stage layout. Each local stage module is then parallelised like any model (tensor
parallel, then data parallel per unit and the stage root) over the mesh without the pipeline
axis, and handed to ``PipelineStage``; the schedule's ``step`` runs the micro-batches.

The model's ``forward`` must run with units removed: skip a root-level unit that is ``None`` and
iterate the blocks' container (meshtrain's Llama does; so does torchtitan's).

Example (on every rank of a 4-rank job, mesh ``pp=2, dp=2``)::

    plan = mt.plan(model, mesh, rules, pipeline=mt.Pipeline(schedule="1F1B", microbatches=4))
    pipelined = plan.apply(model)                   # this rank's stage(s), parallelised
    loss = pipelined.step(tokens, targets)          # the step's mean loss, on every rank
    clip_grad_norm_(pipelined.parameters(), 1.0, plan=plan)
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class
from torch.distributed.tensor import DTensor

from meshtrain.plan.ir import Plan, StagePlan
from meshtrain.plan.lower import (
    _PartialGradSync,
    group_over,
    loss_context,
    parallelize,
    plan_device,
)
from meshtrain.plan.lower_compute import compile_loss
from meshtrain.spec.errors import PlanError, format_shape

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def summed_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy summed over a micro-batch's tokens (the default pipeline loss)."""
    return F.cross_entropy(logits.flatten(0, -2), targets.flatten(), reduction="sum")


class PipelinedModel:
    """This rank's pipeline stage modules and the schedule that runs them (``Plan.apply``'s result
    under a pipeline). Parameters keep the full model's FQNs."""

    def __init__(self, plan: Plan, modules: list[nn.Module], stages: list[PipelineStage]) -> None:
        assert plan.pipeline is not None and plan.mesh.device_mesh is not None
        self.plan = plan
        self.modules = modules
        self.stages = stages
        self._tokens = torch.ones(())
        self._loss_fn: LossFn = summed_cross_entropy
        self._loss_scale = 1.0
        self._compiled_losses: dict[LossFn, LossFn] = {}
        pipeline = plan.pipeline
        cls = get_schedule_class(pipeline.schedule)
        self.schedule = cls(
            stages[0] if issubclass(cls, PipelineScheduleSingle) else stages,
            n_microbatches=pipeline.microbatches,
            loss_fn=self._scaled_loss,
            scale_grads=False,
        )
        self.has_first = any(stage.is_first for stage in stages)
        self.has_last = any(stage.is_last for stage in stages)
        # one group each for the step's two scalar sums (created here, by every rank alike)
        self._data_group = group_over(plan, plan.data_axes)
        self._loss_group = group_over(plan, (pipeline.axis, *plan.data_axes))

    def _scaled_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self._loss_fn(output, target) * (self._loss_scale / self._tokens)

    @property
    def step_tokens(self) -> float:
        """Loss tokens of the last :meth:`step` over every data-parallel rank."""
        return float(self._tokens)

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """Every local parameter under its full-model FQN."""
        for module in self.modules:
            yield from module.named_parameters()

    def parameters(self) -> Iterator[nn.Parameter]:
        """Every local parameter (for the optimizer and clipping)."""
        for _, param in self.named_parameters():
            yield param

    def step(
        self,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        loss_fn: LossFn = summed_cross_entropy,
        *,
        token_count: int | torch.Tensor | None = None,
        loss_scale: float = 1.0,
    ) -> torch.Tensor:
        """Forward and backward of one step's batch through the pipeline; returns its mean loss.

        Every rank passes its data-parallel rank's whole batch (``[batch, ...]``, split into the
        plan's micro-batches) and targets. ``loss_fn`` returns a micro-batch's *summed* loss;
        it is divided by the step's loss tokens over every data-parallel rank (``token_count``
        on this rank, default ``targets.numel()``), so gradients equal one device's mean-loss
        gradients. The returned loss is the global mean, on every rank.
        ``loss_scale`` multiplies the loss backward starts from (fp16:
        :class:`~meshtrain.train.LossScaler`'s ``scale_value``); the returned loss is unscaled.
        The loss function is compiled when the plan compiles.
        """
        pipeline = self.plan.pipeline
        assert pipeline is not None
        micro = pipeline.microbatches
        if inputs.shape[0] % micro or targets.shape[0] != inputs.shape[0]:
            raise PlanError(
                f"a step's batch of shape {format_shape(tuple(inputs.shape))} (targets "
                f"{format_shape(tuple(targets.shape))}) does not split into {micro} pipeline "
                f"micro-batches along dim 0: feed a multiple of {micro} sequences per "
                "data-parallel rank, with as many targets."
            )
        count = token_count if token_count is not None else targets.numel()
        tokens = torch.tensor(float(count), device=plan_device(self.plan))
        # Summed as a functional collective, waited for where it is first read: only the last
        # stage's loss reads it during the schedule, so no rank blocks on it beforehand.
        self._tokens = (
            funcol.all_reduce(tokens, "sum", self._data_group) if self._data_group else tokens
        )
        if loss_fn not in self._compiled_losses:
            self._compiled_losses[loss_fn] = compile_loss(self.plan, loss_fn)
        self._loss_fn = self._compiled_losses[loss_fn]
        self._loss_scale = float(loss_scale)
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.has_first else ()
        kwargs: dict[str, Any] = {"target": targets, "losses": losses} if self.has_last else {}
        with self._hold_partial_grads(), loss_context(self.plan):
            self.schedule.step(*args, **kwargs)
        self._tokens = funcol.wait_tensor(self._tokens)  # stages without the loss never read it
        total = torch.zeros((), device=plan_device(self.plan))
        for loss in losses:
            value = loss.detach()
            total += value.full_tensor() if isinstance(value, DTensor) else value
        dist.all_reduce(total, group=self._loss_group)  # last stages' sums, over pp and data
        return total / self._loss_scale

    @contextlib.contextmanager
    def _hold_partial_grads(self) -> Iterator[None]:
        """Sequence-parallel norm gradients stay partial sums across the micro-batches of a
        step and are reduced once after it (FSDP2 reduces them itself when present)."""
        syncs = [
            sync
            for module in self.modules
            if isinstance(
                sync := getattr(module, "_meshtrain_partial_grads", None), _PartialGradSync
            )
        ]
        for sync in syncs:
            sync.enabled = False
        yield
        for sync in syncs:
            sync.enabled = True
        if syncs:
            for param in self.parameters():
                syncs[0](param)  # reduces a partial-sum gradient, leaves others alone


def apply_pipeline(plan: Plan, model: nn.Module) -> PipelinedModel:
    """Build, parallelise and wrap this rank's stages (see the module docstring)."""
    pipeline = plan.pipeline
    device_mesh = plan.mesh.device_mesh
    assert pipeline is not None and device_mesh is not None
    pp_mesh = device_mesh[pipeline.axis]
    local = pipeline.local_stages(pp_mesh.get_local_rank())
    # Copy first: the last local stage reuses (and prunes) the model itself.
    bodies = [copy.deepcopy(model) for _ in local[:-1]] + [model]
    device = plan_device(plan)
    modules, stages = [], []
    for stage, body in zip(local, bodies):
        _prune(body, stage)
        parallelize(_stage_plan(plan, stage, body), body)
        modules.append(body)
        stages.append(
            PipelineStage(
                body, stage.index, len(pipeline.stages), device, group=pp_mesh.get_group()
            )
        )
    return PipelinedModel(plan, modules, stages)


def _stage_plan(plan: Plan, stage: StagePlan, body: nn.Module) -> Plan:
    """The plan restricted to one stage's modules (no pipeline: the stage is a plain model)."""
    present = {fqn for fqn, _ in body.named_modules()}
    kept = set(stage.params)
    return replace(
        plan,
        params=tuple(p for p in plan.params if p.fqn in kept),
        styles=tuple(s for s in plan.styles if s.fqn in present),
        units=tuple(u for u in plan.units if u.fqn in present),
        pipeline=None,
    )


class _KeptBlocks(nn.Module):
    """The blocks of a ``ModuleList`` one stage keeps, under their original indices (so FQNs stay
    ``layers.5.…``); iterates, indexes and measures like the list it replaces."""

    def __init__(self, blocks: dict[str, nn.Module]) -> None:
        super().__init__()
        for name, block in blocks.items():
            self.add_module(name, block)

    def __iter__(self) -> Iterator[nn.Module]:
        return iter(self._modules.values())  # type: ignore[arg-type]

    def __len__(self) -> int:
        return len(self._modules)

    def __getitem__(self, index: int) -> nn.Module:
        return list(self)[index]


def _prune(body: nn.Module, stage: StagePlan) -> None:
    """Remove every unit ``stage`` does not keep (blocks from their container, root units → None)."""
    keep = set(stage.modules)
    for name, child in list(body.named_children()):
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            kept = {n: b for n, b in child.named_children() if f"{name}.{n}" in keep}
            if isinstance(child, nn.ModuleDict):
                for block in [n for n in child if n not in kept]:
                    del child[block]
            else:
                setattr(body, name, _KeptBlocks(kept))
        elif name not in keep and any(True for _ in child.parameters()):
            setattr(body, name, None)
