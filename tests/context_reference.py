"""One device's attention on the whole sequence, written the ordinary way (SDPA with an explicit
boolean mask built from ``transformers``' own mask functions), and the numerical contract context
attention is tested against.

Contract (fp32 accumulation, unit roundoff ``u = 2**-24``): every element of the output and of
dq, dk, dv is within ``4 · u · (Sk + 2·D·A + n_blocks + 4) · mag`` of the fp64 reference, where
``A`` is the largest ``scale · Σ_d |q_d||k_d|`` (how large a logit's rounding can get), ``Sk`` the
keys of a row, ``n_blocks`` the merges, and ``mag`` the same sums on absolute values (``Σ_j p_ij
|v_j|`` for the output, ...): the standard forward-error bound ``γ_n · |x|·|y|`` of the dot
products and sums involved (logits over D, probabilities over Sk, one exp and one rescaling per
merge), plus ``1e-30`` absolute: a probability below fp32's normal range (~1.2e-38) flushes
to zero, and its products with O(100) values stay far below that. bf16 inputs (fp32 inside, the result rounded once to bf16): within ``2**-8 · |ref|`` more.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.masking_utils import (
    and_masks,
    bidirectional_mask_function,
    causal_mask_function,
    packed_sequence_mask_function,
    sliding_window_causal_mask_function,
)

U32 = 2.0**-24
U_BF16 = 2.0**-8
UNDERFLOW = 1e-30  # probabilities below fp32's normal range (~1.2e-38) flush to zero


def reference_mask(
    positions_q: torch.Tensor,
    positions_kv: torch.Tensor,
    batch: int,
    causal: bool,
    window: int | None,
    documents_q: torch.Tensor | None = None,
    documents_kv: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[B, 1, Sq, Sk]``: True where a query sees a key, by ``transformers``' mask functions
    (evaluated on position tensors; documents compared as its packed-sequence mask does)."""
    if window is not None:
        rule = sliding_window_causal_mask_function(window)
    else:
        rule = causal_mask_function if causal else bidirectional_mask_function
    if documents_q is not None:
        assert documents_kv is not None
        same = packed_sequence_mask_function(torch.cat([documents_q, documents_kv], dim=1))
        queries, keys = positions_q.numel(), positions_kv.numel()
        docs = same(
            torch.arange(batch)[:, None, None],
            0,
            torch.arange(queries)[None, :, None],
            torch.arange(keys)[None, None, :] + queries,
        )
    else:
        docs = torch.ones(batch, 1, 1, dtype=torch.bool)
    qpos, kpos = positions_q[None, :, None], positions_kv[None, None, :]
    mask = and_masks(rule)(torch.arange(batch)[:, None, None], 0, qpos, kpos)
    return (mask & docs).expand(batch, positions_q.numel(), positions_kv.numel())[:, None]


def reference_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float | None
) -> torch.Tensor:
    """SDPA with an explicit boolean mask (grouped-query heads as ``enable_gqa``); a row that sees
    no key gets zeros (SDPA alone gives NaN there: such rows attend to everything, then zeroed)."""
    seen = mask.any(-1, keepdim=True)
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask | ~seen, scale=scale, enable_gqa=True
    )
    return out * seen


def _repeat(x: torch.Tensor, heads: int) -> torch.Tensor:
    return x.repeat_interleave(heads // x.shape[1], dim=1)


def magnitudes(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grad_out: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
) -> tuple[dict[str, torch.Tensor], float]:
    """Each result's sums on absolute values (``mag``, fp64) and ``A``, the largest logit bound."""
    q, k, v, g = (t.detach().double() for t in (q, k, v, grad_out))
    heads = q.shape[1]
    kr, vr = _repeat(k, heads), _repeat(v, heads)
    bound = (q.abs() @ kr.abs().transpose(-1, -2)) * abs(scale)
    p = torch.softmax((q @ kr.transpose(-1, -2) * scale).masked_fill(~mask, -torch.inf), -1)
    p = torch.nan_to_num(p) * mask
    out = p @ vr
    dp = g.abs() @ vr.abs().transpose(-1, -2) + (g.abs() * out.abs()).sum(-1, keepdim=True)
    ds = p * dp * abs(scale)
    group = heads // k.shape[1]

    def per_kv_head(x: torch.Tensor) -> torch.Tensor:
        b, _, s, d = x.shape
        return x.reshape(b, k.shape[1], group, s, d).sum(2)

    mags = {
        "out": p @ vr.abs(),
        "dq": ds @ kr.abs(),
        "dk": per_kv_head(ds.transpose(-1, -2) @ q.abs()),
        "dv": per_kv_head(p.transpose(-1, -2) @ g.abs()),
    }
    return mags, float(bound.masked_fill(~mask, 0).max())


def tolerance(
    mag: torch.Tensor, keys: int, dim: int, logit_bound: float, blocks: int
) -> torch.Tensor:
    """The contract's elementwise fp32 bound (see the module docstring)."""
    return 4 * U32 * (keys + 2 * dim * logit_bound + blocks + 4) * mag + UNDERFLOW
