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
import functools
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
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from meshtrain.lower.flat import parallelize
from meshtrain.lower.groups import device_mesh, plan_device
from meshtrain.lower.tensor.parallel import PartialGradSync, loss_parallel
from meshtrain.plan.ir import Plan, StagePlan, TPStyle
from meshtrain.plan.layers import main_output
from meshtrain.plan.tensor.styles import activation_argument

Schedule = PipelineScheduleSingle | PipelineScheduleMulti


class PipelinedModel:
    """This rank's pipeline stage modules and ``PipelineStage`` objects (``mt.apply``'s result under a
    pipeline). Parameters keep the full model's FQNs. The train step owns the loss: it makes a
    schedule with its loss function (:meth:`make_schedule`) and runs a step's batch through it
    (:meth:`run`)."""

    def __init__(
        self,
        plan: Plan,
        modules: list[nn.Module],
        stages: list[PipelineStage],
        runners: list[_StageRunner] | None = None,
    ) -> None:
        assert plan.pipeline is not None
        self.plan = plan
        self.modules = modules
        self.stages = stages
        self.runners = runners or []
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
        ``loss_fn(output, target)`` on each micro-batch of the last stage (``output`` is what the
        model returns on one device: a ``ModelOutput``, a tuple or a tensor) and running backward
        from what it returns (gradients are not scaled by the schedule)."""
        pipeline = self.plan.pipeline
        assert pipeline is not None
        cls = get_schedule_class(pipeline.schedule)
        stages: Any = self.stages[0] if issubclass(cls, PipelineScheduleSingle) else self.stages
        last = next((runner for runner in self.runners if runner.last), None)
        if last is not None:  # the last stage sends its output's tensors: rebuilt for loss_fn
            loss_fn = functools.partial(_loss_on_model_output, last, loss_fn)
        return cls(stages, n_microbatches=pipeline.microbatches, loss_fn=loss_fn, scale_grads=False)

    def run(
        self, schedule: Schedule, inputs: torch.Tensor, targets: torch.Tensor
    ) -> list[torch.Tensor]:
        """Forward and backward of one step's batch (split into the plan's micro-batches along
        dim 0) through ``schedule``; every rank passes its data-parallel rank's whole batch (every
        stage runs the model's code before the blocks on it). Returns what the loss function
        returned for each micro-batch (on the last stage; empty elsewhere)."""
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.has_first else ()
        kwargs: dict[str, Any] = {INPUTS: inputs}
        if self.has_last:
            kwargs.update(target=targets, losses=losses)
        with self._hold_partial_grads(), loss_parallel(self.plan):
            schedule.step(*args, return_outputs=False, **kwargs)  # the losses are what is kept
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
    modules, stages, runners = [], [], []
    for stage, body in zip(local, bodies):
        runner = _prune(body, stage, plan)
        parallelize(_stage_plan(plan, stage, body), body)
        runner.install(body)
        runners.append(runner)
        modules.append(body)
        stages.append(
            _keep_buffers_in_inference(
                PipelineStage(
                    body, stage.index, len(pipeline.stages), device, group=pp_mesh.get_group()
                )
            )
        )
    return PipelinedModel(plan, modules, stages, runners)


def _keep_buffers_in_inference(stage: PipelineStage) -> PipelineStage:
    """Undo what the first step's shape inference does to the stage's buffers. torch 2.13 infers
    each stage's activation shapes by running its module once before the first micro-batch — on
    the real inputs at the first stage, on ``torch.empty`` tensors elsewhere — so, in training
    mode, a BatchNorm's running statistics would count that extra forward and, past the first
    stage, average uninitialised memory (NaN). The buffers the inference wrote are restored after it (only
    those: an in-place copy into a buffer the forward reads, such as a rotary table, would bump its
    version under a tensor an autograd graph saved)."""
    infer = stage._forward_metadata_inference

    def restoring(*args: Any, **kwargs: Any) -> Any:
        saved = [
            (buffer, buffer._version, buffer.detach().clone()) for buffer in stage.submod.buffers()
        ]
        try:
            return infer(*args, **kwargs)
        finally:
            with torch.no_grad():
                for buffer, version, value in saved:
                    if buffer._version != version:  # written by the inference: put it back
                        buffer.copy_(value)

    stage._forward_metadata_inference = restoring  # type: ignore[method-assign]
    return stage


#: the keyword every stage receives its micro-batch's model inputs under
INPUTS = "meshtrain_inputs"
#: the name, in the block container, of the probe standing in for the next stage's first block
_PROBE = "next_stage"


def _stage_plan(plan: Plan, stage: StagePlan, body: nn.Module) -> Plan:
    """The plan restricted to one stage's modules (no pipeline: the stage is a plain model)."""
    present = {fqn for fqn, module in body.named_modules() if not isinstance(module, _Stub)}
    kept = set(stage.params)
    return replace(
        plan,
        params=tuple(p for p in plan.params if p.fqn in kept),
        styles=tuple(s for s in plan.styles if s.fqn in present),
        units=tuple(u for u in plan.units if u.fqn in present),
        experts=tuple(g for g in plan.experts if g.fqn in present),
        pipeline=None,
    )


class _KeptBlocks(nn.Module):
    """The blocks of a ``ModuleList`` one stage keeps, under their original indices (so FQNs stay
    ``layers.5.…``); iterates, indexes, slices and measures like the list it replaces."""

    def __init__(self, blocks: dict[str, nn.Module]) -> None:
        super().__init__()
        for name, block in blocks.items():
            self.add_module(name, block)

    def __iter__(self) -> Iterator[nn.Module]:
        return iter(self._modules.values())  # type: ignore[arg-type]

    def __len__(self) -> int:
        return len(self._modules)

    def __getitem__(self, index: int | slice) -> Any:
        return list(self)[index]


class _StageRunner:
    """Runs the model's own forward as one stage. Every stage gets the micro-batch's model
    inputs (keyword :data:`INPUTS`), so code before the blocks (positions, masks, rotary tables)
    runs as on one device; a non-first stage feeds the activation it received to its first
    block instead of what that code computed, and the modules before the blocks it does not
    keep (stubs) return the received activation; a non-last stage returns what the next
    stage's first block would receive — caught by a probe standing in for that block, so a
    residual added outside the blocks is in it — which the modules after the blocks it does not
    keep (stubs) return too."""

    def __init__(self, stage: StagePlan, plan: Plan, *, first: bool, last: bool) -> None:
        self.stage, self.plan, self.first, self.last = stage, plan, first, last
        self.received: torch.Tensor | None = None
        self.captured: torch.Tensor | None = None
        self.output_spec: TreeSpec | None = None  # the last stage's output structure
        self.output_others: list[Any] = []  # its non-tensor leaves (_TENSOR where a tensor was)

    def install(self, body: nn.Module) -> None:
        """Hooks on the stage's first and last block, and the stage's forward on ``body``."""
        assert self.plan.pipeline is not None
        container = self.plan.pipeline.container + "."
        blocks = [fqn for fqn in self.stage.modules if fqn.startswith(container)]
        if not self.first:
            first = body.get_submodule(blocks[0])
            first.register_forward_pre_hook(self._feed, with_kwargs=True, prepend=True)
        body.forward = functools.partial(self._forward, body.forward)

    def _forward(
        self, forward: Callable[..., Any], *args: Any, **kwargs: Any
    ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """The activation sent on (a non-last stage), or the tensors of what the model returns
        (the last stage; ``torch.distributed.pipelining`` takes tensors only), which
        :meth:`rebuild` puts back into the model's own output for ``loss_fn``."""
        inputs = kwargs.pop(INPUTS)
        self.received = None if self.first else args[0]
        self.captured = None
        output = forward(inputs, **kwargs)
        if not self.last:
            assert self.captured is not None
            return self.captured
        main_output(output)  # a PlanError for an output without a tensor in it
        leaves, self.output_spec = tree_flatten(output)
        self.output_others = [_TENSOR if isinstance(x, torch.Tensor) else x for x in leaves]
        return tuple(leaf for leaf in leaves if isinstance(leaf, torch.Tensor))

    def rebuild(self, tensors: torch.Tensor | tuple[torch.Tensor, ...]) -> Any:
        """What the model returned on the last stage (a ``ModelOutput``, a tuple, a tensor),
        from the tensors the stage handed to the schedule (one tensor alone when there is one)."""
        assert self.output_spec is not None, "the last stage has not run forward"
        given = iter((tensors,) if isinstance(tensors, torch.Tensor) else tensors)
        leaves = [next(given) if other is _TENSOR else other for other in self.output_others]
        return tree_unflatten(leaves, self.output_spec)

    def _feed(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if args:
            return (self.received, *args[1:]), kwargs
        return args, {**kwargs, activation_argument(module): self.received}

    def stub_output(self, where: str) -> torch.Tensor:
        """What a removed module returns: the received activation before the blocks (in the
        global sequence shape when the sequence is split at the first block), the captured one
        after them."""
        if where == "after":
            assert self.captured is not None
            return self.captured
        assert self.received is not None
        ways = _split_ways(self.plan)
        if ways == 1:
            return self.received
        shape = list(self.received.shape)
        shape[1] *= ways
        return self.received.new_zeros(shape)


class _Stub(nn.Module):
    """A module this stage does not keep: returns the stage's received (before the blocks) or
    captured (after them) activation, whatever it is called with. Attributes it lacks are read
    from the removed module, kept on the meta device (no memory): a model's own forward may
    read one on every stage (ViT reads ``embeddings.patch_embeddings.projection.weight.dtype``
    before its embeddings run)."""

    def __init__(self, runner: _StageRunner, where: str, removed: nn.Module | None = None) -> None:
        super().__init__()
        self._runner, self._where = [runner], where  # a list: not a submodule
        self._removed = [] if removed is None else [removed]

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            removed = self.__dict__.get("_removed")
            if not removed:
                raise
            return getattr(removed[0], name)

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self._runner[0].stub_output(self._where)


class _NextBlock(_Stub):
    """Stands in for the next stage's first block: catches the activation it would receive (its
    first positional argument, or its activation keyword) and returns it."""

    def __init__(self, runner: _StageRunner, argument: str) -> None:
        super().__init__(runner, "after")
        self._argument = argument

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        activation = args[0] if args else kwargs[self._argument]
        self._runner[0].captured = activation
        return activation


#: marks where the last stage's output held a tensor (see :meth:`_StageRunner.rebuild`)
_TENSOR = object()


def _loss_on_model_output(
    runner: _StageRunner,
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
    output: torch.Tensor | tuple[torch.Tensor, ...],
    target: torch.Tensor,
) -> torch.Tensor:
    """``loss_fn`` on the model's own output, rebuilt from the last stage's tensors."""
    return loss_fn(runner.rebuild(output), target)


def _split_ways(plan: Plan) -> int:
    """The tensor-parallel size when the sequence is split at the first block's input (a
    non-first stage then rebuilds the global shape before its blocks), else 1."""
    if plan.tp_axis is None or not any(
        s.style == TPStyle.SEQUENCE_SPLIT_INPUT for s in plan.styles
    ):
        return 1
    return plan.mesh.size(plan.tp_axis)


def _prune(body: nn.Module, stage: StagePlan, plan: Plan) -> _StageRunner:
    """Keep only ``stage``'s blocks in the container; replace the modules before and after the
    blocks that the stage does not keep by stubs; return the stage's runner."""
    pipeline = plan.pipeline
    assert pipeline is not None
    keep = set(stage.modules)
    runner = _StageRunner(
        stage, plan, first=stage.index == 0, last=stage.index == len(pipeline.stages) - 1
    )
    owner, _, name = pipeline.container.rpartition(".")
    parent = body.get_submodule(owner) if owner else body
    container = getattr(parent, name)
    children = dict(container.named_children())
    kept = {n: b for n, b in children.items() if f"{pipeline.container}.{n}" in keep}
    if not runner.last:  # the next stage's first block, as a probe
        following = list(children)[list(children).index(list(kept)[-1]) + 1]
        kept[_PROBE] = _NextBlock(runner, activation_argument(children[following]))
    if isinstance(container, nn.ModuleDict):
        for block in [n for n in container if n not in kept]:
            del container[block]
        if _PROBE in kept:
            container[_PROBE] = kept[_PROBE]
    else:
        setattr(parent, name, _KeptBlocks(kept))
    for where, units in (("before", pipeline.before), ("after", pipeline.after)):
        for fqn in units:
            if fqn not in keep:
                owner, _, name = fqn.rpartition(".")
                removed = body.get_submodule(fqn).to("meta")  # its memory freed, its shape kept
                setattr(
                    body.get_submodule(owner) if owner else body,
                    name,
                    _Stub(runner, where, removed),
                )
    return runner
