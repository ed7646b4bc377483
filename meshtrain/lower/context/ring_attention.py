"""Context-parallel attention: each rank of a ``cp`` group holds a chunk of the sequence's
queries, keys and values (``context_layout``), and gets exactly the attention one device computes
on the whole sequence, restricted to its queries.

- ``method="ring"``: keys and values travel around the group in ``cp - 1`` point-to-point steps;
  each block's attention is merged with the exact online-softmax merge (``attention_blocks``). The
  backward recomputes each block (flash attention): it keeps only q, k, v, out and lse, rotates
  k and v again, and dk, dv travel with their block back to the rank that owns it, so a rank
  holds O(S_local) keys at any time, never the whole sequence.
- ``method="allgather"``: keys and values gathered (autograd-aware functional collectives), then
  one masked attention; the simple reference for the ring, O(S) keys per rank.

Positions (and document ids) of every rank's keys are all-gathered once per call (int64).

Bytes (what :func:`count_bytes` records on a rank, per call; ``E = 2·B·Hkv·S_local·D``, ``i`` the
itemsize of k, ``a`` that of the accumulation dtype: 4, or 8 for fp64), collectives counted as
the plan counts them (an all-gather's gathered output, a reduce-scatter's unreduced input):

==================  ======================  ======================
key                 ring                    allgather
==================  ======================  ======================
``forward/kv``      ``(cp - 1)·E·i`` sent   ``cp·E·i`` all-gather
``backward/kv``     ``(cp - 1)·E·i`` sent   --
``backward/dkv``    ``cp·E·a`` sent         ``cp·E·i`` reduce-scatter
``metadata``        ``cp·(1 + B)·S_local·8`` all-gather (``cp·S_local·8`` without documents)
==================  ======================  ======================

Nothing is sent when ``cp == 1``.

Example (on every rank of ``group``)::

    with count_bytes() as sent:
        out = context_attention(q, k, v, group=group, positions_q=chunk_positions(S, cp, rank))
        out.sum().backward()
    sent.counts   # {"metadata": ..., "forward/kv": ..., "backward/kv": ..., "backward/dkv": ...}
"""

from __future__ import annotations

import contextlib
import math
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, get_args

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed import ProcessGroup

import meshtrain.lower.context.attention_blocks as blocks
from meshtrain.errors import PlanError
from meshtrain.lower.compute import eager_island
from meshtrain.lower.context.attention_blocks import KVBlock, Visibility, blockwise_attention
from meshtrain.plan.context.axis import attention_shape_error
from meshtrain.plan.options import ContextMethod

__all__ = [
    "METHODS",
    "CommBytes",
    "KVBlock",
    "blockwise_attention",
    "context_attention",
    "count_bytes",
]

Method = ContextMethod  # the plan options' vocabulary, one definition
METHODS: tuple[Method, ...] = get_args(ContextMethod)


@dataclass
class CommBytes:
    """Bytes context attention moved on this rank while counted, by key (see the module's table).

    Example:
        >>> CommBytes(Counter({"forward/kv": 8, "metadata": 2})).total
        10
    """

    counts: Counter[str] = field(default_factory=Counter)

    @property
    def total(self) -> int:
        return sum(self.counts.values())


_ACTIVE: list[CommBytes] = []


@contextlib.contextmanager
def count_bytes() -> Iterator[CommBytes]:
    """Count the bytes every context attention (forward and backward) moves on this rank.

    Example:
        >>> with count_bytes() as sent:
        ...     pass
        >>> sent.total
        0
    """
    counter = CommBytes()
    _ACTIVE.append(counter)
    try:
        yield counter
    finally:
        _ACTIVE.remove(counter)


def _record(key: str, tensor: torch.Tensor, copies: int = 1) -> None:
    for counter in _ACTIVE:
        counter.counts[key] += copies * tensor.numel() * tensor.element_size()


def _source(rank: int, step: int, cp: int) -> int:
    """The rank whose keys and values a rank holds at ``step`` of the ring (they move forward)."""
    return (rank - step) % cp


_TAGS = {"forward/kv": 0, "backward/kv": 0, "backward/dkv": 1}  # kv and dkv in flight at once


def _exchange(tensor: torch.Tensor, group: ProcessGroup, key: str) -> tuple[Any, torch.Tensor]:
    """Send ``tensor`` to the next rank of the ring and receive the previous rank's (started;
    wait on the first result before reading the second)."""
    rank, cp = dist.get_rank(group), dist.get_world_size(group)
    tensor = tensor.contiguous()
    received = torch.empty_like(tensor)
    after, before, tag = (rank + 1) % cp, (rank - 1) % cp, _TAGS[key]
    works = dist.batch_isend_irecv(
        [
            dist.P2POp(dist.isend, tensor, group=group, tag=tag, group_peer=after),
            dist.P2POp(dist.irecv, received, group=group, tag=tag, group_peer=before),
        ]
    )
    _record(key, tensor)
    return works, received


def _wait(works: Any) -> None:
    for work in works or ():
        work.wait()


@dataclass(frozen=True)
class _Layout:
    """Every rank's key positions ``[cp, Sk]`` and document ids ``[cp, B, Sk]`` (or None), this
    rank's query positions and documents, and who sees whom."""

    positions_kv: torch.Tensor
    documents_kv: torch.Tensor | None
    positions_q: torch.Tensor
    documents_q: torch.Tensor | None
    rule: Visibility

    def mask(self, source: int) -> blocks.BlockMask:
        documents = None if self.documents_kv is None else self.documents_kv[source]
        return blocks.BlockMask(
            self.positions_q, self.positions_kv[source], self.rule, self.documents_q, documents
        )


def _gather_layout(
    group: ProcessGroup,
    positions_kv: torch.Tensor,
    documents_kv: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Every rank's key positions and document ids, in one all-gather of int64 rows."""
    rows = positions_kv.to(torch.int64)[None]
    if documents_kv is not None:
        rows = torch.cat([rows, documents_kv.to(torch.int64)])
    cp = dist.get_world_size(group)
    gathered = rows[None]
    if cp > 1:
        flat = funcol.wait_tensor(funcol.all_gather_single(rows.contiguous(), 0, group))
        gathered = flat.view(cp, *rows.shape)
        _record("metadata", gathered)
    return gathered[:, 0], None if documents_kv is None else gathered[:, 1:]


class _Ring(torch.autograd.Function):
    """Ring attention: forward merges the blocks as they arrive; backward rotates them again."""

    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        group: ProcessGroup,
        layout: _Layout,
        scale: float,
        tile: blocks.Tile,
    ) -> torch.Tensor:
        rank, cp = dist.get_rank(group), dist.get_world_size(group)
        out = torch.zeros_like(blocks._acc(q))
        lse = torch.full(q.shape[:-1], -math.inf, dtype=out.dtype, device=q.device)
        kv = torch.stack([k, v])
        for step in range(cp):
            works, arriving = _exchange(kv, group, "forward/kv") if step < cp - 1 else (None, kv)
            mask = layout.mask(_source(rank, step, cp))
            out, lse = blocks.attend(q, kv[0], kv[1], mask, scale, out, lse, tile)
            _wait(works)
            kv = arriving
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.layout, ctx.scale, ctx.tile = group, layout, scale, tile
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        group, layout, scale = ctx.group, ctx.layout, ctx.scale
        rank, cp = dist.get_rank(group), dist.get_world_size(group)
        grad_q = torch.zeros_like(out)
        kv, travelling = torch.stack([k, v]), None
        for step in range(cp):
            works, arriving = _exchange(kv, group, "backward/kv") if step < cp - 1 else (None, kv)
            mask = layout.mask(_source(rank, step, cp))
            dq, dk, dv = blocks.block_backward(
                q, kv[0], kv[1], out, grad_out, lse, mask, scale, ctx.tile
            )
            grad_q += dq
            grad_kv = torch.stack([dk, dv])
            if travelling is not None:
                grad_kv += travelling
            if cp > 1:  # the block's dk, dv go on with it; the last hop brings them home
                sent, travelling = _exchange(grad_kv, group, "backward/dkv")
                _wait(sent)
            else:
                travelling = grad_kv
            _wait(works)
            kv = arriving
        assert travelling is not None
        return (
            grad_q.to(q.dtype),
            travelling[0].to(k.dtype),
            travelling[1].to(v.dtype),
            None,
            None,
            None,
            None,
        )


def _count_reduce_scatter(grad: torch.Tensor) -> None:
    """The gathered keys' gradient, about to be reduce-scattered back to their ranks."""
    _record("backward/dkv", grad)


def _allgather(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: ProcessGroup,
    layout: _Layout,
    scale: float,
) -> torch.Tensor:
    """Gather every rank's keys and values (autograd: the backward reduce-scatters dk, dv), then
    one masked attention in plain differentiable torch."""
    cp = dist.get_world_size(group)
    kv = torch.stack([k, v])
    if cp > 1:
        gathered = funcol.all_gather_single(kv, 0, group)
        _record("forward/kv", kv, cp)
        if gathered.requires_grad:
            gathered.register_hook(_count_reduce_scatter)
    else:
        gathered = kv
    b, heads, s, d = k.shape
    whole = gathered.reshape(cp, 2, b, heads, s, d).permute(1, 2, 3, 0, 4, 5)
    whole = whole.reshape(2, b, heads, cp * s, d)
    documents = None if layout.documents_kv is None else layout.documents_kv.permute(1, 0, 2)
    mask = blocks.visible(
        layout.positions_q,
        layout.positions_kv.flatten(),
        layout.rule,
        layout.documents_q,
        None if documents is None else documents.reshape(b, cp * s),
    )
    return _masked_attention(q, whole[0], whole[1], mask, scale)


def _masked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """Plain differentiable attention in the accumulation dtype (rows that see nothing: zero)."""
    heads_kv = k.shape[1]
    q5 = blocks._grouped(blocks._acc(q), heads_kv)
    scores = (q5 @ blocks._acc(k)[:, :, None].transpose(-1, -2)) * scale
    wide = mask[:, None, None]
    scores = scores.masked_fill(~wide, torch.finfo(scores.dtype).min)
    probabilities = torch.softmax(scores, dim=-1) * wide
    return (probabilities @ blocks._acc(v)[:, :, None]).flatten(1, 2).to(q.dtype)


def _shape(tensor: torch.Tensor | None) -> str:
    return "None" if tensor is None else str(tuple(tensor.shape))


def _check(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions_q: torch.Tensor,
    positions_kv: torch.Tensor,
    documents: torch.Tensor | None,
    documents_kv: torch.Tensor | None,
    causal: bool,
    window: int | None,
    method: str,
) -> None:
    """A ``PlanError`` naming what does not fit, raised before any communication."""
    where = f"context attention (q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)})"
    if method not in METHODS:
        raise PlanError(f"{where}: method {method!r} is not one of {METHODS}.")
    shapes = attention_shape_error(tuple(q.shape), tuple(k.shape), tuple(v.shape))
    if shapes is not None:
        raise PlanError(f"context attention: {shapes}")
    if positions_q.shape != (q.shape[2],) or positions_kv.shape != (k.shape[2],):
        raise PlanError(
            f"{where}: positions_q {tuple(positions_q.shape)} and positions_kv "
            f"{tuple(positions_kv.shape)} must hold one position per local query and key."
        )
    for name, docs, tokens in (("documents", documents, q), ("documents_kv", documents_kv, k)):
        if docs is not None and docs.shape != (q.shape[0], tokens.shape[2]):
            raise PlanError(
                f"{where}: {name} {tuple(docs.shape)} must be [B, S_local] = "
                f"[{q.shape[0]}, {tokens.shape[2]}]."
            )
    if window is not None and (window < 1 or not causal):
        raise PlanError(
            f"{where}: window={window} needs causal=True and window >= 1 (a query at p sees "
            "keys p - window < s <= p)."
        )


# An eager island under torch.compile: point-to-point sends and a PlanError raised per call.
@eager_island
def context_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: ProcessGroup,
    positions_q: torch.Tensor,
    positions_kv: torch.Tensor | None = None,
    causal: bool = True,
    window: int | None = None,
    documents: torch.Tensor | None = None,
    documents_kv: torch.Tensor | None = None,
    scale: float | None = None,
    method: Method = "ring",
    tile: blocks.Tile = blocks.DEFAULT_TILE,
) -> torch.Tensor:
    """This rank's queries' attention over the keys and values of every rank of ``group``,
    equal to one device's attention on the whole sequence (``[B, Hq, S_local, D]``, q's dtype,
    computed in fp32). ``positions_q``: the true positions of this rank's tokens (the keys and
    values share them unless ``positions_kv`` is given); ``documents``: ``[B, S_local]`` document
    ids of packed sequences (``documents_kv`` for keys when they are other tokens); ``window``:
    a sliding window (``p - window < s <= p``); ``tile``: the ring computes each block's
    scores ``tile.q x tile.k`` at a time. Every rank of ``group`` must call it alike.

    Example (on every rank; ``x`` is ``[B, H, S, D]`` on every rank)::

        positions = chunk_positions(S, cp, rank)
        local = shard_sequence(x, 2, cp, rank)
        out = context_attention(local, local, local, group=group, positions_q=positions)
    """
    positions_kv = positions_q if positions_kv is None else positions_kv
    if documents_kv is None and k.shape[2] == q.shape[2]:
        documents_kv = documents
    _check(q, k, v, positions_q, positions_kv, documents, documents_kv, causal, window, method)
    if (documents is None) != (documents_kv is None):
        raise PlanError(
            f"context attention: documents {_shape(documents)} and documents_kv "
            f"{_shape(documents_kv)} go together: pass both (keys are other tokens than the "
            "queries) or neither."
        )
    gathered_positions, gathered_documents = _gather_layout(
        group,
        positions_kv.to(k.device),
        None if documents_kv is None else documents_kv.to(k.device),
    )
    layout = _Layout(
        gathered_positions,
        gathered_documents,
        positions_q.to(q.device),
        None if documents is None else documents.to(q.device),
        Visibility(causal, window),
    )
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if method == "allgather":
        return _allgather(q, k, v, group, layout, scale)
    return _Ring.apply(q, k, v, group, layout, scale, tile)
