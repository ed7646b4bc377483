"""Exact attention over blocks of keys and values: each block's attention with its log-sum-exp,
the online-softmax merge of two blocks, and the flash-attention backward of one block (pure
torch: no process group). Context parallelism (``ring_attention``) runs these on blocks that
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
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "KVBlock",
    "Visibility",
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
    """Masked, scaled scores' softmax against ``lse`` (this block's own when None), and the
    log-sum-exp used; masked entries are exactly zero, rows that see nothing all zero."""
    scores = (q5 @ _acc(k)[:, :, None].transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask[:, None, None], -math.inf)
    if lse is None:
        lse = torch.logsumexp(scores, dim=-1)
    finite = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    return torch.exp(scores - finite[..., None]), lse


def block_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """One block's attention in fp32: the output ``[B, Hq, Sq, D]`` normalised over this block
    alone, and its log-sum-exp ``[B, Hq, Sq]`` (``-inf`` on rows that see none of it).

    Example:
        >>> x = torch.zeros(1, 1, 2, 3)
        >>> out, lse = block_forward(x, x, x, torch.ones(1, 2, 2, dtype=torch.bool), 1.0)
        >>> round(lse[0, 0, 0].item(), 4)  # log(2): two equal scores
        0.6931
    """
    q5 = _grouped(_acc(q), k.shape[1])
    p, lse = _probabilities(q5, k, mask, scale, None)
    out = p @ _acc(v)[:, :, None]
    return out.flatten(1, 2), lse.flatten(1, 2)


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
    mask: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One block's share of dq and its dk, dv (fp32), recomputed from the final output and
    log-sum-exp of every block merged (flash attention's backward).

    Example:
        >>> x = torch.zeros(1, 1, 2, 3)
        >>> mask = torch.ones(1, 2, 2, dtype=torch.bool)
        >>> out, lse = block_forward(x, x, x, mask, 1.0)
        >>> [g.shape[2] for g in block_backward(x, x, x, out, x + 1, lse, mask, 1.0)]
        [2, 2, 2]
    """
    heads_kv = k.shape[1]
    q5, out5 = _grouped(_acc(q), heads_kv), _grouped(_acc(out), heads_kv)
    dout5 = _grouped(_acc(grad_out), heads_kv)
    p, _ = _probabilities(q5, k, mask, scale, _grouped(lse[..., None], heads_kv)[..., 0])
    k5, v5 = _acc(k)[:, :, None], _acc(v)[:, :, None]
    grad_v = (p.transpose(-1, -2) @ dout5).sum(2)
    delta = (dout5 * out5).sum(-1, keepdim=True)
    grad_s = p * (dout5 @ v5.transpose(-1, -2) - delta) * scale
    grad_q = (grad_s @ k5).flatten(1, 2)
    grad_k = (grad_s.transpose(-1, -2) @ q5).sum(2)
    return grad_q, grad_k, grad_v


class _Blockwise(torch.autograd.Function):
    """Attention over a list of blocks in one process, saving only q, the blocks, out and lse."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, masks: list[torch.Tensor], scale: float,
                *kv: torch.Tensor) -> torch.Tensor:  # fmt: skip
        out = torch.zeros_like(_acc(q))
        lse = torch.full(q.shape[:-1], -math.inf, dtype=out.dtype, device=q.device)
        for i, mask in enumerate(masks):
            if bool(mask.any()):
                out, lse = merge(out, lse, *block_forward(q, kv[2 * i], kv[2 * i + 1], mask, scale))
        ctx.save_for_backward(q, out, lse, *kv)
        ctx.masks, ctx.scale = masks, scale
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, out, lse, *kv = ctx.saved_tensors
        grad_q = torch.zeros_like(_acc(q))
        grads: list[torch.Tensor] = []
        for i, mask in enumerate(ctx.masks):
            k, v = kv[2 * i], kv[2 * i + 1]
            if not bool(mask.any()):
                grads += [torch.zeros_like(k), torch.zeros_like(v)]
                continue
            dq, dk, dv = block_backward(q, k, v, out, grad_out, lse, mask, ctx.scale)
            grad_q += dq
            grads += [dk.to(k.dtype), dv.to(v.dtype)]
        return (grad_q.to(q.dtype), None, None, *grads)


def blockwise_attention(
    q: torch.Tensor,
    blocks: Sequence[KVBlock],
    *,
    positions_q: torch.Tensor,
    documents_q: torch.Tensor | None = None,
    causal: bool = True,
    window: int | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Exact attention of ``q`` over every block, merged block by block (no communication);
    differentiable with respect to ``q`` and each block's ``k`` and ``v``, the backward
    recomputing each block's probabilities. Fully masked blocks are skipped.

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
    masks = [visible(positions_q, b.positions, rule, documents_q, b.documents) for b in blocks]
    kv = [t for b in blocks for t in (b.k, b.v)]
    return _Blockwise.apply(q, masks, scale, *kv)
