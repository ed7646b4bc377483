"""The abstract rank: a dispatch mode that propagates tensor-parallel shards through every aten
op of a model's forward on fake tensors, checks each against one device's op, and records where
replicated parameters meet shards (see :mod:`meshtrain.plan.proof.run`).

By concern: what it knows of its tensors (:mod:`~meshtrain.plan.proof.tracking`), each op checked
against one device's and what a refusal says (:mod:`~meshtrain.plan.proof.checking`), its modules'
hooks and starting state (:mod:`~meshtrain.plan.proof.modules`); this class runs the ops.

Example:
    >>> from meshtrain.plan.proof.shard_dims import shard_dim_of
    >>> shard_dim_of((3, 6, 2, 16), (3, 6, 4, 16), ways=2)
    2
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from meshtrain.errors import PlanError
from meshtrain.plan.experts.activations import counts_shape
from meshtrain.plan.ir import WHOLE_SEQUENCE, ModuleStyle, ParamLayout, PartialGrad, TPStyle
from meshtrain.plan.proof.boundaries import Refused
from meshtrain.plan.proof.checking import Checker
from meshtrain.plan.proof.effects import Effects
from meshtrain.plan.proof.modules import ModuleWatch, fake_state
from meshtrain.plan.proof.sizes import SizeProvenance, whole_args
from meshtrain.plan.proof.tracking import Tracker, partial_grads

_aten = torch.ops.aten


class Prover(TorchDispatchMode):
    """Propagates shards through every aten op and records where replicated parameters meet
    them, and what :class:`~meshtrain.plan.proof.effects.Effects` looks for."""

    #: a look-alike block that passes its input through holds its representative's fakes
    share_lookalikes = True

    def __init__(
        self,
        model: nn.Module,
        params: Sequence[ParamLayout],
        styles: Sequence[ModuleStyle],
        tp_axis: str | None,
        tp_size: int,
        sequence_parallel: bool,
        effects: Effects,
    ) -> None:
        super().__init__()
        self.model, self.layouts = model, {p.fqn: p for p in params}
        self.styles = {s.fqn: s for s in styles}
        self.axis, self.ways, self.sp = tp_axis or "", tp_size, sequence_parallel
        self.split_at_block = any(s.style == TPStyle.SEQUENCE_SPLIT_INPUT for s in styles)
        self.whole = tuple(s.fqn for s in styles if s.style in WHOLE_SEQUENCE)
        self.effects = effects
        effects.sequence_parallel, effects.prepared = sequence_parallel, self._prepares
        self.tracker = Tracker(self.axis, effects)
        self.stack: list[str] = []
        self.checker = Checker(model, self.tracker, self.stack, tp_size, sequence_parallel)
        self.sizes = SizeProvenance(self.tracker.shard_size, self._watch, self._composite)
        self.quiet = 0
        self.first_input: dict[str, int | None] = {}
        self.copies: dict[str, str] = {}  # look-alike block → the block that ran
        self.kept_shard: set[str] = set()
        self.whole_params: dict[str, dict[str, torch.Tensor]] = {}
        self.sharing: frozenset[str] = frozenset()
        self.shared: dict[str, str] = {}
        self.modules = ModuleWatch(self)

    # -- what the boundaries and the run read (boundaries.Prover) ---------------------------
    @property
    def shards(self) -> Any:
        return self.tracker.shards

    def shard(
        self, local: torch.Tensor, dim: int, whole: torch.Tensor, outer: int = 1
    ) -> torch.Tensor:
        return self.tracker.shard(local, dim, whole, outer)

    def mark(self, tensor: torch.Tensor, fqn: str) -> torch.Tensor:
        return self.tracker.mark(tensor, fqn)

    def describe(self, tensors: Sequence[torch.Tensor]) -> str:
        return self.tracker.describe(tensors)

    def where(self) -> str:
        return self.checker.where()

    def fake_state(self) -> dict[str, torch.Tensor]:
        return fake_state(self)

    def hook(self, blocks: Sequence[str]) -> list[Any]:
        return self.modules.hook(blocks)

    def restore(self) -> None:
        self.modules.restore()

    def partial_grads(self) -> tuple[PartialGrad, ...]:
        """Each replicated parameter that met a shard, with its module's sharded input dim."""
        found, copies = self.tracker.found, self.copies
        return partial_grads(self.model, found, copies, self.first_input, self.styles, self.axis)

    def _prepares(self, fqn: str) -> bool:
        style = self.styles.get(fqn)
        return style is not None and style.style == TPStyle.PREPARE_INPUT

    # -- every aten op ----------------------------------------------------------------------
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is _aten.bincount.default:
            return counts_shape(*args, **kwargs)
        if self.quiet:
            return func(*args, **kwargs)
        inputs = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        sharded = [t for t in inputs if t in self.shards]
        try:
            output = func(*args, **kwargs)
        except Exception as error:
            if not sharded:
                raise
            raise Refused(self.checker.mixed(func, inputs, error)) from None
        self.effects.on_op(func, args, kwargs, inputs, output, self.stack)
        self.tracker.note_origin(func, inputs, sharded, output, self._here())
        resized = self.sizes.whole_sizes(func, args)
        if func.__name__.startswith("new_"):
            sharded = []  # a new tensor of the sizes given: a shard only when they are local
        if sharded or resized is not None:
            self._propagate(func, resized or args, kwargs, sharded, output, resized is not None)
        return output

    def _composite(self, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        """A torch function of :data:`~meshtrain.plan.proof.sizes.COMPOSITES` checked as one
        op: its aten steps run unchecked (their sizes are torch's, from the rank's shapes), its
        output against one device's call."""
        inputs = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        sharded = [t for t in inputs if t in self.shards]
        if self.quiet or not sharded:
            return func(*args, **kwargs)
        self.quiet += 1
        try:
            try:
                output = func(*args, **kwargs)
            except Exception as error:
                raise Refused(self.checker.mixed(func, inputs, error)) from None
            self.effects.on_op(func, args, kwargs, inputs, output, self.stack)
            self.tracker.note_origin(func, inputs, sharded, output, self._here())
            self._propagate(func, whole_args(args), kwargs, sharded, output, True)
        finally:
            self.quiet -= 1
        return output

    def _propagate(
        self, func: Any, args: Any, kwargs: Any, sharded: list[Any], output: Any, known: bool
    ) -> None:
        try:
            self.checker.propagate(func, args, kwargs, sharded, output, known)
        except PlanError as refusal:
            raise Refused(refusal) from None

    def _watch(self, func: Any, args: Any, kwargs: dict[str, Any]) -> None:
        if not self.quiet:
            self.effects.on_call(func, args, kwargs, self.stack)

    def _here(self) -> str:
        return self.stack[-1] if self.stack else ""
