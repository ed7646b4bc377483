"""Sizing without hardware: the memory model against the textbook, ring formulas, ``meshtrain plan``."""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import meshtrain as mt
from meshtrain import PlanError
from meshtrain.cli import main
from meshtrain.models import LlamaConfig, build_llama, default_rules
from meshtrain.plan.memory.footprint import footprint, ring_bytes, textbook_bytes
from meshtrain.plan.memory.sizes import parse_bytes
from meshtrain.recipes import load_recipe
from meshtrain.recipes.sizing import size_recipe

# Llama 2 7B's shapes (6.74e9 parameters): every dim divides by 8, so FSDP pads nothing.
LLAMA_7B = LlamaConfig(
    dim=4096,
    n_layers=32,
    n_heads=32,
    n_kv_heads=32,
    vocab_size=32000,
    multiple_of=256,
    ffn_dim_multiplier=None,
    max_seq_len=4096,
)


def test_textbook_figures() -> None:
    seven_b = 7 * 10**9
    assert textbook_bytes(seven_b, 0, 8) == 112e9  # 16Φ
    assert textbook_bytes(seven_b, 1, 8) == (4 + 12 / 8) * seven_b
    assert textbook_bytes(seven_b, 2, 8) == (2 + 14 / 8) * seven_b
    assert textbook_bytes(seven_b, 3, 8) == 14e9  # 16Φ/N


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_planner_against_the_textbook_mixed_precision_adam(zero: int) -> None:
    # bf16 compute, fp32 master weights, AdamW, 8 data-parallel ranks. At rest FSDP2 keeps fp32
    # master weights, fp32 gradients and two fp32 states: 16 bytes per parameter like the
    # textbook (whose 2 + 2 + 12 are bf16 weights, bf16 gradients, fp32 master + 2 states), all
    # sharded under every ZeRO stage ≥ 1 (FSDP2 reshards after backward and reduce-scatters
    # gradients into shards). The bf16 weights the textbook keeps whole under ZeRO-1/2 are
    # FSDP2's gathered compute copies: transient, all units under ZeRO-1/2, the running and the
    # prefetched block (+ root) under ZeRO-3.
    model = build_llama(LLAMA_7B, device="meta")
    phi = LLAMA_7B.num_params()
    plan = mt.plan(
        model,
        mt.make_mesh(dp=8, tp=1, world_size=8, abstract=True),
        default_rules(),
        zero=zero,
        precision="bf16",
    )
    m = plan.memory
    held = m.params + m.grads + m.optimizer_states
    assert held == (16 * phi if zero == 0 else 16 * phi // 8)
    if zero in (0, 3):
        assert held == textbook_bytes(phi, zero, 8)
    else:  # the textbook keeps bf16 weights (and, under ZeRO-1, gradients) whole at rest
        assert held < textbook_bytes(phi, zero, 8)
        assert m.gathered_params == 2 * phi  # the bf16 weights, during a step
    block = sum(math.prod(p.shape) for p in plan.params if p.fqn.startswith("layers.0."))
    root = phi - LLAMA_7B.n_layers * block
    assert (
        m.gathered_params == {0: 2 * phi, 1: 2 * phi, 2: 2 * phi, 3: 2 * (root + 2 * block)}[zero]
    )
    assert m.unsharded_grads == (0 if zero == 0 else 4 * root)  # the largest unit, fp32


def test_seven_b_on_eight_ranks_112_gb_unsharded_14_gb_under_zero3() -> None:
    phi = LLAMA_7B.num_params()
    model = build_llama(LLAMA_7B, device="meta")
    mesh = mt.make_mesh(dp=8, tp=1, world_size=8, abstract=True)
    held = {
        zero: (lambda m: m.params + m.grads + m.optimizer_states)(
            mt.plan(model, mesh, default_rules(), zero=zero, precision="bf16").memory
        )
        for zero in (0, 3)
    }
    assert held[0] / phi == 16 and held[3] / phi == 2  # 112 GB and 14 GB at Φ = 7e9
    assert round(held[0] / 1e9, 1) == 107.8 and round(held[3] / 1e9, 2) == 13.48


@pytest.mark.parametrize(("optimizer", "per_param"), [("sgd", 6), ("adamw", 8)])
def test_seventy_b_in_bf16_without_sharding(optimizer: str, per_param: int) -> None:
    # A model held in bf16 (no fp32 master): weights, gradients and optimizer states all bf16.
    # With one state (SGD momentum) that is the often-quoted ~420 GB; AdamW keeps two (8Φ).
    config = LlamaConfig.llama3_70b()
    model = build_llama(config, device="meta").to(torch.bfloat16)
    plan = mt.plan(
        model,
        mt.make_mesh(dp=1, tp=1, world_size=1, abstract=True),
        default_rules(),
        optimizer=optimizer,
    )
    m = plan.memory
    assert m.params + m.grads + m.optimizer_states == per_param * config.num_params()
    if optimizer == "sgd":
        assert 415e9 < per_param * config.num_params() < 430e9


@settings(max_examples=40, deadline=None)
@given(
    kind=st.sampled_from(["all_reduce", "all_gather", "reduce_scatter"]),
    payload=st.integers(0, 10**12),
    n=st.integers(1, 16384),
)
def test_ring_formulas(kind: str, payload: int, n: int) -> None:
    sent = ring_bytes(kind, payload, n)
    factor = 2 if kind == "all_reduce" else 1
    assert sent == round(factor * (n - 1) / n * payload)
    assert sent <= factor * payload and (n > 1 or sent == 0)


def test_parse_bytes() -> None:
    assert parse_bytes("80GiB") == 80 * 2**30
    assert parse_bytes("1.5 TB") == 1_500_000_000_000
    assert parse_bytes(1024) == 1024
    for bad in ("eighty", "-1GiB", "80XB", "0"):
        with pytest.raises(PlanError, match="is not a size"):
            parse_bytes(bad)


def test_footprint_sums_traffic_per_axis_with_ring_bytes() -> None:
    model = build_llama(LlamaConfig.debug(), device="meta")
    mesh = mt.make_mesh(dp=4, tp=2, world_size=8, abstract=True)
    plan = mt.plan(model, mesh, default_rules(), zero=3, batch_size=2, seq_len=16)
    report = footprint(plan, 2**30)
    assert report.fits
    for traffic in report.traffic:
        same = [c for c in plan.collectives if (c.axis, c.kind) == (traffic.axis, traffic.kind)]
        assert traffic.count == sum(c.count for c in same)
        assert traffic.payload_bytes == sum(c.bytes for c in same)
        assert traffic.sent_bytes == ring_bytes(
            traffic.kind, traffic.payload_bytes, plan.mesh.size(traffic.axis)
        )
    assert report.sent_bytes() == sum(t.sent_bytes for t in report.traffic) > 0
    assert set(report.activations_by_mode) == {"none", "full", "selective"}
    assert report.total_with(report.checkpointing) == report.memory.total
    assert not footprint(plan, report.memory.total - 1).fits


@pytest.mark.parametrize("recipe", ["llama3_8b", "llama3_70b", "llama3_405b"])
@pytest.mark.parametrize("world", [1024, 16384])
def test_big_recipes_plan_on_fake_worlds(recipe: str, world: int) -> None:
    sizing = size_recipe(load_recipe(recipe), world=world, device_memory="80GiB")
    report = sizing.footprint
    assert sizing.plan.mesh.world_size == world
    assert report.memory.params > 0 and report.memory.activations > 0
    axes = {t.axis for t in report.traffic}
    assert {"dp", "tp"} <= axes and (("pp" in axes) == (sizing.plan.pipeline is not None))
    assert set(report.activations_by_mode) == {"none", "full", "selective"}
    assert report.activations_by_mode["full"] < report.activations_by_mode["none"]
    assert report.total_with(report.checkpointing) == report.memory.total  # pipelines too
    # the batch rule: whole sequences per micro-batch per data-parallel rank
    dp, micro = sizing.plan.mesh.size("dp"), sizing.plan.options.microbatches
    assert sizing.global_batch == dp * micro * (sizing.plan.options.batch_size or 0)
    json.dumps(sizing.to_json())


def test_batch_rule_rounds_up_and_says_so() -> None:
    sizing = size_recipe(load_recipe("llama3_405b"), world=16384)
    # 16,384 = pp 8 × dp 256 × tp 8; 512 sequences do not split into 256 × 16 micro-batches
    assert sizing.global_batch == 4096 and "rounded up to 4096" in sizing.batch_note
    assert sizing.footprint.fits is None  # no device memory given
    kept = size_recipe(load_recipe("llama3_405b"), world=1024)
    assert kept.global_batch == 512 and kept.batch_note == ""


def test_cli_plan_json_and_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(["plan", "llama3_405b", "--world", "16384", "--device-memory", "80GiB", "--json"]) == 0
    )
    data = json.loads(capsys.readouterr().out)
    assert data["fits"] is True and data["mesh"] == {"pp": 8, "dp": 256, "tp": 8}
    assert data["memory"]["total"] <= 80 * 2**30 < data["memory"]["total"] * 4
    assert 0 < data["bubble_fraction"] < 0.25
    assert main(["plan", "debug", "--world", "8"]) == 0
    table = capsys.readouterr().out
    for line in (
        "memory per rank",
        "optimizer states",
        "by checkpointing mode",
        "communication per step",
        "all_gather",
    ):
        assert line in table


def test_cli_plan_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    # the 8B recipe's global batch of 256 on 64 ranks without accumulation: too big for 80 GiB
    assert main(["plan", "llama3_8b", "--world", "64", "--device-memory", "80GiB"]) == 3
    assert "does NOT fit" in capsys.readouterr().out
    assert main(["plan", "llama3_405b", "--world", "8"]) == 2
    err = capsys.readouterr().err
    assert "smallest world this mesh takes is 64" in err and "--strategy auto" in err
