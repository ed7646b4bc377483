"""Where a tensor-parallel shard lands after an op — pure shape arithmetic for the abstract run
(:mod:`meshtrain.plan.proof.run`).

A rank's tensor is the shard of one device's tensor along one dim (``local = whole / ways`` on
that dim, equal elsewhere). After an op, comparing the rank's output with one device's says
where the shard went; a reshape must also put it where a contiguous shard of the input lands
(the outermost non-1 dim of the output dims the sharded input dim flows into), or the rank
holds a differently cut tensor of the same shape (a reshape with a global head count).

Example:
    >>> shard_dim_of((1, 6, 4, 8), (1, 6, 8, 8), ways=2)
    2
    >>> reshaped_shard_dim((1, 6, 64), (1, 6, 8, 8), 2, ways=2)
    (2, 1)
"""

from __future__ import annotations

import math
from collections.abc import Sequence

#: the rank's output is not a shard of one device's (several dims differ, or not by ``ways``)
NOT_A_SHARD = -2


def shard_dim_of(local: Sequence[int], whole: Sequence[int], *, ways: int) -> int | None:
    """The dim along which ``local`` is a ``ways``-th of ``whole``; None when the shapes are
    equal (nothing sharded); :data:`NOT_A_SHARD` otherwise.

    Example:
        >>> shard_dim_of((3, 5), (3, 5), ways=2), shard_dim_of((3, 5), (3, 7), ways=2)
        (None, -2)
    """
    if len(local) != len(whole):
        return NOT_A_SHARD
    differing = [i for i, (a, b) in enumerate(zip(local, whole)) if a != b]
    if not differing:
        return None
    if len(differing) > 1 or local[differing[0]] * ways != whole[differing[0]]:
        return NOT_A_SHARD
    return differing[0]


def reshaped_shard_dim(
    whole_in: Sequence[int], whole_out: Sequence[int], dim: int, *, ways: int, outer: int = 1
) -> tuple[int, int] | None:
    """Where a ``ways``-way shard of input dim ``dim`` lands under a reshape from ``whole_in``
    to ``whole_out`` (one device's shapes): the output dim and its ``outer`` factor, or None when
    no output dim holds it as a shard. ``outer``: the shard cuts the dim viewed as
    ``[outer, size / outer]`` on its second part (a shard of heads merged with the batch before
    it, as ``matmul`` does: ``[batch, heads/ways, ...]`` → ``[batch·heads/ways, ...]``).

    Example (a [seq, heads·head_dim] activation viewed as [seq, heads, head_dim], and batch and
    heads merged):
        >>> reshaped_shard_dim((6, 64), (6, 8, 8), 1, ways=2)
        (1, 1)
        >>> reshaped_shard_dim((3, 8, 6), (24, 6), 1, ways=2)
        (0, 3)
        >>> reshaped_shard_dim((6, 64), (6, 8, 8), 1, ways=16) is None
        True
    """
    for inputs, outputs in _groups(tuple(whole_in), tuple(whole_out)):
        if dim not in inputs:
            continue
        before = math.prod(whole_in[i] for i in inputs if i < dim) * outer
        inner = whole_in[dim] // outer  # the sharded part, cut into ``ways`` on its outside
        seen = 1
        for k in outputs:
            size = whole_out[k]
            if before % seen == 0 and size % (before // seen) == 0:
                block = size // (before // seen)
                fits = block % ways == 0 and (inner % block == 0 or block % inner == 0)
                if size > 1 and fits:
                    return k, before // seen
            seen *= size
        return None
    return None


def _groups(
    shape_in: tuple[int, ...], shape_out: tuple[int, ...]
) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Runs of input dims and output dims with equal products (what a reshape maps onto what)."""
    groups: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    i = j = 0
    while i < len(shape_in) or j < len(shape_out):
        start_i, start_j = i, j
        prod_in = shape_in[i] if i < len(shape_in) else 1
        prod_out = shape_out[j] if j < len(shape_out) else 1
        i, j = i + 1, j + 1
        while prod_in != prod_out:
            if prod_in < prod_out and i < len(shape_in):
                prod_in, i = prod_in * shape_in[i], i + 1
            elif j < len(shape_out):
                prod_out, j = prod_out * shape_out[j], j + 1
            else:
                break
        groups.append(
            (
                tuple(range(start_i, min(i, len(shape_in)))),
                tuple(range(start_j, min(j, len(shape_out)))),
            )
        )
    return groups


def local_shape_over(shape: Sequence[int], sharded: Sequence[bool], ways: int) -> tuple[int, ...]:
    """``shape`` with each dim marked in ``sharded`` split ``ways`` ways (rounded up).

    Example:
        >>> local_shape_over((64, 32), (True, False), 2)
        (32, 32)
    """
    return tuple(-(-n // ways) if cut else n for n, cut in zip(shape, sharded))


def numel(shape: Sequence[int]) -> int:
    """Elements of ``shape``."""
    return math.prod(shape)
