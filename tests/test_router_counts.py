"""The routers' count all-reduces in the plan: one of ``experts + 2`` int64 per MoE layer and
micro-batch over the token ranks, once more per checkpointed layer training its balance loss;
none on one token rank or for models without count reducers (transformers' MoE). The counts
measured on gloo ranks: tests/test_expert_cost_spmd.py."""

from __future__ import annotations

import meshtrain as mt
from meshtrain.models.moe import MoEConfig, build_moe, default_rules
from tests import moe_models


def _all_reduces(plan: mt.Plan) -> dict:
    return {k: v for k, v in plan.collective_totals().items() if k[0] == "all_reduce"}


def test_meshtrain_moe_plans_its_count_all_reduces() -> None:
    model = build_moe(MoEConfig.debug(balance="aux_loss"), device="meta")
    rules = default_rules(tp=None, fsdp="dp", ep="ep")
    mesh = mt.make_mesh(dp=2, ep=2, world_size=4, abstract=True)
    plain = mt.plan(
        model,
        mesh,
        rules,
        zero=3,
        batch_size=1,
        seq_len=8,
        microbatches=2,
        activation_checkpointing="none",
    )
    # 2 MoE layers × 2 micro-batches, 8 experts + 2 int64 = 80 B each
    assert _all_reduces(plain) == {("all_reduce", "dp+ep"): (4, 4 * 80)}
    again = mt.plan(
        model,
        mesh,
        rules,
        zero=3,
        batch_size=1,
        seq_len=8,
        microbatches=2,
        activation_checkpointing="full",
    )
    assert _all_reduces(again) == {("all_reduce", "dp+ep"): (8, 8 * 80)}
    one = mt.plan(model, mt.make_mesh(dp=1, ep=1), rules, batch_size=1, seq_len=8)
    assert _all_reduces(one) == {}


def test_transformers_moe_has_no_count_all_reduces() -> None:
    plan = mt.plan(
        moe_models.qwen3_moe(),
        mt.make_mesh(dp=2, ep=2, world_size=4, abstract=True),
        moe_models.ep_rules(),
        zero=3,
        batch_size=1,
        seq_len=8,
    )
    assert _all_reduces(plan) == {}
