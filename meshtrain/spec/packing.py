"""Packed sequences: which document each token belongs to, read from its position.

A packed window holds several documents end to end. Its per-token positions restart at each
document (``0, 1, 2, 0, 1, ...``), and that is all a model needs to attend within documents:
a token starts a new document wherever its position does not follow the previous token's by
one — the rule of ``transformers``' ``find_packed_sequence_indices``, so meshtrain's models and
``transformers`` models split the same windows into the same documents. A window whose
positions are ``0..S-1`` is one document (plain causal attention).

Pure torch on tensors: nothing here talks to other ranks. Under context parallelism each rank
holds only chunks of a window, so :mod:`meshtrain.lower.context.parallel` gathers the positions
of the whole window first and then applies this rule.

Example:
    >>> document_ids(torch.tensor([[0, 1, 2, 0, 1, 0], [5, 6, 7, 8, 9, 10]])).tolist()
    [[0, 0, 0, 1, 1, 2], [0, 0, 0, 0, 0, 0]]
"""

from __future__ import annotations

import torch

from meshtrain.errors import MeshtrainError

__all__ = ["document_ids", "same_document_causal"]


def document_ids(positions: torch.Tensor) -> torch.Tensor:
    """``[batch, seq]`` int64 document ids (from 0 in each row) of tokens at ``positions``
    ``[batch, seq]``: a new document wherever a position is not the previous one plus one.

    Example:
        >>> document_ids(torch.tensor([[3, 4, 0, 1, 7]])).tolist()
        [[0, 0, 1, 1, 2]]
    """
    if positions.dim() != 2:
        raise MeshtrainError(
            f"document_ids reads [batch, seq] positions; got a tensor of shape "
            f"{tuple(positions.shape)}. Pass one row of positions per sequence."
        )
    first = positions[:, :1] - 1  # the first token's difference is one: document 0
    steps = torch.diff(positions.to(torch.int64), prepend=first.to(torch.int64), dim=-1)
    return (steps != 1).cumsum(-1)


def same_document_causal(documents: torch.Tensor) -> torch.Tensor:
    """The boolean mask ``[batch, 1, seq, seq]`` of who sees whom in packed sequences: query
    ``i`` sees key ``j`` when ``j <= i`` and both lie in the same document (``documents``:
    ``[batch, seq]`` ids, e.g. from :func:`document_ids`).

    Example:
        >>> same_document_causal(torch.tensor([[0, 0, 1]]))[0, 0].int().tolist()
        [[1, 0, 0], [1, 1, 0], [0, 0, 1]]
    """
    seq = documents.shape[-1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=documents.device).tril()
    same = documents[:, :, None] == documents[:, None, :]
    return (same & causal)[:, None]
