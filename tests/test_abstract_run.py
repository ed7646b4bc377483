"""The plan-time abstract run (meshtrain.plan.proof.run): on fake tensors, no process group.

Third-party models whose tensor-parallel plans train wrong or crash are refused while planning,
naming the module and the operation; replicated parameters computing on shards are recorded as
partial gradients (reduced, costed, explained, in the JSON); the plans that train right are
unchanged (no false refusals)."""

from __future__ import annotations

import math

import pytest
import torch
import zoo
from hypothesis import given, settings
from hypothesis import strategies as st
from proof_models import megatron
from torch import nn
from transformers import (
    OPTConfig,
    OPTForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    RobertaConfig,
    RobertaForSequenceClassification,
    T5Config,
    T5ForConditionalGeneration,
)

import meshtrain as mt
from meshtrain.plan.ir import PartialGrad, Plan
from meshtrain.plan.proof import run as proof_run
from meshtrain.plan.proof.prover import Prover
from meshtrain.spec.partition import P
from meshtrain.spec.rules import Rules

DP_TP = {"dp": 2, "tp": 2}


def mesh(**axes: int) -> mt.Mesh:
    return mt.make_mesh(**axes, world_size=math.prod(axes.values()), abstract=True)


def qwen3() -> Qwen3ForCausalLM:
    return Qwen3ForCausalLM(
        Qwen3Config(
            vocab_size=128,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            max_position_embeddings=64,
            use_cache=False,
        )
    )


def test_qwen3_per_head_norms_have_partial_gradients_recorded_costed_and_explained() -> None:
    model = qwen3()
    plan = mt.plan(model, mesh(**DP_TP), Rules.from_hf(model, fsdp="dp", tp="tp"))
    names = [f"model.layers.{i}.self_attn.{n}_norm.weight" for i in (0, 1) for n in ("q", "k")]
    assert [g.param for g in plan.partial_grads] == names
    assert {(g.axis, g.dim) for g in plan.partial_grads} == {("tp", 2)}  # [batch, seq, heads, dim]
    assert plan.partial_grads[0].module == "model.layers.0.self_attn.q_norm"
    rows = [c for c in plan.collectives if "abstract run" in c.why]
    assert [(c.kind, c.axis, c.count, c.bytes) for c in rows] == [
        ("all_reduce", "tp", 4, 4 * 8 * 4)
    ]
    assert "model.layers.1.self_attn.k_norm.weight: over 'tp'" in plan.explain()
    assert Plan.from_json(plan.to_json()).partial_grads == plan.partial_grads


def test_tensor_parallel_alone_records_them_too() -> None:
    model = qwen3()
    plan = mt.plan(model, mesh(tp=2, dp=1), Rules.from_hf(model, fsdp="dp", tp="tp"))
    assert len(plan.partial_grads) == 4


def test_opt_reshaping_with_its_global_head_count_is_refused() -> None:
    model = OPTForCausalLM(
        OPTConfig(
            vocab_size=128,
            hidden_size=32,
            ffn_dim=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=64,
            word_embed_proj_dim=32,
        )
    )
    rules = megatron(r"self_attn\.(q|k|v)_proj", r"self_attn\.out_proj", "fc1", "fc2")
    with pytest.raises(mt.PlanError, match="reshapes with a global size") as refusal:
        mt.plan(model, mesh(**DP_TP), rules)
    text = str(refusal.value)
    assert "'model.decoder.layers.0.self_attn' (OPTAttention)" in text
    assert "aten.view.default" in text and "Replicate the tensor-parallel" in text


def test_t5_position_bias_with_every_head_is_refused_not_a_crash() -> None:
    model = T5ForConditionalGeneration(
        T5Config(
            vocab_size=128,
            d_model=32,
            d_kv=8,
            d_ff=64,
            num_layers=2,
            num_heads=4,
            decoder_start_token_id=0,
        )
    )
    rules = megatron(r"(q|k|v)", r"o", r"wi", r"wo")
    with pytest.raises(mt.PlanError, match="mixes tensors sharded") as refusal:
        mt.plan(model, mesh(**DP_TP), rules)
    assert "'encoder.block.0.layer.0.SelfAttention' (T5Attention)" in str(refusal.value)


def test_roberta_classifier_on_the_cls_token_of_sequence_shards_is_refused() -> None:
    model = RobertaForSequenceClassification(
        RobertaConfig(
            vocab_size=128,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=80,
            num_labels=4,
        )
    )
    rules = megatron(
        r"attention\.self\.(query|key|value)",
        r"attention\.output\.dense",
        r"intermediate\.dense",
        r"layer\.\d+\.output\.dense",
    )
    patterns = dict(rules.patterns)
    patterns = {
        r"classifier\.out_proj\.weight": P("tp", None),
        r"classifier\.out_proj\.bias": P("tp"),
        **patterns,
    }
    sequence = Rules(patterns, logical=[("seq", "tp")], fsdp="dp")
    with pytest.raises(mt.PlanError, match=r"aten\.select\.int") as refusal:
        mt.plan(model, mesh(**DP_TP), sequence)
    assert "'classifier' (RobertaClassificationHead)" in str(refusal.value)
    assert "selects or reduces along the sharded dim" in str(refusal.value)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_plans_that_train_right_are_unchanged(sequence_parallel: bool) -> None:
    for model in (zoo.llama(), zoo.qwen2()):
        rules = zoo.hf_rules(model, sequence_parallel=sequence_parallel)
        plan = mt.plan(model, mesh(**DP_TP), rules)
        assert plan.partial_grads == ()
        assert not [n for n in plan.notes if "not proven" in n]


class HeadScaled(nn.Module):
    """Attention-like: q column-wise into heads, a learned per-head-dim scale (replicated, in a
    module of its own or used directly), out row-wise."""

    def __init__(self, direct: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 16)
        self.block = nn.ModuleDict({"q": nn.Linear(16, 16), "o": nn.Linear(16, 16)})
        self.scale = nn.Parameter(torch.ones(4)) if direct else None
        self.norm = nn.LayerNorm(4)
        self.direct = direct

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        heads = self.block["q"](x).unflatten(-1, (-1, 4))
        heads = heads * self.scale if self.scale is not None else self.norm(heads)
        return self.block["o"](heads.flatten(-2))


RULES = Rules(
    {r"block\.q\.(weight|bias)": P("tp"), r"block\.o\.weight": P(None, "tp"), ".*": P()}, fsdp="dp"
)


def test_a_replicated_module_on_sharded_heads_is_reduced() -> None:
    plan = mt.plan(HeadScaled(direct=False), mesh(**DP_TP), RULES)
    assert plan.partial_grads == (
        PartialGrad("norm.weight", "norm", "tp", 2, "aten.native_layer_norm.default"),
        PartialGrad("norm.bias", "norm", "tp", 2, "aten.native_layer_norm.default"),
    )


class HeadAttention(nn.Module):
    """q column-wise into heads of 4, a per-head LayerNorm (replicated), o row-wise."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.o, self.norm = nn.Linear(16, 16), nn.Linear(16, 16), nn.LayerNorm(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o(self.norm(self.q(x).unflatten(-1, (-1, 4))).flatten(-2))


class HeadBlock(nn.Module):
    """A residual around HeadAttention; ``halve`` keeps every other position (the block changes
    its input's shape, so a look-alike after it cannot pass its input through)."""

    def __init__(self, halve: bool) -> None:
        super().__init__()
        self.attn, self.halve = HeadAttention(), halve

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x + self.attn(x)
        return out[:, ::2] if self.halve else out


class Stacked(nn.Module):
    def __init__(self, halve: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 16)
        self.layers = nn.ModuleList(HeadBlock(halve) for _ in range(3))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return x


STACKED_RULES = Rules(
    {
        r".*attn\.q\.(weight|bias)": P("tp"),
        r".*attn\.o\.weight": P(None, "tp"),
        ".*": P(),
    },
    fsdp="dp",
)


@pytest.mark.parametrize("halve", [False, True])
def test_look_alike_blocks_share_fake_tensors_and_prove_the_same(
    halve: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Blocks after the first of their kind hold its fake tensors while they pass their input
    through; when one must run (the first changed the shape), the run starts again with each
    block's own, and the proof is the same as with every block's own from the start."""
    runs = []
    made = proof_run._prover
    monkeypatch.setattr(proof_run, "_prover", lambda *a: runs.append(1) or made(*a))
    shared = mt.plan(Stacked(halve), mesh(**DP_TP), STACKED_RULES)
    assert len(runs) == (2 if halve else 1)
    monkeypatch.setattr(Prover, "share_lookalikes", False)
    own = mt.plan(Stacked(halve), mesh(**DP_TP), STACKED_RULES)
    names = [f"layers.{i}.attn.norm.{p}" for i in range(3) for p in ("weight", "bias")]
    assert [g.param for g in shared.partial_grads] == names
    assert shared.to_json() == own.to_json()


def test_a_replicated_parameter_used_outside_a_module_of_its_own_is_refused() -> None:
    with pytest.raises(mt.PlanError, match="parameter 'scale' is replicated") as refusal:
        mt.plan(HeadScaled(direct=True), mesh(**DP_TP), RULES)
    assert "partial sum" in str(refusal.value) and refusal.value.fqn == "scale"


def test_a_pipelined_plan_is_proven_and_costs_its_stage_s_partial_gradients() -> None:
    model = qwen3()
    rules = Rules.from_hf(model, tp="tp")
    plan = mt.plan(model, mesh(pp=2, tp=2), rules, pipeline=mt.Pipeline(microbatches=2))
    assert len(plan.partial_grads) == 4  # the whole model's
    rows = [c for c in plan.collectives if "abstract run" in c.why]
    assert [(c.axis, c.count, c.bytes) for c in rows] == [("tp", 2, 2 * 8 * 4)]  # one layer's


class Scale(nn.Module):
    """A learned per-feature scale of each head (replicated: every head shares it)."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


class DrawnAttention(nn.Module):
    """q column-wise into ``heads`` heads, one per-head operation of ``kind``, out row-wise."""

    def __init__(self, kind: str, heads: int, head_dim: int) -> None:
        super().__init__()
        width = heads * head_dim
        self.kind, self.heads, self.head_dim = kind, heads, head_dim
        self.embed = nn.Embedding(64, width)
        self.attn = nn.ModuleDict({"q": nn.Linear(width, width), "o": nn.Linear(width, width)})
        self.norm = nn.LayerNorm(head_dim)
        self.scale = Scale(head_dim)
        self.direct = nn.Parameter(torch.ones(head_dim))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        q = self.attn["q"](x)
        if self.kind == "global_view":
            heads = q.view(x.shape[0], -1, self.heads, self.head_dim)
        else:
            heads = q.view(*x.shape[:2], -1, self.head_dim)
        if self.kind == "norm":
            heads = self.norm(heads)
        elif self.kind == "scale_module":
            heads = self.scale(heads)
        elif self.kind == "direct_scale":
            heads = heads * self.direct
        return self.attn["o"](heads.flatten(2))


@settings(max_examples=10, deadline=None)
@given(
    st.sampled_from(["norm", "scale_module", "direct_scale", "global_view", "local_view"]),
    st.sampled_from([2, 4]),
    st.sampled_from([4, 8]),
)
def test_drawn_per_head_operations_are_reduced_or_refused(
    kind: str, heads: int, head_dim: int
) -> None:
    rules = Rules(
        {r"attn\.q\.(weight|bias)": P("tp"), r"attn\.o\.weight": P(None, "tp"), r".*": P()},
        fsdp="dp",
    )
    model = DrawnAttention(kind, heads, head_dim)
    if kind in ("direct_scale", "global_view"):
        expected = "parameter 'direct' is replicated" if kind == "direct_scale" else "global size"
        with pytest.raises(mt.PlanError, match=expected):
            mt.plan(model, mesh(**DP_TP), rules)
        return
    plan = mt.plan(model, mesh(**DP_TP), rules)
    partial = {"norm": ["norm.weight", "norm.bias"], "scale_module": ["scale.weight"]}
    assert [g.param for g in plan.partial_grads] == partial.get(kind, [])
    assert all(g.dim == 2 for g in plan.partial_grads)  # [batch, seq, heads, head_dim]
    assert not [n for n in plan.notes if "not proven" in n]


def test_every_tensor_parallel_style_has_an_abstract_boundary() -> None:
    import importlib

    from meshtrain.plan.ir import TPStyle

    abstract = importlib.import_module("meshtrain.plan.proof.run")
    assert set(TPStyle) == abstract.LEAF_STYLES | abstract.REGION_STYLES
    assert not abstract.LEAF_STYLES & abstract.REGION_STYLES
