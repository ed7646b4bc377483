"""Expert parallelism's memory and all-to-all costs against figures worked out by hand."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import meshtrain as mt
from meshtrain.errors import PlanError
from meshtrain.plan.experts.cost import (
    ExpertLayer,
    all_to_all_collectives,
    expert_memory,
    rows_per_rank,
)
from meshtrain.plan.memory.footprint import ring_bytes

V3 = ExpertLayer.swiglu("layers.3.mlp.experts", num_experts=256, top_k=8, hidden=7168, inter=2048)
TINY = ExpertLayer.swiglu("layers.0.mlp.experts", num_experts=8, top_k=2, hidden=32, inter=16)


def test_rows_uniform_and_dropless_worst_case_by_hand() -> None:
    # 4096 tokens × top-8: 32,768 rows dispatched, whatever ep
    assert rows_per_rank(V3, tokens=4096, ep=64) == 32_768
    # ep 64: 4 experts per rank, so a token sends at most 4 of its 8 rows to one rank; all 64
    # ranks doing so to one rank: 64 × 4096 × 4 rows arrive there
    assert rows_per_rank(V3, tokens=4096, ep=64, routing="worst") == 64 * 4096 * 4
    # ep 8: 32 experts per rank ≥ top-8: all 8 rows of every token can land on one rank
    assert rows_per_rank(V3, tokens=4096, ep=8, routing="worst") == 8 * 4096 * 8
    # a stated max-load factor caps the busiest rank at f × the mean
    assert rows_per_rank(V3, tokens=4096, ep=64, routing="worst", max_load=1.5) == 49_152
    # ... never above the dropless bound
    assert rows_per_rank(TINY, tokens=10, ep=2, routing="worst", max_load=100.0) == 2 * 10 * 2


def test_all_to_all_bytes_per_step_by_hand() -> None:
    # 2 layers, 3 micro-batches of 16 tokens, bf16 rows of 32: one token all-to-all moves
    # 16 × 2 × 32 × 2 = 2,048 B; forward 2 per layer per micro-batch, backward the same; the
    # routing data: one int64 count per expert (TINY's 8) = 64 B per layer and micro-batch
    rows = all_to_all_collectives(
        [TINY, TINY], axis="ep", ep=4, tokens=16, microbatches=3, activation_bytes=2
    )
    assert [(c.kind, c.axis, c.count, c.bytes) for c in rows] == [
        ("all_to_all", "ep", 12, 12 * 2048),
        ("all_to_all", "ep", 6, 6 * 64),
        ("all_to_all", "ep", 12, 12 * 2048),
    ]
    # one layer in a checkpointed block repeats its forward three in backward
    recomputed = all_to_all_collectives(
        [TINY, TINY], axis="ep", ep=4, tokens=16, microbatches=3, activation_bytes=2, recomputed=1
    )
    assert (recomputed[-1].count, recomputed[-1].bytes) == (9, 3 * (2 * 2048 + 64))
    # each rank sends 3/4 of a uniform payload to the other ranks
    assert ring_bytes("all_to_all", 2048, 4) == 1536
    assert all_to_all_collectives([TINY], axis="ep", ep=1, tokens=16) == ()


def test_expert_memory_by_hand() -> None:
    # DeepSeek-V3's 58 MoE layers on ep 64 × efsdp 4, ZeRO-3, fp32 master, AdamW, bf16 compute
    layers = [V3] * 58
    memory = expert_memory(
        layers, ep=64, efsdp=4, zero=3, optimizer_states=2, param_bytes=2, shard_dim=0
    )
    per_rank = 58 * 256 * 3 * 2048 * 7168 // (64 * 4)  # 4 local experts split 4 ways: even
    assert memory.params == memory.grads == per_rank * 4
    assert memory.optimizer_states == per_rank * 8
    assert memory.gathered_params == 2 * 4 * 3 * 2048 * 7168 * 2  # two layers' 4 experts in bf16
    # efsdp 8 on dim 0 of 4 local experts pads to one expert per rank: no saving over efsdp 4
    padded = expert_memory(layers, ep=64, efsdp=8, zero=3, optimizer_states=2, param_bytes=2)
    assert padded.params == memory.params
    split = expert_memory(
        layers, ep=64, efsdp=8, zero=3, optimizer_states=2, param_bytes=2, shard_dim=1
    )
    assert split.params == memory.params // 2
    # ZeRO 0 keeps every local expert whole
    whole = expert_memory(layers, ep=64, efsdp=4, zero=0, optimizer_states=2, param_bytes=4)
    assert whole.params == per_rank * 4 * 4 and whole.gathered_params == 0


def test_experts_that_do_not_split_name_the_module() -> None:
    with pytest.raises(PlanError, match=r"'layers\.0\.mlp\.experts' has 8 experts.*ep size"):
        rows_per_rank(TINY, tokens=4, ep=3, routing="worst")
    with pytest.raises(PlanError, match="max_load"):
        rows_per_rank(TINY, tokens=4, ep=2, routing="worst", max_load=0.5)


@settings(max_examples=60, deadline=None)
@given(
    experts=st.sampled_from([8, 16, 64, 256]),
    top_k=st.integers(1, 8),
    ep_log=st.integers(0, 6),
    tokens=st.integers(1, 4096),
)
def test_worst_case_bounds_uniform_and_conserves_rows(
    experts: int, top_k: int, ep_log: int, tokens: int
) -> None:
    ep = 2**ep_log
    if experts % ep or top_k > experts:
        return
    layer = ExpertLayer.swiglu("e", num_experts=experts, top_k=top_k, hidden=4, inter=2)
    uniform = rows_per_rank(layer, tokens=tokens, ep=ep)
    worst = rows_per_rank(layer, tokens=tokens, ep=ep, routing="worst")
    assert uniform == tokens * top_k <= worst
    # no rank can receive more rows than the whole axis dispatches
    assert worst <= ep * tokens * top_k
    # memory: every expert weight is on exactly one ep rank (efsdp 1, ZeRO 3)
    memory = expert_memory([layer], ep=ep, efsdp=1, zero=3, optimizer_states=0, param_bytes=4)
    assert memory.params * ep == layer.numel * 4 == math.prod((experts, 3 * 2 * 4)) * 4


def test_auto_chooses_expert_parallelism_when_only_it_fits() -> None:
    from meshtrain.models.moe import MoEConfig, build_moe, default_rules
    from meshtrain.plan.auto.experts import expert_degrees

    config = MoEConfig.debug(n_experts=64, moe_inter=256, n_layers=1, first_dense_layers=0)
    model = build_moe(config, device="meta")
    assert expert_degrees(model, 2) == (2,) and expert_degrees(model, 12) == (2, 4)
    mesh = mt.make_mesh(dp=2, world_size=2, abstract=True)
    rules = default_rules(tp="tp", fsdp="dp", ep="ep")
    # 40 MiB: no dense plan fits (the layer's 64 experts gathered whole), ep 2 does (37.4 MiB)
    plan = mt.plan(
        model, mesh, rules, global_batch=4, seq_len=32, strategy="auto", device_memory=40 * 2**20
    )
    assert plan.mesh.shape == {"pp": 1, "dp": 1, "ep": 2, "tp": 1} and plan.expert_axis == "ep"
    assert plan.memory.total <= 40 * 2**20 and "ep 2" in plan.notes[0]
