"""Three axes on mixture-of-experts models (second tier, 8 ranks): dp 2 x ep 2 x tp 2, the routed
experts over ep, attention, dense MLPs and shared experts tensor-parallel over tp, FSDP over dp;
meshtrain's MoE and transformers' Qwen3-MoE (per-head q/k norms whose partial gradients are
reduced over tp) train like one device (fp32, AdamW, 2 steps). Tiny models built locally
(``moe_models``)."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable

import pytest
from moe_models import meshtrain_moe, qwen3_moe, token_batches
from torch import nn

import meshtrain as mt
from meshtrain.models.moe import default_rules as moe_rules
from meshtrain.testing import assert_equivalent

pytestmark = [pytest.mark.spmd, pytest.mark.extended]

DP2_EP2_TP2 = {"dp": 2, "ep": 2, "tp": 2}


def _rules(factory: Callable[[], nn.Module]) -> mt.Rules:
    if factory is meshtrain_moe:
        return moe_rules(tp="tp", fsdp="dp", ep="ep")
    return mt.Rules.from_hf(factory(), fsdp="dp", tp="tp", ep="ep")


def _partial_grads(factory: Callable[[], nn.Module]) -> set[str]:
    """Qwen3-MoE's q/k norms act per head, on tp-sharded heads: their gradients are partial."""
    if factory is qwen3_moe:
        return {f"model.layers.{i}.self_attn.{n}_norm.weight" for i in range(2) for n in "qk"}
    return set()


@pytest.mark.parametrize("factory", [meshtrain_moe, qwen3_moe], ids=lambda f: f.__name__)
def test_moe_trains_like_one_device_on_dp2_ep2_tp2(factory: Callable[[], nn.Module]) -> None:
    rules = _rules(factory)
    abstract = mt.make_mesh(DP2_EP2_TP2, world_size=math.prod(DP2_EP2_TP2.values()), abstract=True)
    plan = mt.plan(factory(), abstract, rules)
    assert plan.expert_axis == "ep" and plan.tp_axis == "tp" and plan.data_axes == ("dp",)
    assert not [note for note in plan.notes if "not proven" in note]
    assert {grad.param for grad in plan.partial_grads} == _partial_grads(factory)
    start = time.perf_counter()
    report = assert_equivalent(
        factory, DP2_EP2_TP2, {"rules": rules}, batches=token_batches, steps=2, optimizer="adamw"
    )
    worst = max(comparison.ratio for comparison in report.comparisons)
    print(
        f"{factory.__name__}: {time.perf_counter() - start:.1f} s, worst {worst:.3f} of the bound"
    )
    assert report.passed and report.contract.level == "reduction-order"
    assert json.loads(report.plan_json)["expert_axis"] == "ep"
