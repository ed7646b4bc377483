"""The plan-time shard proof on mixtures of experts, and what a tensor-parallel plan does when
the proof cannot run: transformers' MoE families and meshtrain's own are proven (their experts
modules emulated densely), Qwen3-MoE's per-head norms found as partial gradients; a model whose
forward fails on fake tensors is refused by name unless ``unproven_shards="note"``."""

from __future__ import annotations

import math

import pytest
import torch
from moe_models import meshtrain_moe, mixtral, qwen2_moe, qwen3_moe
from torch import nn

import meshtrain as mt
from meshtrain.models.moe import default_rules as moe_rules
from meshtrain.plan.ir import Plan
from meshtrain.plan.options import PlanOptions


def _abstract(**axes: int) -> mt.Mesh:
    return mt.make_mesh(**axes, world_size=math.prod(axes.values()), abstract=True)


def _unproven(plan: Plan) -> list[str]:
    return [note for note in plan.notes if "not proven" in note]


@pytest.mark.parametrize("factory", [qwen3_moe, qwen2_moe, mixtral], ids=lambda f: f.__name__)
def test_transformers_moe_under_tp_is_proven(factory) -> None:  # type: ignore[no-untyped-def]
    model = factory()
    plan = mt.plan(model, _abstract(dp=2, tp=2), mt.Rules.from_hf(model, fsdp="dp", tp="tp"))
    assert not _unproven(plan)
    expected = (
        {f"model.layers.{i}.self_attn.{n}_norm.weight" for i in range(2) for n in "qk"}
        if factory is qwen3_moe
        else set()
    )
    assert {grad.param for grad in plan.partial_grads} == expected


def test_meshtrain_moe_under_tp_is_proven() -> None:
    plan = mt.plan(meshtrain_moe(), _abstract(dp=2, tp=2), moe_rules(fsdp="dp", tp="tp", ep=None))
    assert not _unproven(plan) and plan.partial_grads == ()


def test_qwen3_moe_with_experts_over_ep_beside_tp_is_proven() -> None:
    model = qwen3_moe()
    rules = mt.Rules.from_hf(model, fsdp="dp", tp="tp", ep="ep")
    plan = mt.plan(model, _abstract(dp=2, ep=2, tp=2), rules)
    assert plan.expert_axis == "ep" and not _unproven(plan) and len(plan.partial_grads) == 4


class _DataDependent(nn.Module):
    """A Megatron pair whose forward keeps only the nonzero token ids: no fake-tensor shape."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(40, 12)
        self.up, self.down = nn.Linear(12, 20), nn.Linear(20, 12)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        kept = tokens[tokens.nonzero(as_tuple=True)]
        return self.down(self.up(self.embed(kept)))


PAIR = mt.Rules(
    {
        r"up\.weight": mt.P("tp", None),
        r"up\.bias": mt.P("tp"),
        r"down\.weight": mt.P(None, "tp"),
        r".*": mt.P(),
    },
    fsdp="dp",
)


def test_an_unprovable_tensor_parallel_plan_is_refused_by_name() -> None:
    with pytest.raises(
        mt.PlanError,
        match=r"cannot be proven.*'<root>' \(_DataDependent\).*"
        r"nonzero.*unproven_shards='note'",
    ):
        mt.plan(_DataDependent(), _abstract(dp=2, tp=2), PAIR)


def test_unproven_shards_note_plans_with_the_note_and_round_trips() -> None:
    plan = mt.plan(_DataDependent(), _abstract(dp=2, tp=2), PAIR, unproven_shards="note")
    assert len(_unproven(plan)) == 1 and "_DataDependent" in _unproven(plan)[0]
    assert Plan.from_json(plan.to_json()).options.unproven_shards == "note"
    assert "unproven_shards" not in PlanOptions().to_json()  # the default: JSON unchanged
    with pytest.raises(mt.PlanError, match="unproven_shards='maybe'"):
        PlanOptions(unproven_shards="maybe")  # type: ignore[arg-type]


def test_without_tensor_parallelism_nothing_needs_proving() -> None:
    plan = mt.plan(_DataDependent(), _abstract(dp=4), mt.Rules({".*": mt.P()}, fsdp="dp"))
    assert not _unproven(plan)


def test_the_abstract_run_leaves_no_fake_tensor_on_the_model() -> None:
    """meshtrain's MoE keeps its last balance loss as an attribute: after planning it is what it
    was before (the model is copied and trained after planning)."""
    model = meshtrain_moe()
    before = {name: getattr(m, "last_aux_loss", "absent") for name, m in model.named_modules()}
    mt.plan(model, _abstract(dp=2, tp=2), moe_rules(fsdp="dp", tp="tp", ep=None))
    after = {name: getattr(m, "last_aux_loss", "absent") for name, m in model.named_modules()}
    assert after == before
    assert not [
        t
        for m in model.modules()
        for t in vars(m).values()
        if isinstance(t, torch._subclasses.fake_tensor.FakeTensor)
    ]
