"""Tensor parallelism inside the experts trains like one device: each rank holds a part of
every expert's intermediate features (``gate_up_proj`` packed column-wise, each half alike;
``down_proj`` row-wise), the experts' partial outputs are all-reduced over tp — alone, beside
expert parallelism (weights split over ep and tp together) and under sequence parallelism; for
transformers' MoE families from their own ``moe_tp_experts`` plans and meshtrain's MoE."""

from __future__ import annotations

import math

import pytest
from moe_models import meshtrain_moe, mixtral, qwen2_moe, qwen3_moe, token_batches

import meshtrain as mt
from meshtrain.models.moe import default_rules as moe_rules
from meshtrain.plan.ir import TPStyle
from meshtrain.testing import assert_equivalent

pytestmark = pytest.mark.spmd


def _abstract(**axes: int) -> mt.Mesh:
    return mt.make_mesh(**axes, world_size=math.prod(axes.values()), abstract=True)


def _inside(plan: mt.Plan) -> list[str]:
    return [s.fqn for s in plan.styles if s.style == TPStyle.EXPERTS_TENSOR_PARALLEL]


def _check(factory, mesh: dict[str, int], rules: mt.Rules) -> None:  # type: ignore[no-untyped-def]
    report = assert_equivalent(
        factory, mesh, {"rules": rules}, batches=token_batches, steps=2, optimizer="adamw"
    )
    assert report.passed
    print(f"worst {max(c.ratio for c in report.comparisons):.3f} of the bound")


@pytest.mark.parametrize("factory", [qwen3_moe, qwen2_moe, mixtral], ids=lambda f: f.__name__)
def test_hf_experts_split_inside_on_dp2_tp2(factory) -> None:  # type: ignore[no-untyped-def]
    """Rules.from_hf(tp=...) reads moe_tp_experts: every experts module split inside."""
    rules = mt.Rules.from_hf(factory(), fsdp="dp", tp="tp")
    plan = mt.plan(factory(), _abstract(dp=2, tp=2), rules)
    assert _inside(plan) == [f"model.layers.{i}.mlp.experts" for i in range(2)]
    layout = {p.fqn: p for p in plan.params}["model.layers.0.mlp.experts.gate_up_proj"]
    assert layout.local_shape[1] * 2 == layout.shape[1]
    _check(factory, {"dp": 2, "tp": 2}, rules)


def test_qwen3_moe_experts_split_over_ep2_and_inside_over_tp2() -> None:
    """Experts over ep (4 of 8 per rank) and inside over tp: the weights on the two axes
    together, the rows each rank received computed in parts and all-reduced over tp."""
    rules = mt.Rules.from_hf(qwen3_moe(), fsdp=(), tp="tp", ep="ep")
    plan = mt.plan(qwen3_moe(), _abstract(ep=2, tp=2), rules)
    assert [g.tensor_axis for g in plan.experts] == ["tp", "tp"]
    _check(qwen3_moe, {"ep": 2, "tp": 2}, rules)


def test_meshtrain_moe_experts_split_inside_with_sequence_parallelism() -> None:
    """meshtrain's MoE with expert_tp=True under sequence parallelism: the MoE blocks run on
    the whole sequence, their experts split inside over tp."""
    rules = moe_rules(tp="tp", fsdp=(), ep="ep", sequence_parallel=True, expert_tp=True)
    plan = mt.plan(meshtrain_moe(), _abstract(ep=2, tp=2), rules)
    assert _inside(plan) == ["layers.1.feed_forward.experts", "layers.2.feed_forward.experts"]
    _check(meshtrain_moe, {"ep": 2, "tp": 2}, rules)


def test_meshtrain_moe_experts_split_inside_on_dp2_tp2() -> None:
    rules = moe_rules(tp="tp", fsdp="dp", expert_tp=True)
    _check(meshtrain_moe, {"dp": 2, "tp": 2}, rules)


@pytest.mark.extended
def test_mixtral_experts_split_inside_over_ep2_tp2_in_bf16_with_checkpointing() -> None:
    """bf16 (FSDP's mixed precision has no data axis here: the plan casts over its size-1
    axes) with full activation checkpointing: the recomputed dispatch all-reduces over tp
    again."""
    rules = mt.Rules.from_hf(mixtral(), fsdp="dp", tp="tp", ep="ep")
    report = assert_equivalent(
        mixtral,
        {"dp": 1, "ep": 2, "tp": 2},
        {"rules": rules, "precision": "bf16", "activation_checkpointing": "full"},
        batches=token_batches,
        steps=2,
        optimizer="adamw",
    )
    assert report.passed
    print(f"worst {max(c.ratio for c in report.comparisons):.3f} of the bound")


def test_mixtral_experts_split_inside_in_a_pipeline_on_pp2_tp2() -> None:
    """1F1B over pp 2, each stage's experts split inside over tp."""
    rules = mt.Rules.from_hf(mixtral(), fsdp=(), tp="tp")
    pipeline = mt.Pipeline("pp", "1F1B", microbatches=2)
    plan = mt.plan(mixtral(), _abstract(pp=2, tp=2), rules, pipeline=pipeline)
    assert _inside(plan) == [f"model.layers.{i}.mlp.experts" for i in range(2)]
    report = assert_equivalent(
        mixtral,
        {"pp": 2, "tp": 2},
        {"rules": rules, "pipeline": pipeline},
        batches=token_batches,
        steps=2,
        optimizer="adamw",
    )
    assert report.passed
    print(f"worst {max(c.ratio for c in report.comparisons):.3f} of the bound")
