"""The abstract rank's modules: the state it starts from (parameters at their tensor-parallel local
shapes, fake), and the hooks around every module — the module stack, the styles' boundaries, and
repeated blocks run once (see :mod:`meshtrain.plan.proof.run`).

Example (inside :func:`~meshtrain.plan.proof.run.prove`)::

    handles = ModuleWatch(prover).hook(blocks)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from meshtrain.errors import PlanError
from meshtrain.plan.experts.axis import is_experts_module
from meshtrain.plan.ir import ModuleStyle, ParamLayout, TPStyle
from meshtrain.plan.layers import enclosing_block, lookalike_blocks, shared_tensors
from meshtrain.plan.proof.boundaries import (
    LEAF_STYLES,
    Prover,
    Refused,
    boundary_in,
    boundary_out,
    whole_forward,
)
from meshtrain.plan.proof.effects import Effects, buffer_owners, parameter_owners
from meshtrain.plan.proof.experts import dense_forward
from meshtrain.plan.proof.tracking import Tracker
from meshtrain.spec.partition import entry_axes


class LookalikeRan(BaseException):
    """A look-alike block ran (its representative changed its input's shape or shard) while
    holding its representative's fake tensors: the run starts again with its own. A
    ``BaseException``, so a model's ``except Exception`` cannot swallow it."""

    def __init__(self, fqn: str) -> None:
        super().__init__(fqn)
        self.fqn = fqn


class Rank(Prover, Protocol):
    """What the module side reads and writes on the abstract rank
    (:class:`~meshtrain.plan.proof.prover.Prover`), beside what the boundaries read."""

    model: nn.Module
    layouts: dict[str, ParamLayout]
    styles: dict[str, ModuleStyle]
    effects: Effects
    tracker: Tracker
    stack: list[str]
    quiet: int
    first_input: dict[str, int | None]
    copies: dict[str, str]
    kept_shard: set[str]
    whole_params: dict[str, dict[str, torch.Tensor]]
    share_lookalikes: bool  # whether a look-alike may hold its representative's fakes
    sharing: frozenset[str]  # look-alike blocks whose tensors may be their representative's
    shared: dict[str, str]  # their tensors' FQNs → the representative's (layers.shared_tensors)


def fake_state(rank: Rank) -> dict[str, torch.Tensor]:
    """Parameters at their tensor-parallel local shapes, buffers whole (created under the
    caller's fake mode); replicated trainable ones remembered by identity; one device's
    parameters of each styled leaf kept for its boundary. A tensor of a look-alike block that
    passes its input through takes its representative's fake (:attr:`Rank.shared`)."""
    state: dict[str, torch.Tensor] = {}
    owners = parameter_owners(rank.model)
    params = dict(rank.model.named_parameters())
    for fqn in params:
        layout = rank.layouts.get(fqn)
        if layout is not None and rank.axis and rank.axis in layout.spec.axes:
            rank.effects.sharded.add(fqn)
    for fqn in sorted(params, key=lambda name: name in rank.shared):
        twin = state.get(rank.shared.get(fqn, ""))
        shape, dtype = _local_of(rank, fqn, params[fqn])
        if twin is not None and (tuple(twin.shape), twin.dtype) == (shape, dtype):
            state[fqn] = twin
            continue
        state[fqn] = fake = torch.empty(shape, dtype=dtype)
        if rank.axis:
            rank.effects.owners[fake] = (fqn, owners.get(fqn, ()))
        layout = rank.layouts.get(fqn)
        if (
            layout is not None
            and layout.trainable
            and rank.axis
            and fqn not in rank.effects.sharded
        ):
            rank.tracker.origin[fake] = frozenset({fqn})
    writable = buffer_owners(rank.model)
    for fqn, buffer in sorted(rank.model.named_buffers(), key=lambda kv: kv[0] in rank.shared):
        if rank.shared.get(fqn) in state:
            state[fqn] = state[rank.shared[fqn]]
            continue
        state[fqn] = torch.empty(tuple(buffer.shape), dtype=buffer.dtype)
        if fqn in writable:
            rank.effects.buffers[state[fqn]] = fqn
    for fqn, style in rank.styles.items():
        if style.style in LEAF_STYLES and not _inside(fqn, rank.sharing):
            module = rank.model.get_submodule(fqn)
            rank.whole_params[fqn] = {
                name: torch.empty(tuple(p.shape), dtype=state[_join(fqn, name)].dtype)
                for name, p in module.named_parameters(remove_duplicate=False)
                if _join(fqn, name) in state
            }
    return state


def _local_of(rank: Rank, fqn: str, param: torch.Tensor) -> tuple[tuple[int, ...], torch.dtype]:
    """A parameter's shape on the abstract rank and its dtype there."""
    layout = rank.layouts.get(fqn)
    shape = _local(layout, rank.axis, rank.ways) if layout is not None else tuple(param.shape)
    return shape, param.dtype if param.is_floating_point() else torch.float32


def _inside(fqn: str, blocks: frozenset[str]) -> bool:
    return bool(blocks) and enclosing_block(fqn, blocks) is not None


def _local(layout: ParamLayout, axis: str, ways: int) -> tuple[int, ...]:
    entries = layout.spec.padded(len(layout.shape))
    return tuple(
        -(-n // ways) if axis in entry_axes(entry) else n for n, entry in zip(layout.shape, entries)
    )


class ModuleWatch:
    """Hooks on every module of the abstract rank's model: the module stack, each style's
    boundary in and out, the first input's shard, and look-alike blocks passed through."""

    def __init__(self, rank: Rank) -> None:
        self.rank = rank
        self._patched: list[nn.Module] = []
        self._buffers_before: list[dict[str, torch.Tensor]] = []

    def hook(self, blocks: Sequence[str]) -> list[Any]:
        """Module hooks: the module stack, the styles' boundaries, repeated blocks skipped (no
        hook inside a look-alike that holds its representative's tensors: it never runs)."""
        rank, handles = self.rank, []
        modules = dict(rank.model.named_modules())
        lookalikes = _lookalikes(rank, modules, blocks)
        if rank.share_lookalikes:
            rank.sharing = frozenset(lookalikes)
            rank.shared = shared_tensors(rank.model, lookalikes)
        watched = {fqn: m for fqn, m in modules.items() if not _inside(fqn, rank.sharing)}
        for fqn, module in watched.items():
            handles.append(
                module.register_forward_pre_hook(_bound(self.enter, fqn), with_kwargs=True)
            )
            handles.append(module.register_forward_hook(_bound(self.exit, fqn), with_kwargs=True))
        for fqn, style in rank.styles.items():
            module = watched.get(fqn)
            if module is not None and style.style in LEAF_STYLES and "forward" not in vars(module):
                own = dense_forward(module) if is_experts_module(module) else module.forward
                module.forward = whole_forward(own, module, self._whole_of(fqn))
                self._patched.append(module)
        for fqn, module in watched.items():
            if (
                is_experts_module(module)
                and fqn not in rank.styles
                and "forward" not in vars(module)
            ):
                module.forward = dense_forward(module)  # routing's shapes are data-dependent
                self._patched.append(module)
        for fqn, representative in lookalikes.items():
            modules[fqn].forward = self._pass_through(modules[fqn].forward, representative, fqn)
            self._patched.append(modules[fqn])
        return handles

    def restore(self) -> None:
        for module in self._patched:
            del module.forward

    def _whole_of(self, fqn: str) -> Callable[[], dict[str, torch.Tensor]]:
        """One device's parameters of styled module ``fqn`` (made by :func:`fake_state`, which
        runs after the hooks are in place)."""
        return lambda: self.rank.whole_params.get(fqn, {})

    def _pass_through(
        self, forward: Callable[..., Any], representative: str, fqn: str
    ) -> Callable[..., Any]:
        rank = self.rank

        def run(*args: Any, **kwargs: Any) -> Any:
            if representative in rank.kept_shard and args and isinstance(args[0], torch.Tensor):
                rank.copies[fqn] = representative
                return args[0]
            if fqn in rank.sharing:
                raise LookalikeRan(fqn)
            return forward(*args, **kwargs)

        return run

    def enter(
        self, fqn: str, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        rank = self.rank
        rank.stack.append(fqn)
        self._buffers_before.append(dict(module._buffers))  # type: ignore[arg-type]
        first = args[0] if args else None
        if fqn not in rank.first_input:
            shard = rank.shards.get(first) if isinstance(first, torch.Tensor) else None
            rank.first_input[fqn] = shard.dim if shard is not None else None
        style = rank.styles.get(fqn)
        if not rank.quiet:
            rank.effects.on_enter(fqn, module, args, kwargs, style is not None)
        if style is None:
            return args, kwargs
        if style.style == TPStyle.COLWISE and rank.sp:
            self._check_parent_called(style)
        if style.style in LEAF_STYLES:
            rank.quiet += 1
        return boundary_in(rank, style, args, kwargs)

    def _check_parent_called(self, style: ModuleStyle) -> None:
        """Under sequence parallelism a column-wise Linear takes its input gathered by its
        pair's parent: a parent never called (a ModuleDict whose Linears its owner calls) gathers
        nothing, and the Linear would compute on a sequence shard."""
        rank = self.rank
        parents = [
            f
            for f, s in rank.styles.items()
            if s.style == TPStyle.PREPARE_INPUT and (not f or style.fqn.startswith(f + "."))
        ]
        parent = max(parents, key=len, default=None)
        if parent is None or parent in rank.stack:
            return
        module = rank.model.get_submodule(parent) if parent else rank.model
        caller = (rank.stack[-2] if len(rank.stack) > 1 else "") or "<root>"
        raise Refused(
            PlanError(
                f"'{style.fqn}' is column-wise in a pair under '{parent}' ({type(module).__name__}), "
                f"whose input sequence parallelism gathers once for its Linears, but "
                f"'{parent}' is not called in the forward (its Linears are called directly, from "
                f"'{caller}'): nothing would gather "
                "their input from its sequence shards. Put the pair in a module whose forward calls "
                "them, or drop the ('seq', ...) activation rule.",
                fqn=style.fqn,
            )
        )

    def exit(
        self,
        fqn: str,
        module: nn.Module,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        output: Any,
    ) -> Any:
        rank = self.rank
        rank.stack.pop()
        rank.effects.rebound(fqn, module, self._buffers_before.pop())
        style = rank.styles.get(fqn)
        leaf = style is not None and style.style in LEAF_STYLES
        if leaf:
            rank.quiet -= 1
        result = output if style is None else boundary_out(rank, style, output)
        if rank.effects.batch_leaves((args, kwargs)):
            rank.effects.taint(result)
        if (leaf or fqn in rank.effects.units) and isinstance(result, torch.Tensor):
            rank.effects.outputs[result] = fqn
        self._keeps_shard(fqn, args, kwargs, result)
        return result

    def _keeps_shard(
        self, fqn: str, args: tuple[Any, ...], kwargs: dict[str, Any], result: Any
    ) -> None:
        first = args[0] if args else kwargs.get("hidden_states")
        if isinstance(first, torch.Tensor) and isinstance(result, torch.Tensor):
            before, after = self.rank.shards.get(first), self.rank.shards.get(result)
            same = (before is None) == (after is None) and (
                before is None or before.dim == after.dim
            )
            if same and first.shape == result.shape:
                self.rank.kept_shard.add(fqn)


def _lookalikes(rank: Rank, modules: dict[str, nn.Module], blocks: Sequence[str]) -> dict[str, str]:
    """Blocks after the first of their signature (not styled, not patched otherwise) → the
    first: each passes its input through when the first kept its shape and shard."""
    plain = [fqn for fqn in blocks if fqn not in rank.styles]
    return {
        fqn: representative
        for fqn, representative in lookalike_blocks(rank.model, plain).items()
        if "forward" not in vars(modules[fqn]) and not is_experts_module(modules[fqn])
    }


def _bound(method: Callable[..., Any], fqn: str) -> Callable[..., Any]:
    def hook(*args: Any) -> Any:
        return method(fqn, *args)

    return hook


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name
