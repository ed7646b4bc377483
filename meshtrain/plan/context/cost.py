"""What context parallelism costs one rank: activation memory and the attention's traffic.

**Memory.** Under a context axis of ``cp`` ranks every sequence-shaped activation is split ``cp``
ways, so the planner traces the model's forward on ``seq_len / cp`` tokens
(:func:`local_seq_len`): embedding, norms, projections, MLP, logits and each attention's saved
query, keys, values and log-sum-exp are then one rank's. On top of that trace
(:func:`context_profile`, per attention call):

- ``"ring"`` saves its merged output in fp32 (the accumulation dtype), and returns it laid out
  ``[B, Hq, S, D]``, so the model's transpose back to ``[B, S, Hq·D]`` copies it for the output
  projection (SDPA returns its output in that layout already, and the projection saves a view
  of it): 4 bytes more per output element, whatever the compute dtype;
- ``"allgather"`` saves, per layer, what its plain attention over the whole sequence keeps for
  backward: the gathered keys and values in fp32 (``cp·E·4``), the softmax and the masked
  probabilities (two fp32 ``[B, Hq, S_local, S]``) and the boolean mask (``[B, S_local, S]``):
  quadratic in the sequence, the reference method, not the one to size long runs by.

While one layer's ring runs it holds besides (:func:`ring_in_flight`, a transient counted once):
its stacked key/value block and the one arriving, and in backward the fp32 key/value gradients
(its own, the travelling ones, the ones arriving), the fp32 query gradient and the block's share
of it; and three fp32 ``[B, Hq, tq, tk]`` tensors of one tile (scores, probabilities and their
gradient: meshtrain's kernel computes each block ``TILE_Q x TILE_K`` at a time, the tile clipped
to ``S_local``; :func:`score_tile_bytes`), whatever the sequence's length (``scores=False``
leaves them out, as a fused kernel that keeps none in memory would).

**Traffic**, per attention call, per micro-batch, per rank (``E = 2·B·Hkv·S_local·D`` elements of
keys and values, ``i`` their itemsize; exactly what
:func:`meshtrain.lower.context.ring_attention.count_bytes` measures):

=======================  =====================================  ================================
                         ``ring``                               ``allgather``
=======================  =====================================  ================================
forward                  ``cp - 1`` sends of ``E·i``            all-gather of ``cp·E·i``
backward                 ``cp - 1`` sends of ``E·i`` and        reduce-scatter of ``cp·E·i``
                         ``cp`` of the fp32 gradients ``E·4``
positions (+ documents)  all-gather of ``cp·S_local·8`` (``cp·(1 + B)·S_local·8`` with documents)
=======================  =====================================  ================================

A checkpointed block (``full`` or ``selective``) runs its forward again in backward, its
forward traffic included. FSDP shards and reduces over the data axes and the context axis as one
group (:func:`context_data_axes`).

Example:
    >>> call = AttentionCall(query=(1, 32, 1024, 128), key=(1, 8, 1024, 128),
    ...                      value=(1, 8, 1024, 128), element_bytes=2)
    >>> kv_bytes(call)
    4194304
    >>> [(c.kind, c.count, c.bytes) for c in attention_collectives([call], cp=4, axis="cp")]
    [('all_gather', 1, 32768), ('send/recv', 3, 12582912), ('send/recv', 7, 46137344)]
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

from meshtrain.plan.infer import Inferred
from meshtrain.plan.ir import Collective
from meshtrain.plan.memory.activations import ActivationProfile, AttentionCall, BlockActivations
from meshtrain.plan.options import PlanOptions
from meshtrain.spec.mesh import Mesh

#: bytes of one position or document id (int64)
INDEX_BYTES = 8
#: bytes of an element in the ring's accumulation dtype (its output, lse and gradients: fp32)
ACC_BYTES = 4
#: query rows and key columns of one tile of the ring's kernel (``attention_blocks.Tile``)
TILE_Q = TILE_K = 512


def local_seq_len(seq_len: int | None, cp: int) -> int | None:
    """The tokens of each sequence one context rank holds.

    Example:
        >>> local_seq_len(131072, 8), local_seq_len(None, 8)
        (16384, None)
    """
    return None if seq_len is None else seq_len // cp


def _per_rank(numel: int, itemsize: int, call: AttentionCall, tp_size: int) -> int:
    return numel * itemsize // (tp_size if call.in_tp else 1)


def kv_elements(call: AttentionCall) -> int:
    """``E``: the elements of one rank's keys and values of ``call`` (traced on its tokens)."""
    return math.prod(call.key) + math.prod(call.value)


def kv_bytes(call: AttentionCall, tp_size: int = 1) -> int:
    """One rank's keys and values of ``call``, in their dtype."""
    return _per_rank(kv_elements(call), call.element_bytes, call, tp_size)


def metadata_bytes(call: AttentionCall, cp: int, documents: bool = False) -> int:
    """The gathered positions (``[cp, S_local]``) and document ids (``[cp, B, S_local]``)."""
    batch, seq = call.key[0], call.key[2]
    return cp * (1 + (batch if documents else 0)) * seq * INDEX_BYTES


def attention_calls(
    profile: ActivationProfile, fqns: Sequence[str] | None = None
) -> list[AttentionCall]:
    """Every attention call of the traced blocks (those in ``fqns`` when given), in order."""
    return [
        call
        for block in profile.blocks
        if fqns is None or block.fqn in fqns
        for call in block.attention
    ]


def attention_collectives(
    calls: Sequence[AttentionCall],
    *,
    cp: int,
    axis: str,
    method: str = "ring",
    microbatches: int = 1,
    recomputed: Sequence[AttentionCall] = (),
    documents: bool = False,
    tp_size: int = 1,
) -> tuple[Collective, ...]:
    """The context axis's collectives per optimizer step (module docstring): ``calls`` run once
    per micro-batch, ``recomputed`` (those of fully checkpointed blocks) once more in forward."""
    if cp <= 1 or not calls:
        return ()
    forward_calls = [*calls, *recomputed]
    n, m = len(forward_calls), microbatches
    kv = sum(kv_bytes(c, tp_size) for c in forward_calls) * m
    kv_backward = sum(kv_bytes(c, tp_size) for c in calls) * m
    rows = [
        Collective(
            "all_gather",
            axis,
            n * m,
            sum(metadata_bytes(c, cp, documents) for c in forward_calls) * m,
            "positions (and document ids) of every context rank's keys, once per attention",
        ),
    ]
    if method == "allgather":
        return (
            *rows,
            Collective(
                "all_gather", axis, n * m, cp * kv, "forward: every context rank's keys and values"
            ),
            Collective(
                "reduce_scatter",
                axis,
                len(calls) * m,
                cp * kv_backward,
                "backward: key and value gradients back to their ranks",
            ),
        )
    grads = sum(_per_rank(kv_elements(c), ACC_BYTES, c, tp_size) for c in calls) * m
    return (
        *rows,
        Collective(
            "send/recv",
            axis,
            (cp - 1) * n * m,
            (cp - 1) * kv,
            "forward: keys and values passed around the context ring",
        ),
        Collective(
            "send/recv",
            axis,
            (2 * cp - 1) * len(calls) * m,
            (cp - 1) * kv_backward + cp * grads,
            "backward: keys and values again, their fp32 gradients travelling home",
        ),
    )


def context_profile(
    profile: ActivationProfile, cp: int, method: str, *, scores: bool = True
) -> ActivationProfile:
    """``profile`` (traced on the local tokens) with what ``method`` saves beyond SDPA and the
    ring's buffers in flight as its transient (module docstring; ``scores``: see
    :func:`ring_in_flight`)."""
    if cp <= 1:
        return profile
    blocks = tuple(_saved_beyond_sdpa(block, cp, method) for block in profile.blocks)
    in_flight = ring_in_flight(profile, cp, method, scores=scores)
    return replace(profile, blocks=blocks, transient=profile.transient + in_flight)


def context_data_axes(layout: Inferred, mesh: Mesh) -> Inferred:
    """``layout`` as the data-parallel cost sees it: FSDP shards and reduces over the data axes
    and the context axis together, one group (``"dp+cp"``; parameters are replicated over the
    context axis and each of its ranks holds other tokens, as torchtitan's ``dp_shard_cp``);
    under HSDP the replicate axis stays apart (``("rep", "dp+cp")``: FSDP reduce-scatters over
    ``dp+cp`` and all-reduces over ``rep``).

    Example:
        >>> layout = Inferred((), None, False, (), (), (), (), (), None, 0, None, (),
        ...                   context_axis="cp")
        >>> context_data_axes(layout, Mesh(("dp", "cp"), (1, 8))).data_axes
        ('cp',)
        >>> hsdp = replace(layout, data_axes=("rep", "dp"))
        >>> context_data_axes(hsdp, Mesh(("rep", "dp", "cp"), (2, 2, 2))).data_axes
        ('rep', 'dp+cp')
    """
    if layout.context_axis is None:
        return layout
    replicate = layout.data_axes[:-1]  # HSDP: the replicate axis stays a dim of its own
    shard = mesh.joined((*layout.data_axes[len(replicate) :], layout.context_axis))
    return replace(layout, data_axes=(*replicate, shard))


def context_costing(
    layout: Inferred, mesh: Mesh, options: PlanOptions
) -> tuple[Inferred, PlanOptions]:
    """``layout`` and ``options`` as the costs see them under context parallelism: FSDP over the
    data and context axes as one group (:func:`context_data_axes`) and each rank's share of a
    sequence (``seq_len / cp``: the tensor-parallel, pipeline and expert payloads carry the
    rank's own tokens). Unchanged without a context axis."""
    if layout.context_axis is None:
        return layout, options
    local = local_seq_len(options.seq_len, mesh.size(layout.context_axis))
    return context_data_axes(layout, mesh), replace(options, seq_len=local)


def context_collectives(
    profile: ActivationProfile,
    options: PlanOptions,
    *,
    axis: str,
    cp: int,
    checkpointed: Sequence[str],
    blocks: Sequence[str] | None = None,
) -> tuple[Collective, ...]:
    """A plan's context-axis collectives per step: every traced attention call (of ``blocks``
    when given: a pipeline rank's) once per micro-batch, those of ``checkpointed`` blocks again
    in forward when they are recomputed (the block's forward reruns whole under full and
    selective checkpointing, ring included)."""
    again = options.activation_checkpointing != "none"
    recomputed = [fqn for fqn in checkpointed if blocks is None or fqn in blocks]
    return attention_collectives(
        attention_calls(profile, blocks),
        cp=cp,
        axis=axis,
        method=options.context_method,
        microbatches=options.microbatches,
        recomputed=attention_calls(profile, recomputed) if again else (),
        tp_size=profile.tp_size,
    )


def _saved_beyond_sdpa(block: BlockActivations, cp: int, method: str) -> BlockActivations:
    in_tp = rest = 0
    for call in block.attention:
        if method == "allgather":
            extra = allgather_saved(call, cp)
        else:
            extra = math.prod(call.query) * ACC_BYTES
        in_tp, rest = (in_tp + extra, rest) if call.in_tp else (in_tp, rest + extra)
    if not in_tp and not rest:
        return block
    saved = replace(block.saved, tp=block.saved.tp + in_tp, rest=block.saved.rest + rest)
    return replace(block, saved=saved)


def allgather_saved(call: AttentionCall, cp: int) -> int:
    """What the all-gather's attention of ``call`` saves beyond SDPA (module docstring), global
    bytes before tensor parallelism.

    Example:
        >>> call = AttentionCall((1, 4, 8, 16), (1, 2, 8, 16), (1, 2, 8, 16), 4)
        >>> allgather_saved(call, 2)  # keys, values 2·512·4; probabilities 2·4·8·16·4; mask 8·16
        8320
    """
    batch, heads, seq = call.query[:3]
    whole = cp * seq
    probabilities = 2 * batch * heads * seq * whole * ACC_BYTES
    return cp * kv_elements(call) * ACC_BYTES + probabilities + batch * seq * whole


def score_tile_bytes(
    call: AttentionCall, tp_size: int = 1, tile: tuple[int, int] = (TILE_Q, TILE_K)
) -> int:
    """Three fp32 ``[B, Hq, tq, tk]`` tensors: one tile's scores, probabilities and their
    gradient as meshtrain's kernel computes them (``tile`` clipped to the call's ``S_local``).

    Example:
        >>> score_tile_bytes(AttentionCall((1, 32, 8192, 128), (1, 8, 8192, 128),
        ...                                (1, 8, 8192, 128), 2)) / 2**20
        96.0
    """
    batch, heads, seq = call.query[:3]
    rows, cols = min(tile[0], seq), min(tile[1], call.key[2])
    return 3 * _per_rank(batch * heads * rows * cols, ACC_BYTES, call, tp_size)


def score_block_bytes(call: AttentionCall, tp_size: int = 1) -> int:
    """Three fp32 ``[B, Hq, S_local, S_local]`` tensors: one block's scores, probabilities and
    their gradient computed whole (the kernel before it was tiled; benchmarks compare with it).

    Example:
        >>> score_block_bytes(AttentionCall((1, 32, 8192, 128), (1, 8, 8192, 128),
        ...                                 (1, 8, 8192, 128), 2)) / 2**30
        24.0
    """
    batch, heads, seq = call.query[:3]
    return 3 * _per_rank(batch * heads * seq * seq, ACC_BYTES, call, tp_size)


def ring_in_flight(profile: ActivationProfile, cp: int, method: str, *, scores: bool = True) -> int:
    """Bytes one layer's ring holds beside the saved activations at its backward's peak (module
    docstring), for its largest call; with ``scores`` (meshtrain's kernel) three fp32
    ``[B, Hq, tq, tk]`` tensors of one tile more. 0 for one rank or the all-gather."""
    if cp <= 1 or method != "ring":
        return 0
    tp = profile.tp_size

    def held(call: AttentionCall) -> int:
        kv = 2 * kv_bytes(call, tp) + 3 * _per_rank(kv_elements(call), ACC_BYTES, call, tp)
        grad_q = 2 * _per_rank(math.prod(call.query), ACC_BYTES, call, tp)  # total, this block's
        return kv + grad_q + (score_tile_bytes(call, tp) if scores else 0)

    return max((held(call) for call in attention_calls(profile)), default=0)


__all__ = [
    "ACC_BYTES",
    "INDEX_BYTES",
    "allgather_saved",
    "attention_calls",
    "attention_collectives",
    "context_collectives",
    "context_costing",
    "context_data_axes",
    "context_profile",
    "kv_bytes",
    "kv_elements",
    "local_seq_len",
    "metadata_bytes",
    "ring_in_flight",
    "score_block_bytes",
    "score_tile_bytes",
]
