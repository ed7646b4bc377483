"""Context parallelism in the plan (tier 1, pure: meta models, abstract meshes): which axis is
the context axis, what it records, and every combination it refuses while planning, by name."""

from __future__ import annotations

import pytest
import torch
from context_models import MODELS, hf_llama, rules
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

import meshtrain as mt
from meshtrain.models import LlamaConfig as OwnLlamaConfig
from meshtrain.models import build_llama
from meshtrain.models.llama import LOGICAL_RULES
from meshtrain.spec.rules import Rules


def _own() -> nn.Module:
    return build_llama(OwnLlamaConfig.debug(), device="meta")


def _plan(model: nn.Module, fsdp: tuple[str, ...] = ("dp",), **mesh_and_options: object) -> mt.Plan:
    axes = {k: v for k, v in mesh_and_options.items() if k in ("dp", "cp", "tp", "pp")}
    options = {k: v for k, v in mesh_and_options.items() if k not in axes}
    world = 1
    for size in axes.values():
        world *= int(size)  # type: ignore[call-overload]
    mesh = mt.make_mesh(axes, world_size=world, abstract=True)
    return mt.plan(model, mesh, rules(fsdp), **options)


def test_the_seq_rule_on_a_free_axis_makes_it_the_context_axis() -> None:
    plan = _plan(_own(), dp=2, cp=2, seq_len=32, batch_size=2)
    assert plan.context_axis == "cp" and plan.data_axes == ("dp",)
    assert plan.token_axes == ("dp", "cp")
    assert plan.options.context_balance == "headtail" and plan.options.context_method == "ring"
    assert [u.fqn for u in plan.units] == ["layers.0", "layers.1", ""]
    embedding = next(p for p in plan.params if p.fqn == "tok_embeddings.weight")
    assert embedding.shard_shape[0] == -(-embedding.shape[0] // 4)  # FSDP over dp x cp
    assert mt.Plan.from_json(plan.to_json()) == plan
    assert "context parallelism over 'cp' (2 ranks per sequence, balance 'headtail'" in (
        plan.explain()
    )


def test_context_alone_wraps_fsdp_over_the_context_axis() -> None:
    plan = _plan(_own(), fsdp=(), cp=4, seq_len=64, context_method="allgather")
    assert plan.context_axis == "cp" and plan.data_axes == () and plan.units
    assert plan.token_axes == ("cp",) and plan.options.context_method == "allgather"
    assert not any("no data axis" in note for note in plan.notes)


def test_transformers_models_with_sdpa_plan() -> None:
    for name in ("hf_llama", "qwen2", "mistral"):
        with torch.device("meta"):
            model = MODELS[name]()
        assert _plan(model, dp=2, cp=2, seq_len=32).context_axis == "cp"


@pytest.mark.parametrize(
    ("seq_len", "balance", "chunks"), [(36, "headtail", 8), (30, "contiguous", 4)]
)
def test_a_sequence_that_does_not_split_into_chunks_is_refused(
    seq_len: int, balance: str, chunks: int
) -> None:
    with pytest.raises(mt.PlanError, match=rf"seq_len={seq_len} .* {chunks} equal chunks.*cp=4"):
        _plan(_own(), fsdp=(), cp=4, seq_len=seq_len, context_balance=balance)


@pytest.mark.parametrize(
    ("mesh", "fsdp", "options", "what"),
    [
        (
            {"cp": 2, "pp": 2},
            (),
            {"pipeline": mt.Pipeline(axis="pp", schedule="ZBVZeroBubble", stages_per_rank=2)},
            "the pipeline schedule 'ZBVZeroBubble', which splits backward",
        ),
        (
            {"dp": 2, "cp": 2},
            ("dp",),
            {"compile": {"fullgraph": True}},
            r"torch.compile with fullgraph=True",
        ),
    ],
)
def test_combinations_not_proven_are_refused(
    mesh: dict[str, int], fsdp: tuple[str, ...], options: dict[str, object], what: str
) -> None:
    with pytest.raises(mt.PlanError, match=rf"context parallelism over 'cp'.*compose with {what}"):
        _plan(_own(), fsdp=fsdp, **mesh, **options)


def test_compile_without_fullgraph_plans_context_attention_as_an_eager_island() -> None:
    plan = _plan(_own(), fsdp=("dp",), dp=2, cp=2, compile={"backend": "aot_eager"})
    assert plan.context_axis == "cp" and plan.compile_scope is not None


def test_tensor_and_sequence_parallelism_compose_on_their_own_axis() -> None:
    mesh = mt.make_mesh(dp=2, cp=2, tp=2, world_size=8, abstract=True)
    for seq, sequence_parallel in (("cp", False), (("cp", "tp"), True)):
        tp_rules = Rules(logical=[*LOGICAL_RULES, ("seq", seq)], fsdp="dp")
        plan = mt.plan(_own(), mesh, tp_rules, seq_len=32)
        assert (plan.context_axis, plan.tp_axis) == ("cp", "tp")
        assert plan.sequence_parallel is sequence_parallel
    with pytest.raises(mt.PlanError, match=r"seq_len=6 leaves each of the cp=2 ranks .* 3 tokens"):
        mt.plan(
            _own(),
            mesh,
            Rules(logical=[*LOGICAL_RULES, ("seq", ("cp", "tp"))], fsdp="dp"),
            seq_len=6,
            context_balance="contiguous",
        )


def test_hsdp_with_context_shards_over_the_shard_and_context_axes() -> None:
    """Replicated over 'rep', sharded over 'dp' and 'cp' together (four ranks)."""
    mesh = mt.make_mesh(rep=2, dp=2, cp=2, world_size=8, abstract=True)
    hsdp = mt.Rules({".*": mt.P()}, fsdp=("rep", "dp"), logical=[("seq", "cp")])
    plan = mt.plan(_own(), mesh, hsdp)
    assert (plan.data_axes, plan.context_axis) == (("rep", "dp"), "cp")
    embeddings = {p.fqn: p for p in plan.params}["tok_embeddings.weight"]
    assert embeddings.shard_shape == (embeddings.local_shape[0] // 4, embeddings.local_shape[1])


def test_hsdp_with_context_plans_whatever_the_order_of_the_mesh() -> None:
    hsdp = mt.Rules({".*": mt.P()}, fsdp=("rep", "dp"), logical=[("seq", "cp")])
    first = mt.plan(_own(), mt.make_mesh(rep=2, dp=2, cp=2, world_size=8, abstract=True), hsdp)
    last = mt.plan(_own(), mt.make_mesh(cp=2, dp=2, rep=2, world_size=8, abstract=True), hsdp)
    assert last.data_axes == ("rep", "dp") and last.params == first.params


def test_a_sequence_rule_onto_a_data_axis_is_still_refused() -> None:
    mesh = mt.make_mesh(dp=2, world_size=2, abstract=True)
    with pytest.raises(mt.PlanError, match="maps the sequence dim to \\['dp'\\]"):
        mt.plan(_own(), mesh, mt.Rules({".*": mt.P()}, fsdp="dp", logical=[("seq", "dp")]))


def test_attention_it_cannot_place_is_refused_naming_it() -> None:
    with torch.device("meta"):
        eager = LlamaForCausalLM(
            LlamaConfig(**{**hf_llama().config.to_dict(), "attn_implementation": "eager"})
        )
    eager.config._attn_implementation = "eager"
    with pytest.raises(mt.PlanError, match=r"attn_implementation='eager'.*'sdpa'"):
        _plan(eager, dp=2, cp=2)
    plain = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 16))
    with pytest.raises(mt.PlanError, match="cannot place the attention of Sequential"):
        _plan(plain, dp=2, cp=2)


def test_modules_it_cannot_split_are_refused_naming_them() -> None:
    model = _own()
    model.layers["0"].ffn_norm = nn.BatchNorm1d(64, device="meta")  # type: ignore[index]
    with pytest.raises(mt.PlanError, match=r"module 'layers.0.ffn_norm' \(BatchNorm1d\)"):
        _plan(model, dp=2, cp=2)

    class Learned(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.position_embeddings = nn.Embedding(32, 8)
            self.attention = nn.Linear(8, 8)
            self.attention.attention_fn = None  # type: ignore[assignment]

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            return self.attention(self.position_embeddings(tokens))

    with pytest.raises(mt.PlanError, match="'position_embeddings' is a learned position"):
        _plan(Learned(), dp=2, cp=2)


def test_unknown_balance_or_method_is_refused() -> None:
    with pytest.raises(mt.PlanError, match="context_balance='ptrr'"):
        mt.PlanOptions(context_balance="ptrr")  # type: ignore[arg-type]
    with pytest.raises(mt.PlanError, match="context_method='alltoall'"):
        mt.PlanOptions(context_method="alltoall")  # type: ignore[arg-type]


def test_the_contract_counts_the_context_merge_and_the_token_sum() -> None:
    from meshtrain.testing.contract import contract_for

    contract = contract_for(_plan(_own(), dp=2, cp=4, seq_len=32))
    merges = [r for r in contract.reorderings if r.what.startswith("context-parallel attention")]
    assert [(r.ways, r.levels) for r in merges] == [(4, 10)]  # 3 merges of 3 roundings, +1
    sums = [r for r in contract.reorderings if r.what.startswith("data-parallel")]
    assert [r.ways for r in sums] == [8]  # gradients and loss tokens over dp x cp
    assert contract.level == "reduction-order"
