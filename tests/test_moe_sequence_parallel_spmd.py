"""Sequence parallelism with mixture-of-experts blocks trains like one device: each MoE
feed-forward (its router, its experts, any shared expert) runs on the whole sequence, its input
all-gathered from sequence shards and its output sliced back (``sequence_gathered``), while
norms and the dense blocks stay on sequence shards; with experts over ep beside tp, too."""

from __future__ import annotations

import math

import pytest
from moe_models import meshtrain_moe, mixtral, qwen2_moe, token_batches

import meshtrain as mt
from meshtrain.models.moe import default_rules as moe_rules
from meshtrain.plan.ir import TPStyle
from meshtrain.testing import assert_equivalent

pytestmark = pytest.mark.spmd


def _abstract(**axes: int) -> mt.Mesh:
    return mt.make_mesh(**axes, world_size=math.prod(axes.values()), abstract=True)


def _whole(plan: mt.Plan) -> list[str]:
    return [s.fqn for s in plan.styles if s.style == TPStyle.SEQUENCE_GATHERED]


def test_meshtrain_moe_with_sequence_parallelism_on_ep2_tp2() -> None:
    """meshtrain's MoE: attention, the dense MLP and the shared expert over tp with the
    activations between them sequence shards, the routed experts over ep."""
    rules = moe_rules(tp="tp", fsdp=(), ep="ep", sequence_parallel=True)
    plan = mt.plan(meshtrain_moe(), _abstract(ep=2, tp=2), rules)
    assert plan.sequence_parallel and plan.expert_axis == "ep"
    assert _whole(plan) == ["layers.1.feed_forward", "layers.2.feed_forward"]
    styles = {s.fqn: s for s in plan.styles}
    # inside the block run whole the shared expert reduces as without sequence parallelism
    assert "reduce-scattered" not in styles["layers.1.feed_forward.shared_expert.w2"].note
    assert "reduce-scattered" in styles["layers.0.feed_forward.w2"].note
    report = assert_equivalent(
        meshtrain_moe,
        {"ep": 2, "tp": 2},
        {"rules": rules},
        batches=token_batches,
        steps=2,
        optimizer="adamw",
    )
    assert report.passed
    print(f"worst {max(c.ratio for c in report.comparisons):.3f} of the bound")


@pytest.mark.parametrize("factory", [qwen2_moe, mixtral], ids=lambda f: f.__name__)
def test_hf_moe_with_sequence_parallelism_on_dp2_tp2(factory) -> None:  # type: ignore[no-untyped-def]
    """transformers' Qwen2-MoE (a gated shared expert) and Mixtral, from their own plans with
    the ("seq", "tp") rule: the experts whole over tp, FSDP over dp."""
    rules = mt.Rules.from_hf(factory(), fsdp="dp", tp="tp", sequence_parallel=True)
    plan = mt.plan(factory(), _abstract(dp=2, tp=2), rules)
    assert plan.sequence_parallel and _whole(plan) == [f"model.layers.{i}.mlp" for i in range(2)]
    report = assert_equivalent(
        factory,
        {"dp": 2, "tp": 2},
        {"rules": rules},
        batches=token_batches,
        steps=2,
        optimizer="adamw",
    )
    assert report.passed
    print(f"worst {max(c.ratio for c in report.comparisons):.3f} of the bound")
