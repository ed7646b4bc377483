"""Checking each op on the abstract rank against one device's: the op runs on one device's tensors
too, and each output must be the shard of one device's output the plan says it is — or the plan
is refused, with what the op did and where (see :mod:`meshtrain.plan.proof.run`).

Example:
    >>> args = ((2, 3),)
    >>> _scaled_sizes(args, ways=2, cut={3})
    [((2, 3),), ((2, 6),), ((4, 3),)]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from meshtrain.errors import PlanError, format_shape
from meshtrain.plan.proof.refusals import global_reshape, lost, mixed
from meshtrain.plan.proof.shard_dims import NOT_A_SHARD, reshaped_shard_dim, shard_dim_of
from meshtrain.plan.proof.tracking import Tracker

_aten = torch.ops.aten
RESHAPES = frozenset({_aten.view.default, _aten._unsafe_view.default, _aten.reshape.default})
#: composite functions that are reshapes (the shard must land where one device's does)
FLATTENS = frozenset({torch.flatten, torch.Tensor.flatten, torch.Tensor.unflatten})

_Found = list[tuple[torch.Tensor, torch.Tensor, int, int]]


class Checker:
    """Runs an op on one device's tensors beside the rank's and marks the rank's outputs as
    their shards; says where and why when an output is no shard of one device's."""

    def __init__(
        self, model: nn.Module, tracker: Tracker, stack: list[str], ways: int, sp: bool
    ) -> None:
        self.model, self.tracker, self.stack = model, tracker, stack
        self.ways, self.sp = ways, sp

    def propagate(
        self,
        func: Any,
        args: Any,
        kwargs: Any,
        sharded: list[torch.Tensor],
        output: Any,
        known: bool,
    ) -> None:
        """Sizes the model's code read off a shard become one device's (``known``:
        :mod:`~meshtrain.plan.proof.sizes`); sizes torch computed from a rank's shapes inside
        an op (``flatten``) are tried scaled to one device's, one at a time, when the op fails
        on them as given. Raises :class:`PlanError` when no reading makes the outputs shards."""
        shards = self.tracker.shards
        whole_args, whole_kwargs = pytree.tree_map(
            lambda t: shards[t].whole if isinstance(t, torch.Tensor) and t in shards else t,
            (args, kwargs),
        )
        cut = {t.shape[shards[t].dim] for t in sharded}
        candidates = [whole_args] if known else _scaled_sizes(whole_args, self.ways, cut)
        refusal: PlanError | None = None
        chosen = None
        for index, candidate in enumerate(candidates):
            try:  # one device's tensor may be strided where a rank's is not (an expanded dim)
                run = _aten.reshape.default if func in RESHAPES else func
                whole_output = run(*candidate, **whole_kwargs)
            except Exception:
                continue
            verdict = self._shards_of(func, sharded, output, whole_output)
            if index == 0 and isinstance(verdict, PlanError):
                raise verdict  # the sizes as the code gives them: one device's result
            if isinstance(verdict, PlanError):
                refusal = refusal or verdict
            elif all(outer == 1 for *_, outer in verdict):
                chosen = verdict  # a plain shard: preferred over a strided reading
                break
            elif chosen is None:
                chosen = verdict
        if chosen is None:
            raise refusal or self.lost(func, sharded, output, None, NOT_A_SHARD)
        for local, whole, dim, outer in chosen:
            self.tracker.shard(local, dim, whole, outer)

    def _shards_of(
        self, func: Any, sharded: list[torch.Tensor], output: Any, whole_output: Any
    ) -> _Found | PlanError:
        """(rank tensor, one device's, shard dim, its outer factor) per tensor output that is a
        shard, or why one is no shard."""
        shards = self.tracker.shards
        found = []
        for local, whole in zip(pytree.tree_leaves(output), pytree.tree_leaves(whole_output)):
            if not isinstance(local, torch.Tensor) or not isinstance(whole, torch.Tensor):
                continue
            dim = shard_dim_of(tuple(local.shape), tuple(whole.shape), ways=self.ways)
            if dim is None and not sharded:
                continue  # a new tensor of one device's sizes: whole
            if dim is None or dim == NOT_A_SHARD:
                return self.lost(func, sharded, local, whole, dim)
            outer = next(
                (
                    shards[t].outer
                    for t in sharded
                    if shards[t].whole.shape[shards[t].dim] == whole.shape[dim]
                ),
                1,
            )
            if (func in RESHAPES or func in FLATTENS) and sharded:
                placed = self._check_reshape(func, sharded[0], whole, dim)
                if isinstance(placed, PlanError):
                    return placed
                outer = placed
            found.append((local, whole, dim, outer))
        return found

    def _check_reshape(
        self, func: Any, source: torch.Tensor, whole: torch.Tensor, dim: int
    ) -> PlanError | int:
        """The shard's outer factor after a reshape, or why the reshape cuts it differently."""
        shard = self.tracker.shards[source]
        placed = reshaped_shard_dim(
            tuple(shard.whole.shape),
            tuple(whole.shape),
            shard.dim,
            ways=self.ways,
            outer=shard.outer,
        )
        if placed is not None and placed[0] == dim:
            return placed[1]
        expected = placed[0] if placed is not None else None
        return global_reshape(
            self.where(),
            self.fqn(),
            func,
            self.tracker.describe([source]),
            dim,
            format_shape(tuple(whole.shape)),
            expected,
        )

    # -- what a refusal says ----------------------------------------------------------------
    def where(self) -> str:
        """The module the abstract run is in, as a refusal names it."""
        fqn = self.stack[-1] if self.stack else ""
        module = self.model.get_submodule(fqn) if fqn else self.model
        return f"'{fqn or '<root>'}' ({type(module).__name__})"

    def fqn(self) -> str | None:
        return self.stack[-1] if self.stack else None

    def mixed(self, func: Any, inputs: Sequence[torch.Tensor], error: Exception) -> PlanError:
        """An op that failed on the rank's shards beside whole tensors."""
        return mixed(
            self.where(),
            self.fqn(),
            func,
            self.tracker.axis,
            self.tracker.describe(inputs),
            str(error).splitlines()[0],
        )

    def lost(
        self, func: Any, sharded: list[torch.Tensor], local: Any, whole: Any, dim: int | None
    ) -> PlanError:
        """An op whose output is no shard of one device's."""
        shapes = (
            f" (rank {format_shape(tuple(local.shape))}, one device "
            f"{format_shape(tuple(whole.shape))})"
            if isinstance(whole, torch.Tensor) and isinstance(local, torch.Tensor)
            else ""
        )
        sequence = self.sp and any(self.tracker.shards[t].dim == 1 for t in sharded)
        return lost(
            self.where(),
            self.fqn(),
            func,
            self.tracker.describe(sharded),
            shapes,
            selects=dim is None,
            sequence=sequence,
        )


def _scaled_sizes(args: tuple[Any, ...], ways: int, cut: set[int]) -> list[tuple[Any, ...]]:
    """``args`` as given, then with one size of one size-list argument multiplied by ``ways``
    (first the sizes equal to a sharded input's local size on its sharded dim: torch computed
    them from a rank's shape)."""
    first: list[tuple[Any, ...]] = [args]
    then: list[tuple[Any, ...]] = []
    for index, arg in enumerate(args):
        if isinstance(arg, (list, tuple)) and arg and all(type(n) is int for n in arg):
            for position, size in enumerate(arg):
                if size >= 1:
                    scaled = type(arg)(n * ways if i == position else n for i, n in enumerate(arg))
                    (first if size in cut else then).append(
                        (*args[:index], scaled, *args[index + 1 :])
                    )
    return first + then
