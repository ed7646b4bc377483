"""Tensor parallelism inside experts modules, while planning: the specs that split each
expert's intermediate features (packed gate-up column-wise, down row-wise) are read as the
``experts_tensor_parallel`` style, sized and costed; any other split inside the experts is refused
naming the parameter and the fix."""

from __future__ import annotations

import pytest
import torch
from moe_models import qwen3_moe
from torch import nn

import meshtrain as mt
from meshtrain.errors import MeshtrainError
from meshtrain.plan.ir import TPStyle

INSIDE = {r".*gate_up_proj": mt.P(None, "tp", None), r".*down_proj": mt.P(None, None, "tp"),
          ".*": mt.P()}  # fmt: skip


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
    plan = mt.plan(model, _mesh(dp=2, tp=2), mt.Rules.from_hf(model, fsdp="dp", tp="tp"),
                   batch_size=8, seq_len=8)  # fmt: skip
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
        (_Experts(), {r".*gate_up_proj": mt.P(None, None, "tp"), ".*": mt.P()},
         ["experts.gate_up_proj", "splits dim 1 alone"]),
        (_Experts(), {r".*gate_up_proj": mt.P(None, "tp", None), ".*": mt.P()},
         ["experts.down_proj", "splits dim 2 alone"]),
    ],
    ids=["bias", "uneven", "wrong-dim", "unpaired"],
)  # fmt: skip
def test_other_splits_inside_the_experts_are_refused(experts, rules, names) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(MeshtrainError) as refusal:  # SpecError for the uneven split
        mt.plan(_Block(experts), _mesh(tp=2), mt.Rules(rules))
    for name in names:
        assert name in str(refusal.value)
