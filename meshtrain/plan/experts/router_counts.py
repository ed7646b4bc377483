"""The routers' count all-reduces: what a step of meshtrain's MoE sums over the token ranks.

A module with a ``set_count_reducer`` method and an int ``num_experts`` (meshtrain's
``MoEFeedForward``) is given a count reducer over the plan's token ranks when the plan is applied
(:mod:`meshtrain.lower.experts.balance`). Each forward then sums its ``[experts + 2]`` int64 counts (the
tokens per expert, the tokens, the ranks) with one all-reduce, once per MoE layer and micro-batch;
a forward recomputed in backward (activation checkpointing) counts nothing again, except that a
layer training its balance loss (``balance == "aux_loss"``) reduces its counts once more then.
Nothing is reduced when the token ranks are one rank.

Example:
    >>> router = CountingRouter("layers.1.moe", num_experts=8, again_on_recompute=False)
    >>> count_collectives([router], axis="dp+ep", microbatches=2)
    (Collective(kind='all_reduce', axis='dp+ep', count=2, bytes=160, why="the routers' tokens per expert summed over the token ranks (int64, experts + 2), once per MoE layer and micro-batch"),)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from meshtrain.plan.ir import Collective

_COUNT_BYTES = 8  # int64


@dataclass(frozen=True)
class CountingRouter:
    """One module that sums its routing counts over the token ranks: its fqn, its experts, and
    whether a recomputed forward reduces them again (its balance loss trains)."""

    fqn: str
    num_experts: int
    again_on_recompute: bool

    @property
    def bytes(self) -> int:
        """Payload of one of its all-reduces: ``experts + 2`` int64."""
        return _COUNT_BYTES * (self.num_experts + 2)


def counting_routers(model: nn.Module) -> tuple[CountingRouter, ...]:
    """The modules of ``model`` that take a count reducer (see module doc), in module order."""
    found = []
    for fqn, module in model.named_modules():
        experts = getattr(module, "num_experts", None)
        if callable(getattr(module, "set_count_reducer", None)) and isinstance(experts, int):
            again = getattr(module, "balance", None) == "aux_loss"
            found.append(CountingRouter(fqn, experts, again))
    return tuple(found)


def count_collectives(
    routers: Sequence[CountingRouter],
    *,
    axis: str,
    microbatches: int = 1,
    checkpointed: Sequence[str] = (),
) -> tuple[Collective, ...]:
    """The count all-reduces of one optimizer step over ``axis`` (the token ranks joined, as the
    mesh names them; ``""`` when they are one rank: none), those of routers inside
    ``checkpointed`` blocks that train their balance loss repeated in backward."""
    if not axis or not routers:
        return ()
    rows = [
        Collective(
            "all_reduce",
            axis,
            len(routers) * microbatches,
            sum(r.bytes for r in routers) * microbatches,
            "the routers' tokens per expert summed over the token ranks (int64, experts + 2), "
            "once per MoE layer and micro-batch",
        ),
    ]
    again = [r for r in routers if r.again_on_recompute and _inside(r.fqn, checkpointed)]
    if again:
        rows.append(
            Collective(
                "all_reduce",
                axis,
                len(again) * microbatches,
                sum(r.bytes for r in again) * microbatches,
                "the balance loss's counts again, recomputing checkpointed blocks",
            )
        )
    return tuple(rows)


def _inside(fqn: str, blocks: Sequence[str]) -> bool:
    return any(fqn == block or fqn.startswith(block + ".") for block in blocks)


__all__ = ["CountingRouter", "count_collectives", "counting_routers"]
