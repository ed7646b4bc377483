"""Which tokens of a sequence each context-parallel rank holds, and moving between the whole
sequence and a rank's share (pure torch: no process group).

Two balances over ``cp`` ranks:

- ``"headtail"`` splits the sequence into ``2 * cp`` equal chunks and gives rank ``r`` chunks
  ``r`` and ``2 * cp - 1 - r``, so under a causal mask every rank does the same work (the one
  early chunk's light rows pair with the one late chunk's heavy rows);
- ``"contiguous"`` gives rank ``r`` the ``r``-th of ``cp`` equal chunks.

Example:
    >>> chunk_positions(8, 2, 0).tolist(), chunk_positions(8, 2, 1).tolist()
    ([0, 1, 6, 7], [2, 3, 4, 5])
    >>> x = torch.arange(8)
    >>> shards = [shard_sequence(x, 0, 2, r) for r in range(2)]
    >>> unshard_sequence(shards, 0, 2).tolist()
    [0, 1, 2, 3, 4, 5, 6, 7]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import get_args

import torch

from meshtrain.errors import PlanError
from meshtrain.plan.options import ContextBalance

__all__ = ["BALANCES", "Balance", "chunk_positions", "shard_sequence", "unshard_sequence"]

Balance = ContextBalance  # the plan options' vocabulary, one definition
BALANCES: tuple[Balance, ...] = get_args(ContextBalance)


def _check(seq_len: int, cp: int, balance: str) -> int:
    """The length of one chunk; a ``PlanError`` naming the fix when the split is not even."""
    if balance not in BALANCES:
        raise PlanError(
            f"context-parallel balance {balance!r} is not one of {BALANCES}: use 'headtail' "
            "(causal attention, every rank the same work) or 'contiguous'."
        )
    if cp < 1:
        raise PlanError(f"the context-parallel degree cp must be at least 1, got cp={cp}.")
    chunks = 2 * cp if balance == "headtail" else cp
    if seq_len <= 0 or seq_len % chunks:
        raise PlanError(
            f"sequence length {seq_len} cannot be split into {chunks} equal chunks for "
            f"cp={cp} with balance {balance!r}: use a sequence length that is a multiple of "
            f"{chunks} (e.g. {max(chunks, (seq_len // chunks + 1) * chunks)}), or pad it."
        )
    return seq_len // chunks


def chunk_positions(
    seq_len: int, cp: int, rank: int, balance: Balance = "headtail"
) -> torch.Tensor:
    """The true positions (int64, ascending, ``seq_len // cp`` of them) of ``rank``'s tokens.

    Example:
        >>> chunk_positions(12, 3, 1, "contiguous").tolist()
        [4, 5, 6, 7]
    """
    size = _check(seq_len, cp, balance)
    if not 0 <= rank < cp:
        raise PlanError(f"context-parallel rank {rank} is outside 0..{cp - 1} (cp={cp}).")
    if balance == "contiguous":
        return _chunk(rank, size)
    return torch.cat([_chunk(rank, size), _chunk(2 * cp - 1 - rank, size)])


def _chunk(index: int, size: int) -> torch.Tensor:
    """The positions of the ``index``-th chunk of ``size`` tokens."""
    return torch.arange(index * size, (index + 1) * size)


def _all_positions(seq_len: int, cp: int, balance: Balance) -> torch.Tensor:
    """Every rank's positions, in rank order: the gathered order of the sequence."""
    return torch.cat([chunk_positions(seq_len, cp, r, balance) for r in range(cp)])


def shard_sequence(
    x: torch.Tensor, dim: int, cp: int, rank: int, balance: Balance = "headtail"
) -> torch.Tensor:
    """``rank``'s tokens of ``x`` along ``dim`` (a copy, in ``chunk_positions`` order).

    Example:
        >>> shard_sequence(torch.arange(8).view(1, 8), 1, 2, 1).tolist()
        [[2, 3, 4, 5]]
    """
    positions = chunk_positions(x.shape[dim], cp, rank, balance)
    return x.index_select(dim, positions.to(x.device))


def unshard_sequence(
    chunks: Sequence[torch.Tensor] | torch.Tensor,
    dim: int,
    cp: int,
    balance: Balance = "headtail",
) -> torch.Tensor:
    """The whole sequence from every rank's share: a list in rank order, or their concatenation
    along ``dim`` (what an all-gather returns); the inverse of :func:`shard_sequence`.

    Example:
        >>> unshard_sequence(torch.tensor([0, 1, 6, 7, 2, 3, 4, 5]), 0, 2).tolist()
        [0, 1, 2, 3, 4, 5, 6, 7]
    """
    if not isinstance(chunks, torch.Tensor):
        if len(chunks) != cp:
            raise PlanError(
                f"unshard_sequence got {len(chunks)} chunks for cp={cp}: pass one per rank, "
                "in rank order."
            )
        chunks = torch.cat(list(chunks), dim)
    positions = _all_positions(chunks.shape[dim], cp, balance)
    return chunks.index_select(dim, torch.argsort(positions).to(chunks.device))
