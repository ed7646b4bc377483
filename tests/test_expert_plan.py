"""Expert parallelism planned (pure: meta-device models, abstract meshes): the expert axis read off
the specs, the batch split over it, expert weights sharded over the data ranks outside it, the
IR's JSON and explain(), Rules.from_hf's expert plans, and every combination that cannot lower
refused while planning, naming the module or parameter and the fix."""

from __future__ import annotations

import pytest
import torch
from moe_models import ep_rules, mixtral, qwen2_moe, qwen3_moe
from torch import nn

import meshtrain as mt
from meshtrain.errors import MeshtrainError, PlanError, SpecError
from meshtrain.plan.experts.axis import is_experts_module
from meshtrain.plan.ir import ExpertGroup, Plan
from meshtrain.testing.contract import contract_for

EXPERTS = "model.layers.0.mlp.experts"


def _meta(factory, *args):  # type: ignore[no-untyped-def]
    with torch.device("meta"):
        return factory(*args)


def _mesh(**axes: int) -> mt.Mesh:
    world = 1
    for size in axes.values():
        world *= size
    return mt.make_mesh(axes, world_size=world, abstract=True)


def test_the_expert_axis_splits_experts_and_the_batch() -> None:
    plan = mt.plan(_meta(qwen3_moe), _mesh(dp=2, ep=2), ep_rules())
    assert (plan.expert_axis, plan.data_axes, plan.batch_axes, plan.tp_axis) == (
        "ep",
        ("dp",),
        ("dp", "ep"),
        None,
    )
    assert [g.fqn for g in plan.experts] == [EXPERTS, "model.layers.1.mlp.experts"]
    group = plan.experts[0]
    assert group == ExpertGroup(
        EXPERTS, 8, 4, (f"{EXPERTS}.gate_up_proj", f"{EXPERTS}.down_proj"), 2
    )
    layouts = {p.fqn: p for p in plan.params}
    # experts: E/ep per rank, then FSDP over dp only (efsdp); the rest FSDP over dp × ep
    assert layouts[f"{EXPERTS}.gate_up_proj"].local_shape == (4, 32, 32)
    assert layouts[f"{EXPERTS}.gate_up_proj"].shard_shape == (2, 32, 32)
    assert layouts["model.embed_tokens.weight"].shard_shape == (16, 32)
    assert Plan.from_json(plan.to_json()) == plan
    text = plan.explain()
    assert (
        "expert parallelism over 'ep'" in text
        and f"{EXPERTS}: 8 experts, 4 per rank, top-2" in text
    )


def test_expert_axis_alone_is_the_whole_batch_split() -> None:
    plan = mt.plan(_meta(qwen3_moe), _mesh(ep=4), ep_rules(fsdp=()))
    assert plan.batch_axes == ("ep",) and plan.units  # FSDP2 over ep for the rest
    assert {p.fqn: p.shard_shape for p in plan.params}[f"{EXPERTS}.down_proj"] == (2, 32, 16)


def test_a_pipeline_keeps_each_stage_s_experts_expert_parallel() -> None:
    plan = mt.plan(
        _meta(qwen3_moe),
        _mesh(pp=2, ep=2),
        ep_rules(fsdp=()),
        pipeline=mt.Pipeline(axis="pp", microbatches=2),
    )
    assert plan.expert_axis == "ep" and plan.batch_axes == ("ep",)
    stages = {fqn for stage in plan.pipeline.stages for fqn in stage.params if "experts" in fqn}
    assert stages == {fqn for group in plan.experts for fqn in group.params}


def test_the_contract_counts_every_batch_rank_and_the_dispatch() -> None:
    plan = mt.plan(_meta(qwen3_moe), _mesh(dp=2, ep=2), ep_rules())
    contract = contract_for(plan)
    ways = {r.what.split(":")[0]: r.ways for r in contract.reorderings}
    assert ways == {"data-parallel gradient and loss sum": 4, "expert-parallel token dispatch": 2}


@pytest.mark.parametrize("factory", [qwen3_moe, mixtral, qwen2_moe])
def test_rules_from_hf_read_the_expert_parallel_plan(factory) -> None:  # type: ignore[no-untyped-def]
    model = _meta(factory)
    plan = mt.plan(model, _mesh(dp=2, ep=2), mt.Rules.from_hf(model, fsdp="dp", tp=None, ep="ep"))
    assert plan.expert_axis == "ep" and len(plan.experts) == 2
    assert plan.specs[f"{EXPERTS}.gate_up_proj"] == mt.P("ep", None, None)
    assert plan.specs["model.layers.0.self_attn.q_proj.weight"] == mt.P()


def test_rules_from_hf_with_tp_and_no_ep_split_the_experts_inside() -> None:
    """moe_tp_experts: each expert's intermediate features over tp (packed gate-up column-wise,
    down row-wise), no expert axis; without tp the experts stay whole, with a note."""
    model = _meta(qwen3_moe)
    plan = mt.plan(model, _mesh(dp=2, tp=2), mt.Rules.from_hf(model, fsdp="dp", tp="tp"))
    assert plan.tp_axis == "tp" and plan.expert_axis is None
    assert plan.specs[f"{EXPERTS}.gate_up_proj"] == mt.P(None, "tp", None)
    assert plan.specs[f"{EXPERTS}.down_proj"] == mt.P(None, None, "tp")
    assert not any("kept whole" in note for note in plan.notes)
    whole = mt.plan(model, _mesh(dp=2), mt.Rules.from_hf(model, fsdp="dp", tp=None))
    assert whole.specs[f"{EXPERTS}.gate_up_proj"] == mt.P()
    assert any("kept whole (P())" in note and "ep='ep'" in note for note in whole.notes)


class _Experts(nn.Module):
    """The experts interface with 6 experts."""

    def __init__(self, experts: int = 6) -> None:
        super().__init__()
        self.num_experts = experts
        self.gate_up_proj = nn.Parameter(torch.zeros(experts, 8, 4))
        self.down_proj = nn.Parameter(torch.zeros(experts, 4, 4))

    def forward(self, hidden_states, top_k_index, top_k_weights):  # type: ignore[no-untyped-def]
        return hidden_states


class _OddForward(_Experts):
    def forward(self, hidden_states):  # type: ignore[no-untyped-def, override]
        return hidden_states


class _Tiny(nn.Module):
    def __init__(self, experts: nn.Module) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.layers = nn.ModuleList([nn.ModuleDict({"experts": experts})])


RULES = {r".*experts\..*": mt.P("ep", None, None), ".*": mt.P()}


@pytest.mark.parametrize(
    ("model", "mesh", "rules", "options", "names"),
    [
        (_Tiny(_Experts(6)), {"ep": 4}, RULES, {}, ["layers.0.experts.gate_up_proj", "ep=4"]),
        (
            _Tiny(_Experts()),
            {"ep": 2},
            {"proj.weight": mt.P("ep", None), **RULES},
            {},
            ["'proj.weight'", "not an experts module"],
        ),
        (
            _Tiny(_Experts()),
            {"ep": 2, "tp": 2},
            {r".*experts\..*": mt.P("ep", "tp", None), ".*": mt.P()},
            {},
            ["layers.0.experts.down_proj", "splits dim 2 alone", "P(e, None, 'tp')"],
        ),
        (
            _Tiny(_Experts()),
            {"ep": 2},
            {r".*gate_up_proj": mt.P("ep", None, None), ".*": mt.P()},
            {},
            ["down_proj", "split alike"],
        ),
        (
            _Tiny(_OddForward()),
            {"ep": 2},
            RULES,
            {},
            ["layers.0.experts", "_OddForward", "forward"],
        ),
        (
            _Tiny(_Experts()),
            {"ep": 2},
            RULES,
            {"compile": {"fullgraph": True}},
            ["fullgraph=True", "'fullgraph': False"],
        ),
        (_Tiny(_Experts()), {"ep": 2}, RULES, {"zero": 0}, ["zero=0"]),
    ],
    ids=["uneven", "non-experts", "tp-inside", "half-split", "forward", "fullgraph", "zero0"],
)
def test_what_cannot_lower_is_refused_while_planning(model, mesh, rules, options, names) -> None:  # type: ignore[no-untyped-def]
    fsdp = options.pop("fsdp", ())
    with pytest.raises(MeshtrainError) as refusal:  # PlanError; SpecError for an uneven split
        mt.plan(model, _mesh(**mesh), mt.Rules(rules, fsdp=fsdp), **options)
    assert isinstance(refusal.value, SpecError if "ep=4" in names else PlanError)
    for name in names:
        assert name in str(refusal.value)


def test_compile_without_fullgraph_plans_the_dispatch_as_an_eager_island() -> None:
    plan = mt.plan(
        _Tiny(_Experts()), _mesh(ep=2), mt.Rules(RULES), compile={"backend": "aot_eager"}
    )
    assert plan.expert_axis == "ep" and plan.compile_scope is not None


def test_the_experts_interface_is_recognised() -> None:
    assert is_experts_module(_meta(qwen3_moe).model.layers[0].mlp.experts)
    assert not is_experts_module(nn.Linear(2, 2))
