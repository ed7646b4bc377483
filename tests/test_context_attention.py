"""Context-parallel attention without ranks: the sequence layout, the visibility mask against
``transformers``' mask functions, and the block-by-block merge (forward and backward) against one
SDPA call on the whole sequence, within the contract of ``tests/context_reference.py``."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from context_reference import (
    U_BF16,
    magnitudes,
    reference_attention,
    reference_mask,
    tolerance,
)
from hypothesis import given
from hypothesis import strategies as st

import meshtrain.lower.context.attention_blocks as attention_blocks
from meshtrain.errors import PlanError
from meshtrain.lower.context.attention_blocks import (
    KVBlock,
    Tile,
    Visibility,
    blockwise_attention,
    merge,
    visible,
)
from meshtrain.lower.context.layout import chunk_positions, shard_sequence, unshard_sequence
from meshtrain.lower.context.ring_attention import context_attention

# ------------------------------------------------------------------------------------ layout


@given(
    chunk=st.integers(1, 5),
    cp=st.integers(1, 8),
    balance=st.sampled_from(["headtail", "contiguous"]),
    dim=st.integers(0, 2),
)
def test_every_position_is_on_exactly_one_rank_and_unsharding_inverts(
    chunk: int, cp: int, balance: str, dim: int
) -> None:
    seq_len = 2 * cp * chunk
    shape = [2, 3, 2]
    shape[dim] = seq_len
    x = torch.randn(shape)
    positions = [chunk_positions(seq_len, cp, r, balance) for r in range(cp)]  # type: ignore[arg-type]
    assert torch.equal(torch.sort(torch.cat(positions)).values, torch.arange(seq_len))
    shards = [shard_sequence(x, dim, cp, r, balance) for r in range(cp)]  # type: ignore[arg-type]
    for pos, shard in zip(positions, shards, strict=True):
        assert torch.equal(shard, x.index_select(dim, pos))
    assert torch.equal(unshard_sequence(shards, dim, cp, balance), x)  # type: ignore[arg-type]
    gathered = torch.cat(shards, dim)
    assert torch.equal(unshard_sequence(gathered, dim, cp, balance), x)  # type: ignore[arg-type]


@pytest.mark.parametrize("cp", [1, 2, 3, 4, 8])
def test_headtail_gives_rank_r_chunks_r_and_its_mirror_and_equal_causal_work(cp: int) -> None:
    chunk = 3
    seq_len = 2 * cp * chunk
    work = set()
    for r in range(cp):
        pos = chunk_positions(seq_len, cp, r, "headtail").tolist()
        mirror = 2 * cp - 1 - r
        expected = list(range(r * chunk, (r + 1) * chunk))
        assert pos == expected + list(range(mirror * chunk, (mirror + 1) * chunk))
        work.add(sum(p + 1 for p in pos))  # keys a causal query at p sees
    assert len(work) == 1


def test_contiguous_positions() -> None:
    assert chunk_positions(8, 4, 2, "contiguous").tolist() == [4, 5]


@pytest.mark.parametrize(
    "seq_len, cp, balance, multiple",
    [(10, 2, "headtail", 4), (12, 4, "headtail", 8), (10, 4, "contiguous", 4)],
)
def test_an_uneven_split_names_the_length_the_degree_and_the_multiple(
    seq_len: int, cp: int, balance: str, multiple: int
) -> None:
    with pytest.raises(PlanError, match=rf"{seq_len}.*cp={cp}.*multiple of {multiple}"):
        chunk_positions(seq_len, cp, 0, balance)  # type: ignore[arg-type]


def test_bad_rank_and_balance_are_refused() -> None:
    with pytest.raises(PlanError, match=r"rank 2 is outside 0\.\.1"):
        chunk_positions(8, 2, 2)
    with pytest.raises(PlanError, match=r"'zigzag'.*headtail"):
        chunk_positions(8, 2, 0, "zigzag")  # type: ignore[arg-type]
    with pytest.raises(PlanError, match="2 chunks for cp=3"):
        unshard_sequence([torch.zeros(2), torch.zeros(2)], 0, 3)


# ------------------------------------------------------------------------------------- masks


@given(
    seq=st.integers(1, 24),
    causal=st.booleans(),
    window=st.none() | st.integers(1, 30),
    documents=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_visibility_equals_transformers_masks(
    seq: int, causal: bool, window: int | None, documents: bool, seed: int
) -> None:
    window = window if causal else None
    gen = torch.Generator().manual_seed(seed)
    qpos, kpos = torch.randperm(seq, generator=gen), torch.randperm(seq, generator=gen)
    docs = torch.randint(0, 3, (2, seq), generator=gen).sort().values if documents else None
    dq = None if docs is None else docs[:, qpos]
    dk = None if docs is None else docs[:, kpos]
    ours = visible(qpos, kpos, Visibility(causal, window), dq, dk).expand(2, seq, seq)
    assert torch.equal(ours, reference_mask(qpos, kpos, 2, causal, window, dq, dk)[:, 0])


def test_window_is_mistral_convention() -> None:
    """A query at p sees p - window < s <= p: window 1 is the token itself."""
    pos = torch.arange(4)
    assert torch.equal(visible(pos, pos, Visibility(True, 1))[0], torch.eye(4, dtype=torch.bool))


# ------------------------------------------------------------------------------------- merge


@st.composite
def problems(draw: st.DrawFn) -> dict:
    heads_kv, group = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    seq = draw(st.integers(1, 20))
    causal = draw(st.booleans())
    return {
        "batch": draw(st.integers(1, 2)),
        "heads": (heads_kv * group, heads_kv),
        "dim": draw(st.sampled_from([4, 8])),
        "seq": seq,
        "queries": draw(st.integers(1, seq)),  # the first: every query its own key; else a subset
        "all_queries": draw(st.booleans()),
        "blocks": draw(st.integers(1, 4)),
        "causal": causal,
        "window": draw(st.none() | st.integers(1, seq + 2)) if causal else None,
        "documents": draw(st.booleans()),
        "logit_scale": draw(st.sampled_from([1.0, 40.0])),
        "dtype": draw(st.sampled_from([torch.float32, torch.bfloat16])),
        "seed": draw(st.integers(0, 2**16)),
    }


def _check_within_contract(
    ours: dict[str, torch.Tensor],
    ref: dict[str, torch.Tensor],
    tol: dict[str, torch.Tensor],
    bf16: bool,
) -> None:
    for name, value in ours.items():
        bound = tol[name] * (1 + U_BF16) + U_BF16 * ref[name].abs() if bf16 else tol[name]
        error = (value.double() - ref[name]).abs()
        worst = (error - bound).flatten().argmax()
        assert bool((error <= bound).all()), (
            f"{name}: error {error.flatten()[worst].item():.3g} > bound "
            f"{bound.flatten()[worst].item():.3g}"
        )


@given(problems())
def test_blockwise_attention_equals_one_sdpa_forward_and_backward(case: dict) -> None:
    gen = torch.Generator().manual_seed(case["seed"])
    b, (hq, hkv), d, seq = case["batch"], case["heads"], case["dim"], case["seq"]
    qpos = torch.arange(seq) if case["all_queries"] else torch.randperm(seq, generator=gen)
    qpos = qpos[: seq if case["all_queries"] else case["queries"]]
    kpos = torch.randperm(seq, generator=gen)
    docs = torch.randint(0, 3, (b, seq), generator=gen).sort().values if case["documents"] else None
    dq = None if docs is None else docs[:, qpos]
    dk = None if docs is None else docs[:, kpos]
    q = (torch.randn(b, hq, len(qpos), d, generator=gen) * case["logit_scale"]).to(case["dtype"])
    k, v = (torch.randn(b, hkv, seq, d, generator=gen).to(case["dtype"]) for _ in range(2))
    grad = torch.randn(b, hq, len(qpos), d, generator=gen).to(case["dtype"])
    q, k, v = (t.requires_grad_() for t in (q, k, v))

    cuts = torch.linspace(0, seq, case["blocks"] + 1).long().tolist()
    pieces = [slice(lo, hi) for lo, hi in itertools.pairwise(cuts) if hi > lo]
    blocks = [
        KVBlock(k[:, :, s], v[:, :, s], kpos[s], None if dk is None else dk[:, s]) for s in pieces
    ]
    out = blockwise_attention(
        q, blocks, positions_q=qpos, documents_q=dq, causal=case["causal"], window=case["window"]
    )
    ours = dict(zip(("dq", "dk", "dv"), torch.autograd.grad(out, (q, k, v), grad), strict=True))
    ours["out"] = out.detach()
    assert out.dtype == case["dtype"]

    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    mask = reference_mask(qpos, kpos, b, case["causal"], case["window"], dq, dk)
    ref_out = reference_attention(q64, k64, v64, mask, None)
    grads = torch.autograd.grad(ref_out, (q64, k64, v64), grad.double())
    ref = dict(zip(("dq", "dk", "dv"), grads, strict=True)) | {"out": ref_out.detach()}
    mags, logit_bound = magnitudes(q, k, v, grad, mask, d**-0.5)
    tol = {n: tolerance(m, seq, d, logit_bound, len(blocks)) for n, m in mags.items()}
    _check_within_contract(ours, ref, tol, case["dtype"] == torch.bfloat16)


@given(problems(), st.integers(1, 6), st.integers(1, 6))
def test_tiled_attention_equals_one_sdpa_with_a_merge_per_key_tile(
    case: dict, rows: int, cols: int
) -> None:
    """Blocks spanning several tiles (fully masked ones skipped, partly masked ones merged):
    the same contract, each key tile of a block one merge more."""
    gen = torch.Generator().manual_seed(case["seed"])
    b, (hq, hkv), d, seq = case["batch"], case["heads"], case["dim"], case["seq"]
    qpos, kpos = torch.arange(seq), torch.randperm(seq, generator=gen)
    docs = torch.randint(0, 3, (b, seq), generator=gen).sort().values if case["documents"] else None
    q = torch.randn(b, hq, seq, d, generator=gen, dtype=torch.float64) * case["logit_scale"]
    k, v, grad = (
        torch.randn(b, n, seq, d, generator=gen, dtype=torch.float64) for n in (hkv, hkv, hq)
    )
    q, k, v = (t.float().requires_grad_() for t in (q, k, v))
    cuts = torch.linspace(0, seq, case["blocks"] + 1).long().tolist()
    pieces = [slice(lo, hi) for lo, hi in itertools.pairwise(cuts) if hi > lo]
    dk = None if docs is None else docs[:, kpos]
    blocks = [
        KVBlock(k[:, :, s], v[:, :, s], kpos[s], None if dk is None else dk[:, s]) for s in pieces
    ]
    out = blockwise_attention(
        q,
        blocks,
        positions_q=qpos,
        documents_q=docs,
        causal=case["causal"],
        window=case["window"],
        tile=Tile(rows, cols),
    )
    ours = dict(
        zip(("dq", "dk", "dv"), torch.autograd.grad(out, (q, k, v), grad.float()), strict=True)
    ) | {"out": out.detach()}
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    mask = reference_mask(qpos, kpos, b, case["causal"], case["window"], docs, dk)
    ref_out = reference_attention(q64, k64, v64, mask, None)
    ref = dict(
        zip(("dq", "dk", "dv"), torch.autograd.grad(ref_out, (q64, k64, v64), grad), strict=True)
    ) | {"out": ref_out.detach()}
    merges = sum(-(-(s.stop - s.start) // cols) for s in pieces)
    mags, logit_bound = magnitudes(q, k, v, grad, mask, d**-0.5)
    tol = {n: tolerance(m, seq, d, logit_bound, merges) for n, m in mags.items()}
    _check_within_contract(ours, ref, tol, bf16=False)


def test_scores_live_one_tile_at_a_time_and_masked_tiles_are_skipped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """S_local = 40 in 16 x 8 tiles, causal: the largest score tensor is [B, Hkv, G, 16, 8], and
    of the 3 x 5 tiles the 4 strictly above the diagonal (keys all after the queries) are never
    computed, forward or backward."""
    shapes: list[tuple[int, ...]] = []
    original = attention_blocks._probabilities

    def recorded(q5: torch.Tensor, *args: object) -> tuple[torch.Tensor, torch.Tensor]:
        p, lse = original(q5, *args)  # type: ignore[arg-type]
        shapes.append(tuple(p.shape))
        return p, lse

    monkeypatch.setattr(attention_blocks, "_probabilities", recorded)
    q = torch.randn(1, 4, 40, 8, requires_grad=True)
    kv = torch.randn(1, 2, 40, 8, requires_grad=True)
    pos = torch.arange(40)
    out = blockwise_attention(q, [KVBlock(kv, kv, pos)], positions_q=pos, tile=Tile(16, 8))
    out.sum().backward()
    assert max(math.prod(s) for s in shapes) == 1 * 2 * 2 * 16 * 8
    assert len(shapes) == 2 * (15 - 4)


def test_a_tile_side_below_one_is_refused() -> None:
    with pytest.raises(PlanError, match=r"attention tile 0 x 512"):
        Tile(0, 512)


def test_rows_that_see_nothing_are_zero_with_zero_gradients() -> None:
    q = torch.randn(1, 1, 2, 4, requires_grad=True)
    k = torch.randn(1, 1, 2, 4, requires_grad=True)
    block = KVBlock(k, k, torch.tensor([5, 6]))
    out = blockwise_attention(q, [block], positions_q=torch.tensor([0, 6]))
    assert torch.equal(out[0, 0, 0], torch.zeros(4))  # position 0 sees no key at 5 or 6
    out.sum().backward()
    assert torch.equal(q.grad[0, 0, 0], torch.zeros(4))  # type: ignore[index]
    assert torch.isfinite(k.grad).all()  # type: ignore[arg-type]


def test_merge_is_exact_for_logits_far_beyond_exp_range() -> None:
    """Logits in the thousands (exp overflows past ~88 in fp32, ~709 in fp64): the max correction
    keeps the merge exact."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 8, 16, generator=gen, dtype=torch.float64) * 3000
    k, v = (torch.randn(1, 2, 8, 16, generator=gen, dtype=torch.float64) for _ in range(2))
    pos = torch.arange(8)
    halves = [KVBlock(k[:, :, s], v[:, :, s], pos[s]) for s in (slice(4, 8), slice(0, 4))]
    out = blockwise_attention(q, halves, positions_q=pos, causal=False)
    ref = reference_attention(q, k, v, torch.ones(1, 1, 8, 8, dtype=torch.bool), None)
    assert torch.allclose(out, ref, rtol=0, atol=1e-12)


def test_merge_of_a_side_that_saw_nothing_keeps_the_other() -> None:
    out, lse = merge(
        torch.ones(1, 2), torch.tensor([-torch.inf]), 3 * torch.ones(1, 2), torch.zeros(1)
    )
    assert out.tolist() == [[3.0, 3.0]] and lse.item() == 0.0
    out, lse = merge(
        torch.zeros(1, 2), torch.tensor([-torch.inf]), torch.zeros(1, 2), torch.tensor([-torch.inf])
    )
    assert out.tolist() == [[0.0, 0.0]] and lse.item() == -torch.inf


# --------------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    "shapes, kwargs, match",
    [
        (((1, 3, 4, 8), (1, 2, 4, 8)), {}, "3 query heads are not a multiple of 2"),
        (((1, 2, 4, 8), (1, 2, 4, 8)), {"positions_q": torch.arange(3)}, r"positions_q \(3,\)"),
        (((1, 2, 4, 8), (1, 2, 4, 8)), {"window": 2, "causal": False}, "window=2 needs causal"),
        (((1, 2, 4, 8), (1, 2, 4, 8)), {"method": "ulysses"}, "'ulysses' is not one of"),
        (((1, 2, 4, 8), (1, 2, 4, 8)), {"documents": torch.zeros(2, 4)}, r"documents \(2, 4\)"),
        (
            ((1, 2, 4, 8), (1, 2, 6, 8)),
            {"documents": torch.zeros(1, 4), "positions_kv": torch.arange(6)},
            "go together",
        ),
    ],
)
def test_context_attention_refuses_what_does_not_fit_before_communicating(
    shapes: tuple, kwargs: dict, match: str
) -> None:
    q, k = torch.zeros(shapes[0]), torch.zeros(shapes[1])
    kwargs = {"positions_q": torch.arange(shapes[0][2])} | kwargs
    with pytest.raises(PlanError, match=match):
        context_attention(q, k, k, group=None, **kwargs)  # type: ignore[arg-type]
