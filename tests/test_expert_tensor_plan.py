"""Tensor parallelism inside experts modules, while planning: the specs that split each
expert's intermediate features (packed gate-up column-wise, down row-wise) are read as the
``experts_tensor_parallel`` style, sized and costed; any other split inside the experts is refused
naming the parameter and the fix."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from moe_models import qwen3_moe
from torch import nn

import meshtrain as mt
from meshtrain.errors import MeshtrainError
from meshtrain.plan.ir import TPStyle

INSIDE = {
    r".*gate_up_proj": mt.P(None, "tp", None),
    r".*down_proj": mt.P(None, None, "tp"),
    ".*": mt.P(),
}


class _Experts(nn.Module):
    def __init__(self, inter: int = 4, bias: bool = False) -> None:
        super().__init__()
        self.num_experts = 4
        self.gate_up_proj = nn.Parameter(torch.zeros(4, 2 * inter, 8))
        self.down_proj = nn.Parameter(torch.zeros(4, 8, inter))
        if bias:
            self.down_proj_bias = nn.Parameter(torch.zeros(4, 8))

    def forward(self, hidden_states, top_k_index, top_k_weights):  # type: ignore[no-untyped-def]
        return hidden_states


class _Block(nn.Module):
    def __init__(self, experts: nn.Module) -> None:
        super().__init__()
        self.router = nn.Linear(8, 4, bias=False)
        self.experts = experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, index = self.router(x).softmax(-1).topk(2)
        return self.experts(x, index, weights)


def _mesh(**axes: int) -> mt.Mesh:
    world = 1
    for size in axes.values():
        world *= size
    return mt.make_mesh(axes, world_size=world, abstract=True)


def test_the_split_is_a_style_with_halved_local_weights_and_its_collectives() -> None:
    with torch.device("meta"):
        model = qwen3_moe()
    plan = mt.plan(
        model,
        _mesh(dp=2, tp=2),
        mt.Rules.from_hf(model, fsdp="dp", tp="tp"),
        batch_size=8,
        seq_len=8,
    )
    styles = {s.fqn: s for s in plan.styles}
    assert styles["model.layers.0.mlp.experts"].style == TPStyle.EXPERTS_TENSOR_PARALLEL
    layouts = {p.fqn: p for p in plan.params}
    gate_up = layouts["model.layers.0.mlp.experts.gate_up_proj"]
    down = layouts["model.layers.0.mlp.experts.down_proj"]
    assert gate_up.local_shape == (gate_up.shape[0], gate_up.shape[1] // 2, gate_up.shape[2])
    assert down.local_shape == (*down.shape[:2], down.shape[2] // 2)
    assert "experts_tensor_parallel" in plan.explain()
    reasons = {c.why for c in plan.collectives if c.axis == "tp"}
    assert any("row-wise outputs" in why for why in reasons)


def test_beside_expert_parallelism_the_group_says_it_is_split_inside() -> None:
    with torch.device("meta"):
        model = qwen3_moe()
    rules = mt.Rules.from_hf(model, fsdp=(), tp="tp", ep="ep")
    plan = mt.plan(model, _mesh(ep=2, tp=2), rules)
    assert plan.specs["model.layers.0.mlp.experts.gate_up_proj"] == mt.P("ep", "tp", None)
    assert all(group.tensor_axis == "tp" for group in plan.experts)
    assert "split inside over 'tp'" in plan.experts[0].describe()


@pytest.mark.parametrize(
    ("experts", "rules", "names"),
    [
        (_Experts(bias=True), INSIDE, ["experts.down_proj_bias", "no biases"]),
        (_Experts(inter=3), INSIDE, ["experts.down_proj", "not divisible by tp=2"]),
        (
            _Experts(),
            {r".*gate_up_proj": mt.P(None, None, "tp"), ".*": mt.P()},
            ["experts.gate_up_proj", "splits dim 1 alone"],
        ),
        (
            _Experts(),
            {r".*gate_up_proj": mt.P(None, "tp", None), ".*": mt.P()},
            ["experts.down_proj", "splits dim 2 alone"],
        ),
    ],
    ids=["bias", "uneven", "wrong-dim", "unpaired"],
)
def test_other_splits_inside_the_experts_are_refused(experts, rules, names) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(MeshtrainError) as refusal:  # SpecError for the uneven split
        mt.plan(_Block(experts), _mesh(tp=2), mt.Rules(rules))
    for name in names:
        assert name in str(refusal.value)


@settings(deadline=None)
@given(
    dp=st.sampled_from([1, 2]),
    ep=st.sampled_from([1, 2, 4]),
    tp=st.sampled_from([1, 2, 4]),
    experts=st.sampled_from([4, 6, 8]),
    inter=st.sampled_from([8, 12, 16, 24]),
    sequence_parallel=st.booleans(),
    expert_tp=st.booleans(),
    shared=st.sampled_from([0, 1]),
)
def test_moe_plans_split_the_experts_as_their_specs_say_or_refuse_with_the_reason(
    dp: int,
    ep: int,
    tp: int,
    experts: int,
    inter: int,
    sequence_parallel: bool,
    expert_tp: bool,
    shared: int,
) -> None:
    """Any MoE on any dp × ep × tp mesh, with or without sequence parallelism and a split inside
    the experts: the plan's expert weights are split exactly over ep (dim 0) and, inside, over tp
    (dims 1 and 2), each MoE block runs whole under sequence parallelism and nothing else does;
    or planning refuses, for a reason the arithmetic gives (experts or intermediate features that
    the axis does not divide)."""
    from meshtrain.models.moe import MoEConfig, build_moe
    from meshtrain.models.moe import default_rules as moe_rules

    config = MoEConfig.debug(
        n_experts=experts, moe_inter=inter, n_shared_experts=shared, top_k=2, n_kv_heads=4
    )
    with torch.device("meta"):
        model = build_moe(config)
    axes = {"dp": dp, "ep": ep, "tp": tp}
    rules = moe_rules(
        tp="tp",
        fsdp="dp",
        ep="ep",
        sequence_parallel=sequence_parallel and tp > 1,
        expert_tp=expert_tp,
    )
    splits_inside = expert_tp and tp > 1
    reasons = [
        experts % ep != 0,
        splits_inside and inter % tp != 0,
        shared and (shared * inter) % tp != 0,
    ]
    try:
        plan = mt.plan(model, _mesh(**axes), rules, seq_len=16, batch_size=dp * ep * 2)
    except MeshtrainError as refusal:
        assert any(reasons), f"refused without an arithmetic reason: {refusal}"
        return
    assert not any(reasons[:2]), "planned what does not divide"
    for layout in plan.params:
        if ".experts." not in layout.fqn:
            continue
        expected = list(layout.shape)
        expected[0] //= ep
        if splits_inside:
            expected[1 if layout.fqn.endswith("gate_up_proj") else 2] //= tp
        assert list(layout.local_shape) == expected, layout
    whole = {s.fqn for s in plan.styles if s.style == TPStyle.SEQUENCE_GATHERED}
    blocks = {f"layers.{i}.feed_forward" for i in range(config.first_dense_layers, config.n_layers)}
    assert whole == (blocks if plan.sequence_parallel else set())
    inside = {s.fqn for s in plan.styles if s.style == TPStyle.EXPERTS_TENSOR_PARALLEL}
    assert inside == ({f"{b}.experts" for b in blocks} if splits_inside else set())
