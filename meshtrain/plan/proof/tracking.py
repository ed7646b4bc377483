"""What the abstract rank knows of its tensors: which are tensor-parallel shards of which of one
device's tensors, which come from a replicated parameter, and where such a parameter met a shard
(see :mod:`meshtrain.plan.proof.run`).

Example:
    >>> import torch
    >>> from meshtrain.plan.proof.effects import Effects
    >>> tracker = Tracker("tp", Effects())
    >>> local, whole = torch.empty(2, 3), torch.empty(4, 3)
    >>> tracker.shard(local, 0, whole) is local, tracker.shard_size(local)
    (True, (0, 4))
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils.weak import WeakIdKeyDictionary

from meshtrain.errors import format_shape
from meshtrain.plan.ir import ModuleStyle, PartialGrad
from meshtrain.plan.proof.effects import Effects
from meshtrain.plan.proof.refusals import refuse_partial


@dataclass(frozen=True)
class Shard:
    """A rank's tensor is a shard of ``whole`` (one device's tensor) along ``dim`` (viewed as
    ``[outer, size / outer]``, cut on its second part: see
    :func:`~meshtrain.plan.proof.shard_dims.reshaped_shard_dim`)."""

    dim: int
    whole: torch.Tensor
    outer: int = 1


class Tracker:
    """Shards by tensor, replicated parameters by the tensors made from them, and the first
    place (module, op) each such parameter met a shard: its gradient there is a partial sum."""

    def __init__(self, axis: str, effects: Effects) -> None:
        self.axis, self.effects = axis, effects
        self.shards: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.origin: WeakIdKeyDictionary = WeakIdKeyDictionary()  # tensor → parameter FQNs
        self.found: dict[str, tuple[str, str]] = {}  # parameter → (module, op)

    def shard(
        self, local: torch.Tensor, dim: int, whole: torch.Tensor, outer: int = 1
    ) -> torch.Tensor:
        """Mark ``local`` as the shard of ``whole`` along ``dim``; returns it."""
        self.shards[local] = Shard(dim, whole, outer)
        if local in self.effects.batch:
            self.effects.batch[whole] = True
        return local

    def mark(self, tensor: torch.Tensor, fqn: str) -> torch.Tensor:
        """``tensor`` is the input ``fqn``'s lowering marks for its column-wise Linears."""
        self.effects.marked[tensor] = self.effects.marked.get(tensor, frozenset()) | {fqn}
        return tensor

    def shard_size(self, tensor: torch.Tensor) -> tuple[int, int] | None:
        """(sharded dim, one device's size of it), or ``None`` for a whole tensor."""
        shard = self.shards.get(tensor)
        return None if shard is None else (shard.dim, int(shard.whole.shape[shard.dim]))

    def note_origin(
        self,
        func: Any,
        inputs: list[torch.Tensor],
        sharded: list[torch.Tensor],
        output: Any,
        where: str,
    ) -> None:
        """Views and casts of a replicated parameter stay its; one meeting a shard is partial."""
        origins = [self.origin[t] for t in inputs if t in self.origin and t not in self.shards]
        if not origins:
            return
        if sharded:
            for params in origins:
                for param in params:
                    self.found.setdefault(param, (where, str(func)))
        elif len(inputs) == 1:
            for out in pytree.tree_leaves(output):
                if isinstance(out, torch.Tensor):
                    self.origin[out] = origins[0]

    def describe(self, tensors: Sequence[torch.Tensor]) -> str:
        """Each tensor's shape, and what it is a shard of."""
        parts = []
        for t in tensors:
            shard = self.shards.get(t)
            if shard is None:
                parts.append(f"whole {format_shape(tuple(t.shape))}")
            else:
                parts.append(
                    f"{format_shape(tuple(t.shape))} (a shard over '{self.axis}' on dim "
                    f"{shard.dim} of one device's {format_shape(tuple(shard.whole.shape))})"
                )
        return ", ".join(parts)


def partial_grads(
    model: nn.Module,
    found: Mapping[str, tuple[str, str]],
    copies: Mapping[str, str],
    first_input: Mapping[str, int | None],
    styles: Mapping[str, ModuleStyle],
    axis: str,
) -> tuple[PartialGrad, ...]:
    """Each replicated parameter that met a shard (``found``, and the same in each look-alike
    block of ``copies``), with its module's sharded input dim; refused when its module does not
    take the shard as its first input."""
    everywhere = dict(found)
    for copy, representative in copies.items():
        prefix = representative + "."
        for param, (module, op) in found.items():
            if param.startswith(prefix):
                everywhere[copy + param[len(representative) :]] = (
                    copy + module[len(representative) :],
                    op,
                )
    result = []
    names = [name for name, _ in model.named_parameters()]
    for param, (where, op) in sorted(everywhere.items(), key=lambda item: _order(names, item[0])):
        owner = param.rpartition(".")[0]
        dim = first_input.get(representative_fqn(owner, copies))
        if dim is None or owner in styles:
            raise refuse_partial(param, owner, where, op, axis)
        result.append(PartialGrad(param, owner, axis, dim, op))
    return tuple(result)


def representative_fqn(fqn: str, copies: Mapping[str, str]) -> str:
    """``fqn`` inside the block that ran for its look-alike block (``fqn`` itself otherwise)."""
    for copy, representative in copies.items():
        if fqn == copy or fqn.startswith(copy + "."):
            return representative + fqn[len(copy) :]
    return fqn


def _order(names: list[str], fqn: str) -> int:
    return names.index(fqn) if fqn in names else len(names)
