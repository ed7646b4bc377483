"""Context attention on 2 and 4 gloo ranks equals one device's attention on the whole sequence:
every rank computes its head-tail or contiguous share (ring or all-gather), the test gathers the
outputs and the gradients of q, k, v and compares them with one SDPA call in one process (masks by
``transformers``' functions) within the contract of ``tests/context_reference.py``; the bytes each
rank moves equal the table of ``meshtrain/lower/context/ring_attention.py`` and what the c10d ops carry."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch

from meshtrain.lower.context.layout import chunk_positions, shard_sequence, unshard_sequence

pytestmark = pytest.mark.spmd

BATCH, HEADS, HEADS_KV, SEQ, DIM = 2, 4, 2, 16, 8
_GROUPS: dict[tuple[int, ...], Any] = {}  # per rank process: dist.new_group is collective


@dataclass(frozen=True)
class Case:
    world: int
    cp: int
    balance: str = "headtail"
    causal: bool = True
    window: int | None = None
    documents: bool = False
    method: str = "ring"
    dtype: torch.dtype = torch.float32
    logit_scale: float = 1.0
    strided: bool = False  # cp groups {r, r + world/cp, ...} instead of consecutive ranks
    tile: tuple[int, int] | None = None  # the kernel's tile (query rows, key columns)

    @property
    def merges(self) -> int:
        """Tiles merged into a row: every rank's block, in key tiles of the kernel."""
        if self.tile is None:
            return self.cp
        return self.cp * -(-(SEQ // self.cp) // self.tile[1])


def inputs(case: Case) -> dict[str, torch.Tensor]:
    """The whole sequence's q, k, v, output gradient and document ids (the same on every rank)."""
    gen = torch.Generator().manual_seed(1234)
    q = torch.randn(BATCH, HEADS, SEQ, DIM, generator=gen) * case.logit_scale
    k, v = (torch.randn(BATCH, HEADS_KV, SEQ, DIM, generator=gen) for _ in range(2))
    grad = torch.randn(BATCH, HEADS, SEQ, DIM, generator=gen)
    documents = torch.tensor([[0] * 5 + [1] * 6 + [2] * 5, [0] * 9 + [1] * 7])  # across chunks
    out = {"q": q, "k": k, "v": v, "grad": grad}
    return {n: t.to(case.dtype) for n, t in out.items()} | {"documents": documents}


def _members(case: Case, rank: int) -> tuple[int, ...]:
    groups = case.world // case.cp
    if case.strided:
        return tuple(range(rank % groups, case.world, groups))
    start = rank // case.cp * case.cp
    return tuple(range(start, start + case.cp))


def _group(case: Case, rank: int) -> Any:
    import torch.distributed as dist

    if case.cp == case.world:
        return dist.group.WORLD
    every = {_members(case, r) for r in range(case.world)}
    for members in sorted(every):  # every rank creates every group, in one order
        if members not in _GROUPS:
            _GROUPS[members] = dist.new_group(list(members))
    return _GROUPS[_members(case, rank)]


def run_case(case: Case) -> dict[str, Any]:
    """On every rank: this rank's share through context attention, forward and backward, its
    bytes as counted and as the c10d ops carried them."""
    import torch.distributed as dist

    from meshtrain import make_mesh
    from meshtrain.lower.context.attention_blocks import DEFAULT_TILE, Tile
    from meshtrain.lower.context.ring_attention import context_attention, count_bytes
    from meshtrain.testing.comms import CollectiveCounter

    rank = dist.get_rank()
    group = _group(case, rank)
    cp_rank = _members(case, rank).index(rank)
    whole = inputs(case)

    def share(x: torch.Tensor, dim: int = 2) -> torch.Tensor:
        return shard_sequence(x, dim, case.cp, cp_rank, case.balance)  # type: ignore[arg-type]

    q, k, v = (share(whole[n]).requires_grad_() for n in "qkv")
    c10d = CollectiveCounter(make_mesh({"cp": case.world}, abstract=True), {"cp": group})
    saved: list[int] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tensor.numel() * tensor.element_size())
        return tensor

    hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor)
    with count_bytes() as sent, c10d, hooks:
        out = context_attention(
            q,
            k,
            v,
            group=group,
            positions_q=chunk_positions(SEQ, case.cp, cp_rank, case.balance),  # type: ignore[arg-type]
            causal=case.causal,
            window=case.window,
            documents=share(whole["documents"], 1) if case.documents else None,
            method=case.method,  # type: ignore[arg-type]
            tile=DEFAULT_TILE if case.tile is None else Tile(*case.tile),
        )
        out.backward(share(whole["grad"]))
    return {
        "members": _members(case, rank),
        "out": out.detach(),
        "dq": q.grad,
        "dk": k.grad,
        "dv": v.grad,
        "bytes": dict(sent.counts),
        "saved": sum(saved),
        "saved_expected": _flash_saved_bytes(q, k, v),
        "c10d": {kind: n for (kind, _), n in c10d.bytes.items()},
    }


def _flash_saved_bytes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> int:
    """What the ring's backward may keep: q, k, v, the fp32 output and log-sum-exp (this rank's
    share only: O(S_local), never the gathered sequence)."""
    local = sum(t.numel() * t.element_size() for t in (q, k, v))
    return local + q.numel() * 4 + q[..., 0].numel() * 4


def expected_bytes(case: Case) -> dict[str, int]:
    """The module's table: ``E = 2·B·Hkv·S_local·D`` elements of k and v together."""
    local = SEQ // case.cp
    e = 2 * BATCH * HEADS_KV * local * DIM
    item = torch.tensor([], dtype=case.dtype).element_size()
    metadata = case.cp * (1 + (BATCH if case.documents else 0)) * local * 8
    if case.method == "allgather":
        return {
            "metadata": metadata,
            "forward/kv": case.cp * e * item,
            "backward/dkv": case.cp * e * item,
        }
    return {
        "metadata": metadata,
        "forward/kv": (case.cp - 1) * e * item,
        "backward/kv": (case.cp - 1) * e * item,
        "backward/dkv": case.cp * e * 4,
    }


def expected_c10d(case: Case, counted: dict[str, int]) -> dict[str, int]:
    """What the c10d ops carry: each ring send also arrives as a receive of the same size."""
    if case.method == "allgather":
        return {
            "all_gather": counted["metadata"] + counted["forward/kv"],
            "reduce_scatter": counted["backward/dkv"],
        }
    sends = counted["forward/kv"] + counted["backward/kv"] + counted["backward/dkv"]
    return {"all_gather": counted["metadata"], "send/recv": 2 * sends}


CASES = {
    "cp2-headtail-causal-gqa": Case(2, 2),
    "cp2-contiguous-bidirectional": Case(2, 2, "contiguous", causal=False),
    "cp2-headtail-window-documents": Case(2, 2, window=5, documents=True),
    "cp2-allgather-headtail-causal": Case(2, 2, method="allgather"),
    "cp2-headtail-causal-bf16": Case(2, 2, dtype=torch.bfloat16),
    "cp4-headtail-causal-large-logits": Case(4, 4, logit_scale=40.0),
    "cp4-contiguous-window-documents": Case(4, 4, "contiguous", window=3, documents=True),
    "cp4-headtail-bidirectional-documents": Case(4, 4, causal=False, documents=True),
    "cp4-allgather-contiguous-documents": Case(
        4, 4, "contiguous", method="allgather", documents=True
    ),
    "cp2-of-4-ranks-strided-headtail": Case(4, 2, strided=True, window=6),
    "cp2-headtail-window-documents-tiles-3x2": Case(2, 2, window=5, documents=True, tile=(3, 2)),
}


def _reference(case: Case) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One process, the whole sequence: SDPA's output and gradients (fp64) and the contract
    (imported here: the ranks, which import this module, need no ``transformers``)."""
    from context_reference import (
        U_BF16,
        magnitudes,
        reference_attention,
        reference_mask,
        tolerance,
    )

    whole = inputs(case)
    q, k, v = (whole[n].double().requires_grad_() for n in "qkv")
    positions = torch.arange(SEQ)
    docs = whole["documents"] if case.documents else None
    mask = reference_mask(positions, positions, BATCH, case.causal, case.window, docs, docs)
    out = reference_attention(q, k, v, mask, None)
    grads = torch.autograd.grad(out, (q, k, v), whole["grad"].double())
    ref = dict(zip(("dq", "dk", "dv"), grads, strict=True)) | {"out": out.detach()}
    mags, logit_bound = magnitudes(
        whole["q"], whole["k"], whole["v"], whole["grad"], mask, DIM**-0.5
    )
    tol = {n: tolerance(m, SEQ, DIM, logit_bound, case.merges) for n, m in mags.items()}
    if case.dtype == torch.bfloat16:
        tol = {n: t * (1 + U_BF16) + U_BF16 * ref[n].abs() for n, t in tol.items()}
    return ref, tol


@pytest.mark.parametrize("name", list(CASES))
def test_context_attention_equals_one_device_sdpa(name: str) -> None:
    case = CASES[name]
    from meshtrain.testing.runner import get_pool

    results = get_pool(case.world).run(run_case, case)
    ref, tol = _reference(case)
    for members in sorted({r["members"] for r in results}):
        shares = [results[rank] for rank in members]  # in cp-rank order
        for tensor in ("out", "dq", "dk", "dv"):
            ours = unshard_sequence([s[tensor] for s in shares], 2, case.cp, case.balance)  # type: ignore[arg-type]
            assert ours.dtype == case.dtype
            error = (ours.double() - ref[tensor]).abs()
            assert bool((error <= tol[tensor]).all()), (
                f"{name} {tensor} on ranks {members}: max error {error.max().item():.3g}, "
                f"bound there {tol[tensor].flatten()[(error - tol[tensor]).argmax()].item():.3g}"
            )
    for result in results:
        if case.method == "ring":
            assert result["saved"] == result["saved_expected"]
        assert result["bytes"] == expected_bytes(case)
        assert result["c10d"] == expected_c10d(case, result["bytes"])
