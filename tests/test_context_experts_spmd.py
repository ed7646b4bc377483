"""Context parallelism beside expert parallelism trains like one device: each context rank
holds head-tail chunks of every sequence, attention circulates keys and values over cp, and
the MoE layers dispatch each rank's own tokens over ep; the experts' FSDP spans the data and
context ranks (whose tokens differ), the other weights the data, context and expert ranks."""

from __future__ import annotations

import math

import pytest
from moe_models import meshtrain_moe, qwen3_moe, token_batches

import meshtrain as mt
from meshtrain.models.moe import default_rules as moe_rules
from meshtrain.testing import assert_equivalent

pytestmark = pytest.mark.spmd

SEQ = 8  # token_batches' length: 2 · cp head-tail chunks of 2 tokens on cp 2


def _with_context(rules: mt.Rules) -> mt.Rules:
    context = mt.Rules(
        rules.patterns,
        logical=(("seq", "cp"), *rules.logical),
        fsdp=rules.fsdp,
        gathered=rules.gathered,
    )
    context.notes = rules.notes
    return context


def _abstract(**axes: int) -> mt.Mesh:
    return mt.make_mesh(**axes, world_size=math.prod(axes.values()), abstract=True)


def _check(factory, mesh: dict[str, int], rules: mt.Rules) -> None:  # type: ignore[no-untyped-def]
    plan = mt.plan(factory(), _abstract(**mesh), rules, seq_len=SEQ)
    assert plan.context_axis == "cp" and plan.expert_axis == "ep"
    assert set(plan.token_axes) == set(mesh)
    report = assert_equivalent(
        factory,
        mesh,
        {"rules": rules, "seq_len": SEQ},
        batches=token_batches,
        steps=2,
        optimizer="adamw",
    )
    assert report.passed
    print(f"worst {max(c.ratio for c in report.comparisons):.3f} of the bound")


def test_meshtrain_moe_on_cp2_ep2() -> None:
    _check(meshtrain_moe, {"cp": 2, "ep": 2}, _with_context(moe_rules(tp=None, fsdp=(), ep="ep")))


def test_qwen3_moe_on_cp2_ep2() -> None:
    rules = mt.Rules.from_hf(qwen3_moe(), fsdp=(), tp=None, ep="ep")
    _check(qwen3_moe, {"cp": 2, "ep": 2}, _with_context(rules))


@pytest.mark.extended
def test_meshtrain_moe_on_dp2_cp2_ep2() -> None:
    """8 ranks: FSDP over dp, the sequence over cp, the experts over ep."""
    rules = _with_context(moe_rules(tp=None, fsdp="dp", ep="ep"))
    _check(meshtrain_moe, {"dp": 2, "cp": 2, "ep": 2}, rules)
