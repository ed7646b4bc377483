"""Exact attention over blocks of keys and values: each block's attention with its log-sum-exp,
the online-softmax merge of two blocks, and the flash-attention backward of one block (pure
torch: no process group). Inside a block the scores are computed one :class:`Tile` at a time
(query rows x key columns, 512 x 512 by default), each tile merged into the running result with
the same merge, so at most ``[B, Hq, tile.q, tile.k]`` fp32 scores are alive at once. Context parallelism (``ring_attention``) runs these on blocks that
arrive from other ranks; :func:`blockwise_attention` runs them on a list in one process.

Conventions: ``q`` is ``[B, Hq, Sq, D]``, a block's ``k`` and ``v`` ``[B, Hkv, Sk, D]`` with
``Hq % Hkv == 0`` (query head ``h`` reads key head ``h // (Hq // Hkv)``, as
``F.scaled_dot_product_attention(..., enable_gqa=True)``). Everything is computed in fp32 (fp64 for fp64 inputs). A
query at position ``p`` sees a key at position ``s`` when ``s <= p`` (causal), ``s > p - window``
(a sliding window, Mistral's and ``transformers``' convention) and both carry the same document
id (packed sequences). A row that sees no key at all gets a zero output, a log-sum-exp of
``-inf`` and zero gradients (SDPA would give NaN).

Example:
    >>> q = k = v = torch.ones(1, 1, 2, 4)
    >>> pos = torch.arange(2)
    >>> out = blockwise_attention(q, [KVBlock(k, v, pos)], positions_q=pos)
    >>> out.shape
    torch.Size([1, 1, 2, 4])
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from meshtrain.errors import PlanError
from meshtrain.plan.context.cost import TILE_K, TILE_Q

__all__ = [
    "DEFAULT_TILE",
    "BlockMask",
    "KVBlock",
    "Mask",
    "Tile",
    "Visibility",
    "attend",
    "block_backward",
    "block_forward",
    "blockwise_attention",
    "merge",
    "visible",
]


@dataclass(frozen=True)
class Visibility:
    """Which keys a query sees: causal, a sliding window (keys ``p - window < s``), documents.

    Example:
        >>> Visibility(causal=True, window=4).window
        4
    """

    causal: bool = True
    window: int | None = None


@dataclass(frozen=True)
class KVBlock:
    """One block of keys and values with their true positions (``[Sk]``) and, for packed
    sequences, document ids (``[B, Sk]``).

    Example:
        >>> KVBlock(torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 2, 4), torch.arange(2)).k.shape
        torch.Size([1, 1, 2, 4])
    """

    k: torch.Tensor
    v: torch.Tensor
    positions: torch.Tensor
    documents: torch.Tensor | None = None


def visible(
    positions_q: torch.Tensor,
    positions_kv: torch.Tensor,
    rule: Visibility,
    documents_q: torch.Tensor | None = None,
    documents_kv: torch.Tensor | None = None,
) -> torch.Tensor:
    """The boolean mask ``[B or 1, Sq, Sk]``: True where a query sees a key.

    Example:
        >>> visible(torch.arange(3), torch.arange(3), Visibility(window=2)).int().tolist()
        [[[1, 0, 0], [1, 1, 0], [0, 1, 1]]]
    """
    device = positions_q.device  # a query's positions decide where the mask lives
    qpos, kpos = positions_q[:, None], positions_kv.to(device)[None, :]
    mask = torch.ones(qpos.shape[0], kpos.shape[1], dtype=torch.bool, device=qpos.device)
    if rule.causal:
        mask = mask & (kpos <= qpos)
    if rule.window is not None:
        mask = mask & (kpos > qpos - rule.window)
    mask = mask[None]
    if documents_q is not None and documents_kv is not None:
        same = documents_q.to(device)[:, :, None] == documents_kv.to(device)[:, None, :]
        mask = mask & same
    return mask


@dataclass(frozen=True)
class Tile:
    """The query rows and key columns of one tile: a block's scores are computed ``q x k`` at a
    time, so a rank holds ``[B, Hq, q, k]`` fp32 scores at once, whatever the block's length.

    Example:
        >>> Tile(256, 1024).k
        1024
    """

    q: int = TILE_Q
    k: int = TILE_K

    def __post_init__(self) -> None:
        if self.q < 1 or self.k < 1:
            raise PlanError(f"attention tile {self.q} x {self.k}: both sides must be >= 1.")


DEFAULT_TILE = Tile()


@dataclass(frozen=True)
class BlockMask:
    """Who sees whom between a rank's queries and one block of keys, built tile by tile
    (:meth:`tile`) rather than as a whole ``[B, Sq, Sk]`` mask.

    Example:
        >>> pos = torch.arange(4)
        >>> BlockMask(pos, pos, Visibility()).tile(slice(2, 4), slice(0, 2)).int().tolist()
        [[[1, 1], [1, 1]]]
    """

    positions_q: torch.Tensor
    positions_kv: torch.Tensor
    rule: Visibility
    documents_q: torch.Tensor | None = None
    documents_kv: torch.Tensor | None = None

    def tile(self, rows: slice, cols: slice) -> torch.Tensor:
        """The mask ``[B or 1, rows, cols]`` of one tile (:func:`visible`)."""
        dq, dk = self.documents_q, self.documents_kv
        return visible(
            self.positions_q[rows],
            self.positions_kv[cols],
            self.rule,
            None if dq is None else dq[:, rows],
            None if dk is None else dk[:, cols],
        )


#: a block's visibility: a whole boolean ``[B or 1, Sq, Sk]`` mask, or built tile by tile
Mask = torch.Tensor | BlockMask


def _acc(t: torch.Tensor) -> torch.Tensor:
    """``t`` in its accumulation dtype: fp32, or fp64 for fp64 inputs."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _grouped(q: torch.Tensor, heads_kv: int) -> torch.Tensor:
    """``[B, Hq, S, D]`` as ``[B, Hkv, Hq // Hkv, S, D]`` (a view: query heads by key head)."""
    b, hq, s, d = q.shape
    return q.reshape(b, heads_kv, hq // heads_kv, s, d)


def _probabilities(
    q5: torch.Tensor, k: torch.Tensor, mask: torch.Tensor, scale: float, lse: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked, scaled scores' softmax against ``lse`` (this tile's own when None), and the
    log-sum-exp used; masked entries are exactly zero, rows that see nothing all zero."""
    scores = (q5 @ _acc(k)[:, :, None].transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask[:, None, None], -math.inf)
    if lse is None:
        lse = torch.logsumexp(scores, dim=-1)
    finite = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    return torch.exp(scores - finite[..., None]), lse


def _tiles(
    mask: Mask, rows: int, cols: int, tile: Tile
) -> Iterator[tuple[slice, slice, torch.Tensor]]:
    """Every ``tile.q x tile.k`` tile of a block that some query sees: its query rows, key
    columns and mask ``[B or 1, tq, tk]`` (fully masked tiles skipped, never built whole)."""
    for r in range(0, rows, tile.q):
        for c in range(0, cols, tile.k):
            rs, cs = slice(r, min(r + tile.q, rows)), slice(c, min(c + tile.k, cols))
            part = mask.tile(rs, cs) if isinstance(mask, BlockMask) else mask[:, rs, cs]
            if bool(part.any()):
                yield rs, cs, part


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: Mask,
    scale: float,
    out: torch.Tensor,
    lse: torch.Tensor,
    tile: Tile = DEFAULT_TILE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``out`` and ``lse`` (the running merge, fp32 ``[B, Hq, Sq, D]`` and ``[B, Hq, Sq]``)
    with one block's keys merged in, tile by tile: each tile's attention and log-sum-exp
    (online softmax, :func:`merge`) so only ``[B, Hq, tile.q, tile.k]`` scores live at once.

    Example:
        >>> x = torch.zeros(1, 1, 4, 3)
        >>> out, lse = torch.zeros(1, 1, 4, 3), torch.full((1, 1, 4), -math.inf)
        >>> mask = torch.ones(1, 4, 4, dtype=torch.bool)
        >>> out, lse = attend(x, x, x, mask, 1.0, out, lse, Tile(2, 2))
        >>> round(lse[0, 0, 0].item(), 4)  # log(4): four equal scores, two tiles merged
        1.3863
    """
    q5 = _grouped(_acc(q), k.shape[1])
    out5, lse5 = _grouped(out, k.shape[1]), _grouped(lse[..., None], k.shape[1])[..., 0]
    for rs, cs, part in _tiles(mask, q.shape[2], k.shape[2], tile):
        p, tile_lse = _probabilities(q5[..., rs, :], k[:, :, cs], part, scale, None)
        tile_out = p @ _acc(v[:, :, cs])[:, :, None]
        out5[..., rs, :], lse5[..., rs] = merge(out5[..., rs, :], lse5[..., rs], tile_out, tile_lse)
    return out5.flatten(1, 2), lse5.flatten(1, 2)


def block_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: Mask,
    scale: float,
    tile: Tile = DEFAULT_TILE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One block's attention in fp32: the output ``[B, Hq, Sq, D]`` normalised over this block
    alone, and its log-sum-exp ``[B, Hq, Sq]`` (``-inf`` on rows that see none of it).

    Example:
        >>> x = torch.zeros(1, 1, 2, 3)
        >>> out, lse = block_forward(x, x, x, torch.ones(1, 2, 2, dtype=torch.bool), 1.0)
        >>> round(lse[0, 0, 0].item(), 4)  # log(2): two equal scores
        0.6931
    """
    out = torch.zeros_like(_acc(q))
    lse = torch.full(q.shape[:-1], -math.inf, dtype=out.dtype, device=q.device)
    return attend(q, k, v, mask, scale, out, lse, tile)


def merge(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two normalised partial attentions over disjoint key sets as one: weights
    ``exp(lse_i - max)`` (the max keeps ``exp`` finite for any logits), ``lse = max + log(sum)``;
    a side that saw nothing (``-inf``) weighs zero, rows that saw nothing stay zero and ``-inf``.

    Example:
        >>> one, zero = torch.ones(1, 1), torch.zeros(1)
        >>> out, lse = merge(one, zero, 3 * one, zero)
        >>> out.item(), round(lse.item(), 4)
        (2.0, 0.6931)
    """
    top = torch.maximum(lse_a, lse_b)
    top = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    w_a, w_b = torch.exp(lse_a - top), torch.exp(lse_b - top)
    total = w_a + w_b
    safe = torch.where(total == 0, torch.ones_like(total), total)
    out = (w_a[..., None] * out_a + w_b[..., None] * out_b) / safe[..., None]
    return out, top + torch.log(total)


def block_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    grad_out: torch.Tensor,
    lse: torch.Tensor,
    mask: Mask,
    scale: float,
    tile: Tile = DEFAULT_TILE,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One block's share of dq and its dk, dv (fp32), recomputed tile by tile from the final
    output and log-sum-exp of every block merged (flash attention's backward).

    Example:
        >>> x = torch.zeros(1, 1, 2, 3)
        >>> mask = torch.ones(1, 2, 2, dtype=torch.bool)
        >>> out, lse = block_forward(x, x, x, mask, 1.0)
        >>> [g.shape[2] for g in block_backward(x, x, x, out, x + 1, lse, mask, 1.0)]
        [2, 2, 2]
    """
    heads_kv = k.shape[1]
    q5, dout5 = _grouped(_acc(q), heads_kv), _grouped(_acc(grad_out), heads_kv)
    lse5 = _grouped(lse[..., None], heads_kv)[..., 0]
    delta = (dout5 * _grouped(_acc(out), heads_kv)).sum(-1, keepdim=True)
    k5, v5 = _acc(k)[:, :, None], _acc(v)[:, :, None]
    grad_q = torch.zeros_like(q5)
    grad_k, grad_v = torch.zeros_like(_acc(k)), torch.zeros_like(_acc(v))
    for rs, cs, part in _tiles(mask, q.shape[2], k.shape[2], tile):
        p, _ = _probabilities(q5[..., rs, :], k[:, :, cs], part, scale, lse5[..., rs])
        dout = dout5[..., rs, :]
        grad_v[:, :, cs] += (p.transpose(-1, -2) @ dout).sum(2)
        grad_s = p * (dout @ v5[..., cs, :].transpose(-1, -2) - delta[..., rs, :]) * scale
        grad_q[..., rs, :] += grad_s @ k5[..., cs, :]
        grad_k[:, :, cs] += (grad_s.transpose(-1, -2) @ q5[..., rs, :]).sum(2)
    return grad_q.flatten(1, 2), grad_k, grad_v


class _Blockwise(torch.autograd.Function):
    """Attention over a list of blocks in one process, saving only q, the blocks, out and lse."""

    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        masks: list[BlockMask],
        scale: float,
        tile: Tile,
        *kv: torch.Tensor,
    ) -> torch.Tensor:
        out = torch.zeros_like(_acc(q))
        lse = torch.full(q.shape[:-1], -math.inf, dtype=out.dtype, device=q.device)
        for i, mask in enumerate(masks):
            out, lse = attend(q, kv[2 * i], kv[2 * i + 1], mask, scale, out, lse, tile)
        ctx.save_for_backward(q, out, lse, *kv)
        ctx.masks, ctx.scale, ctx.tile = masks, scale, tile
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, out, lse, *kv = ctx.saved_tensors
        grad_q = torch.zeros_like(_acc(q))
        grads: list[torch.Tensor] = []
        for i, mask in enumerate(ctx.masks):
            k, v = kv[2 * i], kv[2 * i + 1]
            dq, dk, dv = block_backward(q, k, v, out, grad_out, lse, mask, ctx.scale, ctx.tile)
            grad_q += dq
            grads += [dk.to(k.dtype), dv.to(v.dtype)]
        return (grad_q.to(q.dtype), None, None, None, *grads)


def blockwise_attention(
    q: torch.Tensor,
    blocks: Sequence[KVBlock],
    *,
    positions_q: torch.Tensor,
    documents_q: torch.Tensor | None = None,
    causal: bool = True,
    window: int | None = None,
    scale: float | None = None,
    tile: Tile = DEFAULT_TILE,
) -> torch.Tensor:
    """Exact attention of ``q`` over every block, merged tile by tile (no communication);
    differentiable with respect to ``q`` and each block's ``k`` and ``v``, the backward
    recomputing each tile's probabilities. Fully masked tiles are skipped.

    Example:
        >>> q = torch.randn(1, 2, 4, 8)
        >>> kv = torch.randn(1, 1, 4, 8)
        >>> pos = torch.arange(4)
        >>> halves = [KVBlock(kv[:, :, i:i + 2], kv[:, :, i:i + 2], pos[i:i + 2]) for i in (0, 2)]
        >>> whole = blockwise_attention(q, [KVBlock(kv, kv, pos)], positions_q=pos)
        >>> torch.allclose(blockwise_attention(q, halves, positions_q=pos), whole, atol=1e-6)
        True
    """
    rule = Visibility(causal, window)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    positions_q = positions_q.to(q.device)
    masks = [
        BlockMask(positions_q, b.positions.to(q.device), rule, documents_q, b.documents)
        for b in blocks
    ]
    kv = [t for b in blocks for t in (b.k, b.v)]
    return _Blockwise.apply(q, masks, scale, tile, *kv)
