"""Lowering a pipelined plan: stage modules, ``torch.distributed.pipelining`` stages and schedule.

A stage is the full model with the other stages' units removed (blocks deleted from their
container, root-level units set to ``None``), so parameter FQNs — and checkpoints — do not depend
on the stage layout. Each local stage module is then parallelised like any model (tensor
parallel, then data parallel per unit and the stage root) over the mesh without the pipeline
axis, and handed to ``PipelineStage``; the schedule's ``step`` runs the micro-batches.

The model's ``forward`` must run with units removed: skip a root-level unit that is ``None`` and
iterate the blocks' container (meshtrain's Llama does; so does torchtitan's).

The train step (:func:`meshtrain.train.forward_backward`) owns the loss, its token count and
its reduction, for pipelined and flat plans alike; lowering returns stages and a schedule.

Example (on every rank of a 4-rank job, mesh ``pp=2, dp=2``)::

    plan = mt.plan(model, mesh, rules, pipeline=mt.Pipeline(schedule="1F1B", microbatches=4))
    pipelined = mt.apply(plan, model)               # this rank's stage(s), parallelised
    loss, tokens = forward_backward(plan, pipelined, Batch(inputs, targets))
    clip_grad_norm_(pipelined.parameters(), 1.0, plan=plan)
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    PipelineScheduleMulti,
    PipelineScheduleSingle,
    get_schedule_class,
)

from meshtrain.lower.flat import parallelize
from meshtrain.lower.groups import device_mesh, plan_device
from meshtrain.lower.tensor_parallel import PartialGradSync, loss_parallel
from meshtrain.plan.ir import Plan, StagePlan

Schedule = PipelineScheduleSingle | PipelineScheduleMulti


class PipelinedModel:
    """This rank's pipeline stage modules and ``PipelineStage`` objects (``mt.apply``'s result under a
    pipeline). Parameters keep the full model's FQNs. The train step owns the loss: it makes a
    schedule with its loss function (:meth:`make_schedule`) and runs a step's batch through it
    (:meth:`run`)."""

    def __init__(self, plan: Plan, modules: list[nn.Module], stages: list[PipelineStage]) -> None:
        assert plan.pipeline is not None
        self.plan = plan
        self.modules = modules
        self.stages = stages
        self.has_first = any(stage.is_first for stage in stages)
        self.has_last = any(stage.is_last for stage in stages)

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """Every local parameter under its full-model FQN."""
        for module in self.modules:
            yield from module.named_parameters()

    def parameters(self) -> Iterator[nn.Parameter]:
        """Every local parameter (for the optimizer and clipping)."""
        for _, param in self.named_parameters():
            yield param

    def make_schedule(
        self, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    ) -> Schedule:
        """The plan's ``torch.distributed.pipelining`` schedule over this rank's stages, calling
        ``loss_fn(output, target)`` on each micro-batch of the last stage and running backward
        from what it returns (gradients are not scaled by the schedule)."""
        pipeline = self.plan.pipeline
        assert pipeline is not None
        cls = get_schedule_class(pipeline.schedule)
        stages: Any = self.stages[0] if issubclass(cls, PipelineScheduleSingle) else self.stages
        return cls(stages, n_microbatches=pipeline.microbatches, loss_fn=loss_fn, scale_grads=False)

    def run(
        self, schedule: Schedule, inputs: torch.Tensor, targets: torch.Tensor
    ) -> list[torch.Tensor]:
        """Forward and backward of one step's batch (split into the plan's micro-batches along
        dim 0) through ``schedule``; every rank passes its data-parallel rank's whole batch.
        Returns what the loss function returned for each micro-batch (on the last stage; empty
        elsewhere)."""
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.has_first else ()
        kwargs: dict[str, Any] = {"target": targets, "losses": losses} if self.has_last else {}
        with self._hold_partial_grads(), loss_parallel(self.plan):
            schedule.step(*args, **kwargs)
        return losses

    @contextlib.contextmanager
    def _hold_partial_grads(self) -> Iterator[None]:
        """Sequence-parallel norm gradients stay partial sums across the micro-batches of a
        step and are reduced once after it (FSDP2 reduces them itself when present)."""
        syncs = [
            sync
            for module in self.modules
            if isinstance(
                sync := getattr(module, "_meshtrain_partial_grads", None), PartialGradSync
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
    assert pipeline is not None
    pp_mesh = device_mesh(plan.mesh)[pipeline.axis]
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
