"""Lowering the compute policies: activation checkpointing and ``torch.compile``.

Order inside :func:`~meshtrain.lower.flat.parallelize` (torchtitan's): tensor parallel →
checkpointing → per-block compile → FSDP2 → whole-model compile. Both policies replace a module's
``forward`` on the instance instead of wrapping the module, so parameter FQNs, state dicts and
FSDP2's module hooks (which stay outside the compiled code) are untouched.

- ``full``: the block's forward runs under ``torch.utils.checkpoint.checkpoint`` (non-reentrant):
  only its inputs are kept, everything else is recomputed in backward.
- ``selective``: the same with a policy that keeps the outputs of matmul and attention ops
  (:data:`~meshtrain.plan.memory.activations.SAVED_OPS`) and recomputes the rest.

Graph breaks are not accepted silently: after the first forward of a compiled model a
:class:`~meshtrain.errors.GraphBreakWarning` names their count and reasons, and
:func:`compile_report` returns them. Calls into functions marked ``torch.compiler.disable`` are
deliberate eager islands, counted apart (``CompileReport.islands``) and not warned about:
meshtrain marks the expert dispatch (its all-to-all sizes are the step's routing counts) and
context attention (the ring's point-to-point sends).

Example (inside ``parallelize``)::

    apply_checkpointing(plan, model)
    compile_blocks(plan, model)
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from meshtrain.errors import GraphBreakWarning
from meshtrain.plan.ir import Plan, TPStyle
from meshtrain.plan.memory.activations import SAVED_OPS

_F = TypeVar("_F", bound=Callable[..., Any])


def eager_island(fn: _F) -> _F:
    """``fn`` left eager under torch.compile (``torch.compiler.disable``, its type kept): a
    deliberate graph break, counted in :attr:`CompileReport.islands` rather than warned about.

    >>> eager_island(lambda x: x + 1)(1)
    2
    """
    return cast(_F, torch.compiler.disable(fn))


@dataclass(frozen=True)
class CompileReport:
    """Graph breaks torch.compile hit in a model's compiled regions since ``mt.apply``; calls
    into ``torch.compiler.disable``'d functions (deliberate eager islands) counted apart."""

    graph_breaks: int
    reasons: tuple[str, ...]
    islands: int = 0


def apply_checkpointing(plan: Plan, model: nn.Module) -> None:
    """Checkpoint the plan's ``checkpointed`` blocks that this model (or stage) holds."""
    mode = plan.options.activation_checkpointing
    modules = dict(model.named_modules())
    for fqn in plan.checkpointed:
        if fqn in modules:
            _checkpoint_forward(modules[fqn], selective=mode == "selective")


def _keep_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _checkpoint_forward(module: nn.Module, *, selective: bool) -> None:
    inner = module.forward
    norms = [m for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    compiled: dict[str, Any] = {}
    if selective:
        compiled["context_fn"] = functools.partial(
            create_selective_checkpoint_contexts, _keep_matmuls
        )
    eager = dict(compiled)
    if norms:
        eager["context_fn"] = functools.partial(_eager_contexts, norms, selective)

    @functools.wraps(inner)
    def forward(*args: Any, **kwargs: Any) -> Any:
        # Compiled, the recomputation is a traced graph whose buffer writes are functional
        # (applied once, after forward); eager, torch replays them and the contexts undo that.
        extra = compiled if torch.compiler.is_compiling() else eager
        return checkpoint(inner, *args, use_reentrant=False, **extra, **kwargs)

    module.forward = forward


def _eager_contexts(
    norms: Sequence[nn.Module], selective: bool
) -> tuple[contextlib.AbstractContextManager[Any], contextlib.AbstractContextManager[Any]]:
    forward, recompute = _replayed_buffers(norms)
    if not selective:
        return forward, recompute
    keep_forward, keep_recompute = create_selective_checkpoint_contexts(_keep_matmuls)
    return _both(forward, keep_forward), _both(recompute, keep_recompute)


def _replayed_buffers(
    modules: Sequence[nn.Module],
) -> tuple[contextlib.AbstractContextManager[None], contextlib.AbstractContextManager[None]]:
    """Contexts for a checkpointed forward and its recomputation that make the recomputation
    see the buffers the forward saw and leave them as the forward left them: a BatchNorm's
    running statistics are updated once per forward, not again when backward recomputes it
    (torch's checkpoint replays the forward with its side effects: full checkpointing of a
    block with a BatchNorm doubled ``num_batches_tracked`` and moved the running statistics
    twice, on one rank as on many)."""
    buffers = [b for m in modules for b in m.buffers(recurse=False)]
    saved: dict[str, list[torch.Tensor]] = {}

    @contextlib.contextmanager
    def forward() -> Iterator[None]:
        saved["before"] = [b.detach().clone() for b in buffers]
        yield
        saved["after"] = [b.detach().clone() for b in buffers]

    @contextlib.contextmanager
    def recompute() -> Iterator[None]:
        _copy_into(buffers, saved.get("before", []))
        yield
        _copy_into(buffers, saved.get("after", []))

    if not buffers:
        return contextlib.nullcontext(), contextlib.nullcontext()
    return forward(), recompute()


@torch.no_grad()
def _copy_into(buffers: list[torch.Tensor], values: list[torch.Tensor]) -> None:
    for buffer, value in zip(buffers, values):
        buffer.copy_(value)


@contextlib.contextmanager
def _both(
    first: contextlib.AbstractContextManager[Any], second: contextlib.AbstractContextManager[Any]
) -> Iterator[None]:
    with first, second:
        yield


def compile_blocks(plan: Plan, model: nn.Module) -> None:
    """Compile each block's forward (scope 'block'); before FSDP2 wraps the blocks."""
    if plan.compile_scope != "block":
        return
    modules = dict(model.named_modules())
    for fqn in plan.blocks:
        if fqn in modules:
            _compile_forward(plan, modules[fqn])
    _watch_graph_breaks(model)


def compile_model(plan: Plan, model: nn.Module) -> None:
    """Compile the whole model's forward (scope 'model'); after FSDP2."""
    if plan.compile_scope != "model":
        return
    _compile_forward(plan, model)
    _watch_graph_breaks(model)


def compile_loss(plan: Plan, loss_fn: Callable[..., Any]) -> Callable[..., Any]:
    """``loss_fn`` compiled with the plan's backend when the plan compiles (eager otherwise, and
    under loss parallelism, whose vocab-sharded cross-entropy runs through DTensor's op table)."""
    if plan.compile_scope is None or any(
        s.style == TPStyle.LOSS_PARALLEL_HEAD for s in plan.styles
    ):
        return loss_fn
    options = plan.options
    return torch.compile(
        loss_fn,
        backend=options.compile_backend,
        fullgraph=options.compile_fullgraph,
        dynamic=False,
    )


def _compile_forward(plan: Plan, module: nn.Module) -> None:
    options = plan.options
    # Static shapes: a new batch shape recompiles instead of turning dims symbolic, which torch
    # 2.13's DTensor embedding cannot take ("unhashable type: non-nested SymInt").
    module.forward = torch.compile(
        module.forward,
        backend=options.compile_backend,
        fullgraph=options.compile_fullgraph,
        dynamic=False,
    )


def _graph_breaks() -> Counter[str]:
    return Counter(torch._dynamo.utils.counters["graph_break"])


def _watch_graph_breaks(model: nn.Module) -> None:
    """Warn once, after the first forward, about graph breaks since now."""
    before = _graph_breaks()
    model._meshtrain_graph_breaks = before  # type: ignore[assignment]

    def check(module: nn.Module, args: Any, output: Any) -> None:
        handle.remove()
        report = compile_report(module)
        if report.graph_breaks:
            warnings.warn(
                GraphBreakWarning(
                    f"torch.compile broke {type(module).__name__}'s compiled code into more "
                    f"graphs {report.graph_breaks} time(s): {'; '.join(report.reasons)}. Each "
                    "break runs eagerly in between; fix the model code, or compile with "
                    "{'fullgraph': True} to turn breaks into errors."
                ),
                stacklevel=2,
            )

    handle = model.register_forward_hook(check)


def compile_report(model: nn.Module) -> CompileReport:
    """Graph breaks (count, reasons) torch.compile recorded since ``mt.apply`` compiled
    ``model`` (counted process-wide: other compiled code in the process adds to it)."""
    before = getattr(model, "_meshtrain_graph_breaks", None)
    if before is None:
        return CompileReport(0, ())
    delta = _graph_breaks() - before
    islands = {reason: n for reason, n in delta.items() if _ISLAND in reason}
    breaks = {reason: n for reason, n in delta.items() if _ISLAND not in reason}
    return CompileReport(
        sum(breaks.values()),
        tuple(f"{reason.strip().splitlines()[0]} (×{count})" for reason, count in breaks.items()),
        sum(islands.values()),
    )


#: what torch 2.13's graph-break reason says of a call into a ``torch.compiler.disable``'d function
_ISLAND = "torch.compiler.disable()"
