"""Tensor parallelism on transformers' MoE families (tiny, built locally) trains like one
device: the plan-time abstract run emulates their experts modules (grouped_mm and data-dependent
routing cannot run on fake tensors), so Qwen3-MoE's per-head q/k norms are found as partial
gradients and all-reduced over tp; with experts over ep beside tp, too."""

from __future__ import annotations

import math

import pytest
from moe_models import meshtrain_moe, mixtral, qwen2_moe, qwen3_moe, token_batches

import meshtrain as mt
from meshtrain.models.moe import default_rules as moe_rules
from meshtrain.testing import assert_equivalent

pytestmark = pytest.mark.spmd


def _abstract(**axes: int) -> mt.Mesh:
    return mt.make_mesh(**axes, world_size=math.prod(axes.values()), abstract=True)


@pytest.mark.parametrize("factory", [qwen3_moe, qwen2_moe, mixtral], ids=lambda f: f.__name__)
def test_hf_moe_trains_like_one_device_on_dp2_tp2(factory) -> None:  # type: ignore[no-untyped-def]
    """Rules.from_hf with tp: attention and dense MLPs sharded, the experts whole; the plan is
    proven (no 'not proven' note) and Qwen3-MoE's q/k norms are reduced over tp."""
    rules = mt.Rules.from_hf(factory(), fsdp="dp", tp="tp")
    plan = mt.plan(factory(), _abstract(dp=2, tp=2), rules)
    assert not [note for note in plan.notes if "not proven" in note]
    norms = {grad.param for grad in plan.partial_grads}
    if factory is qwen3_moe:
        assert norms == {
            f"model.layers.{i}.self_attn.{n}_norm.weight" for i in range(2) for n in "qk"
        }
    report = assert_equivalent(
        factory,
        {"dp": 2, "tp": 2},
        {"rules": rules},
        batches=token_batches,
        steps=2,
        optimizer="adamw",
    )
    assert report.passed


def test_qwen3_moe_trains_like_one_device_on_ep2_tp2() -> None:
    """Experts over ep (4 of 8 per rank, tokens dispatched by all-to-all between the ranks of
    one tp index), attention tensor-parallel over tp with the q/k norms reduced over it."""
    rules = mt.Rules.from_hf(qwen3_moe(), fsdp=(), tp="tp", ep="ep")
    plan = mt.plan(qwen3_moe(), _abstract(ep=2, tp=2), rules)
    assert plan.expert_axis == "ep" and len(plan.partial_grads) == 4
    report = assert_equivalent(
        qwen3_moe,
        {"ep": 2, "tp": 2},
        {"rules": rules},
        batches=token_batches,
        steps=2,
        optimizer="adamw",
    )
    assert report.passed


def test_meshtrain_moe_trains_like_one_device_on_ep2_tp2() -> None:
    """meshtrain's own MoE (grouped experts, a shared expert, a dense first layer): its
    attention, dense MLP and shared expert over tp, its routed experts over ep."""
    rules = moe_rules(tp="tp", fsdp=(), ep="ep")
    plan = mt.plan(meshtrain_moe(), _abstract(ep=2, tp=2), rules)
    assert plan.expert_axis == "ep" and not [note for note in plan.notes if "not proven" in note]
    report = assert_equivalent(
        meshtrain_moe,
        {"ep": 2, "tp": 2},
        {"rules": rules},
        batches=token_batches,
        steps=2,
        optimizer="adamw",
    )
    assert report.passed
