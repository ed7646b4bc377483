"""HSDP (``fsdp=("rep", "dp")``) beside an expert or a context axis, planned (pure: meta-device
models, abstract meshes): the plan accepts it; the parameters outside the experts shard over the
shard axis and the expert or context axis together, the experts over the shard axis only, none
over the replicate axis; the costs reduce-scatter over those ranks and all-reduce the shards over
the replicate axis; a rank holds what it holds without the replicate axis; explain() says so;
the axes may come in any order in the mesh."""

from __future__ import annotations

import pytest
import torch
from context_models import rules
from moe_models import ep_rules, qwen3_moe

import meshtrain as mt
from meshtrain.models import LlamaConfig, build_llama
from meshtrain.models.llama import LOGICAL_RULES
from meshtrain.plan.ir import Plan

EXPERTS = "model.layers.0.mlp.experts"


def _mesh(**axes: int) -> mt.Mesh:
    world = 1
    for size in axes.values():
        world *= size
    return mt.make_mesh(axes, world_size=world, abstract=True)


def _moe(mesh: mt.Mesh, fsdp: tuple[str, ...]) -> Plan:
    with torch.device("meta"):
        model = qwen3_moe()
    return mt.plan(model, mesh, ep_rules(fsdp=fsdp), batch_size=1, seq_len=8)


def _llama(mesh: mt.Mesh, fsdp: tuple[str, ...]) -> Plan:
    return mt.plan(
        build_llama(LlamaConfig.debug(), device="meta"), mesh, rules(fsdp), batch_size=1, seq_len=32
    )


def _rows(plan: Plan) -> dict[tuple[str, str], int]:
    """Payload bytes per (kind, axis) of the data-parallel collectives."""
    return {
        key: payload
        for key, (_, payload) in plan.collective_totals().items()
        if key[0] in ("all_gather", "reduce_scatter", "all_reduce")
    }


def test_hsdp_with_experts_shards_over_the_shard_and_expert_axes() -> None:
    plan = _moe(_mesh(rep=2, dp=2, ep=2), ("rep", "dp"))
    assert (plan.data_axes, plan.expert_axis, plan.batch_axes) == (
        ("rep", "dp"),
        "ep",
        ("rep", "dp", "ep"),
    )
    layouts = {p.fqn: p for p in plan.params}
    # the rest: 64 rows over dp × ep (4), not over rep
    assert layouts["model.embed_tokens.weight"].shard_shape == (16, 32)
    # experts: 8 over ep (4 each), then FSDP over dp only (2 each), not over rep
    assert layouts[f"{EXPERTS}.gate_up_proj"].local_shape == (4, 32, 32)
    assert layouts[f"{EXPERTS}.gate_up_proj"].shard_shape == (2, 32, 32)
    assert Plan.from_json(plan.to_json()) == plan


def test_hsdp_with_experts_costs_reduce_over_the_right_ranks() -> None:
    """The rest reduce-scatters over 'dp+ep' and the experts over 'dp'; both all-reduce their
    shards over 'rep'; nothing else gathers or reduces over 'rep'."""
    plan = _moe(_mesh(rep=2, dp=2, ep=2), ("rep", "dp"))
    rows = _rows(plan)
    expert = {fqn for group in plan.experts for fqn in group.params}
    local = sum(p.local_numel for p in plan.params if p.fqn not in expert) * 4
    local_experts = sum(p.local_numel for p in plan.params if p.fqn in expert) * 4
    shards = sum(p.shard_numel for p in plan.params) * 4
    assert rows[("reduce_scatter", "dp+ep")] == local
    assert rows[("reduce_scatter", "dp")] == local_experts
    assert rows[("all_reduce", "rep")] == shards  # every shard once across the replicas
    assert not any(axis == "rep" for kind, axis in rows if kind != "all_reduce")
    counts = {key: count for key, (count, _) in plan.collective_totals().items()}
    # one all-reduce per unit: the rest's units, then each experts module's own
    assert counts[("all_reduce", "rep")] == len(plan.units) + len(plan.experts)


def test_hsdp_with_experts_holds_per_rank_what_the_plan_without_replicas_holds() -> None:
    """Replicas add ranks, not shards: memory per rank equals dp 2 × ep 2's."""
    hsdp = _moe(_mesh(rep=2, dp=2, ep=2), ("rep", "dp"))
    plain = _moe(_mesh(dp=2, ep=2), ("dp",))
    assert hsdp.memory == plain.memory
    assert {p.fqn: p.shard_shape for p in hsdp.params} == {
        p.fqn: p.shard_shape for p in plain.params
    }


def test_hsdp_with_context_shards_over_the_shard_and_context_axes() -> None:
    plan = _llama(_mesh(rep=2, dp=2, cp=2), ("rep", "dp"))
    plain = _llama(_mesh(dp=2, cp=2), ("dp",))
    assert (plan.data_axes, plan.context_axis, plan.token_axes) == (
        ("rep", "dp"),
        "cp",
        ("rep", "dp", "cp"),
    )
    assert {p.fqn: p.shard_shape for p in plan.params} == {
        p.fqn: p.shard_shape for p in plain.params
    }
    assert plan.memory == plain.memory
    rows, plain_rows = _rows(plan), _rows(plain)
    assert rows[("reduce_scatter", "dp+cp")] == plain_rows[("reduce_scatter", "dp+cp")]
    assert rows[("all_gather", "dp+cp")] == plain_rows[("all_gather", "dp+cp")]
    assert rows[("all_reduce", "rep")] == sum(p.shard_numel for p in plan.params) * 4


@pytest.mark.parametrize(
    ("plan_fn", "mesh", "says"),
    [
        (
            _moe,
            _mesh(rep=2, dp=2, ep=2),
            "parameters outside the experts replicated over 'rep' and sharded over 'dp+ep' (4 ranks); "
            "the experts sharded over 'ep', then FSDP-sharded over 'dp' and replicated over 'rep'",
        ),
        (
            _llama,
            _mesh(rep=2, dp=2, cp=2),
            "HSDP: parameters replicated over 'rep' and sharded over 'dp+cp' (4 ranks)",
        ),
    ],
    ids=["experts", "context"],
)
def test_explain_says_what_hsdp_shards_over(plan_fn, mesh: mt.Mesh, says: str) -> None:  # type: ignore[no-untyped-def]
    text = plan_fn(mesh, ("rep", "dp")).explain()
    assert "data axes ['rep', 'dp']" in text and says in text
    assert "all_reduce     rep " in text and "HSDP: gradient shards across replicas" in text


@pytest.mark.parametrize(
    ("plan_fn", "mesh", "flat"),
    [
        (_moe, _mesh(ep=2, rep=2, dp=2), "dp+ep"),
        (_moe, _mesh(dp=2, rep=2, ep=2), "dp+ep"),
        (_llama, _mesh(cp=2, rep=2, dp=2), "cp+dp"),
    ],
    ids=["experts-first", "replicas-between", "context-first"],
)
def test_any_order_of_the_mesh_plans_alike(plan_fn, mesh: mt.Mesh, flat: str) -> None:  # type: ignore[no-untyped-def]
    """The replicate axis need not come first: the same shards, the same memory; the shard
    group is named as the plan names it (the experts' plans: data axes, then the expert axis)."""
    plan = plan_fn(mesh, ("rep", "dp"))
    beside = plan.expert_axis or plan.context_axis
    ordered = plan_fn(_mesh(**{"rep": 2, "dp": 2, beside: 2}), ("rep", "dp"))
    assert plan.data_axes == ("rep", "dp") and plan.params == ordered.params
    assert plan.memory == ordered.memory
    assert ("reduce_scatter", flat) in plan.collective_totals()
    assert ("all_reduce", "rep") in plan.collective_totals()


@pytest.mark.parametrize(
    ("plan_fn", "axis"), [(_moe, "ep"), (_llama, "cp")], ids=["experts", "context"]
)
def test_hsdp_with_a_pipeline_is_refused_naming_the_axes(plan_fn, axis: str) -> None:  # type: ignore[no-untyped-def]
    """Not proven (it takes 16 ranks): refused while planning, naming HSDP's axes and the
    pipeline's."""
    mesh = _mesh(**{"pp": 2, "rep": 2, "dp": 2, axis: 2})
    rules_fn = ep_rules if axis == "ep" else rules
    model = _meta_model(plan_fn)
    with pytest.raises(mt.PlanError) as refusal:
        mt.plan(
            model,
            mesh,
            rules_fn(fsdp=("rep", "dp")),
            seq_len=32,
            pipeline=mt.Pipeline(axis="pp", microbatches=2),
        )
    message = str(refusal.value)
    assert "HSDP over ['rep', 'dp']" in message and "pipeline over 'pp'" in message
    assert f"parallelism over '{axis}'" in message


def _meta_model(plan_fn):  # type: ignore[no-untyped-def]
    if plan_fn is _moe:
        with torch.device("meta"):
            return qwen3_moe()
    return build_llama(LlamaConfig.debug(), device="meta")


@pytest.mark.parametrize(
    ("plan_fn", "axis"), [(_moe, "ep"), (_llama, "cp")], ids=["experts", "context"]
)
def test_hsdp_with_tensor_parallelism_is_refused_naming_the_axes(plan_fn, axis: str) -> None:  # type: ignore[no-untyped-def]
    """Not proven either (16 ranks): refused while planning, naming HSDP's axes and tp."""
    mesh = _mesh(**{"rep": 2, "dp": 2, axis: 2, "tp": 2})
    model = _meta_model(plan_fn)
    hsdp = ("rep", "dp")
    tp_rules = (
        mt.Rules.from_hf(model, fsdp=hsdp, tp="tp", ep="ep")
        if axis == "ep"
        else mt.Rules(logical=[*LOGICAL_RULES, ("seq", "cp")], fsdp=hsdp)
    )
    with pytest.raises(mt.PlanError) as refusal:
        mt.plan(model, mesh, tp_rules, seq_len=32)
    message = str(refusal.value)
    assert "HSDP over ['rep', 'dp']" in message and "tensor parallelism over 'tp'" in message
    assert f"parallelism over '{axis}'" in message


def test_hsdp_with_experts_and_context_is_refused_naming_the_axes() -> None:
    """Not proven (16 ranks): refused while planning, naming HSDP's axes, ep and cp."""
    mesh = _mesh(rep=2, dp=2, cp=2, ep=2)
    with torch.device("meta"):
        model = qwen3_moe()
    rules_cp = ep_rules(fsdp=("rep", "dp"))
    rules_cp = mt.Rules(rules_cp.patterns, fsdp=("rep", "dp"), logical=[("seq", "cp")])
    with pytest.raises(mt.PlanError) as refusal:
        mt.plan(model, mesh, rules_cp, seq_len=32)
    message = str(refusal.value)
    assert "HSDP over ['rep', 'dp']" in message and "context parallelism over 'cp'" in message
    assert "expert parallelism over 'ep'" in message
