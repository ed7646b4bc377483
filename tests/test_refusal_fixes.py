"""Every refusal's fix plans (issue 43, point 4): for each kind of refusal of the plan-time
proof and of sequence parallelism's structure, the plan is refused naming the module or
parameter, the fix its message names is applied (a rule, an option, an example, or the model
rewritten as told) and the plan is accepted; the fixed plans that keep tensor parallelism train
like one device on 4 gloo ranks (``test_fixed_plans_train_like_one_device``)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import proof_models as pm
import pytest
import torch
import torch.nn.functional as F
import zoo
from torch import nn

import meshtrain as mt
from meshtrain import P, Rules
from meshtrain.testing import assert_equivalent

DP_TP = {"dp": 2, "tp": 2}
SEQ = [("seq", "tp")]


def _rules(patterns: dict[str, P], *, sp: bool = False) -> Rules:
    return Rules({**patterns, r".*": P()}, logical=SEQ if sp else (), fsdp="dp")


class FirstFeature(nn.Module):
    """A pooled first feature of a column-wise output (a reduction along the sharded dim)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(pm.VOCAB, 16)
        self.mlp = nn.ModuleDict({"up": nn.Linear(16, 32), "down": nn.Linear(32, 16)})
        self.head = nn.Linear(16, pm.VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        up = self.mlp["up"](h)
        h = h + self.mlp["down"](F.gelu(up)) + up.amax(-1, keepdim=True)
        return self.head(h)


class SwiGLU(nn.Module):
    """``w2(silu(w1(x)) * w3(x))`` with ``w1`` and ``w3`` reading the input, ``w2`` writing."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(pm.VOCAB, 16)
        self.ffn = nn.ModuleDict({n: nn.Linear(16, 32, bias=False) for n in ("w1", "w3")})
        self.ffn["w2"] = nn.Linear(32, 16, bias=False)
        self.head = nn.Linear(16, pm.VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        f = self.ffn
        return self.head(h + f["w2"](F.silu(f["w1"](h)) * f["w3"](h)))


class WrongFeed(nn.Module):
    """``mlp.up`` (column-wise) and ``mlp.down`` (row-wise) are a pair by structure, but
    ``down`` consumes another projection of the input (``proj``, replicated)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(pm.VOCAB, 16)
        self.mlp = nn.ModuleDict({"up": nn.Linear(16, 32), "down": nn.Linear(32, 16)})
        self.proj = nn.Linear(16, 32)
        self.head = nn.Linear(16, pm.VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        return self.head(
            h + self.mlp["down"](F.gelu(self.proj(h))) + 0 * self.mlp["up"](h)[..., :16]
        )


class HeadScaled(nn.Module):
    """q column-wise into heads, a learned per-head-dim scale (a raw parameter of the root, or
    in a module of its own), out row-wise."""

    def __init__(self, direct: bool = True) -> None:
        super().__init__()
        self.embed = nn.Embedding(pm.VOCAB, 16)
        self.block = nn.ModuleDict({"q": nn.Linear(16, 16), "o": nn.Linear(16, 16)})
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 4)) if direct else None
        self.norm = None if direct else nn.LayerNorm(4)
        self.head = nn.Linear(16, pm.VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        heads = self.block["q"](x).unflatten(-1, (-1, 4))
        heads = heads * self.scale if self.scale is not None else self.norm(heads)
        return self.head(x + self.block["o"](heads.flatten(-2)))


def _per_head(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return norm(x.unflatten(-1, (4, 4))).flatten(-2)


class HeadNormAttention(nn.Module):
    """q column-wise, o row-wise; with a norm of its own input's heads first (``norm``)."""

    def __init__(self, norm: bool) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(4) if norm else None
        self.q, self.o = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o(self.q(_per_head(self.norm, x) if self.norm is not None else x))


class PreHeadNorm(nn.Module):
    """A per-head norm of the attention's input inside the attention (``inside``), or moved out
    of it, into the caller."""

    def __init__(self, inside: bool = True) -> None:
        super().__init__()
        self.embed = nn.Embedding(pm.VOCAB, 16)
        self.attn = HeadNormAttention(norm=inside)
        self.norm = None if inside else nn.LayerNorm(4)
        self.head = nn.Linear(16, pm.VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        y = x if self.norm is None else _per_head(self.norm, x)
        return self.head(x + self.attn(y))


def head_scaled_module() -> HeadScaled:
    return HeadScaled(direct=False)


def norm_outside() -> PreHeadNorm:
    return PreHeadNorm(inside=False)


class ReadFirstMean(pm.TokenMLP):
    """The running mean read before it is updated (the fix of the read-again refusal)."""

    def __init__(self) -> None:
        super().__init__(running_mean=True)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        assert self.running_mean is not None
        centred = h - self.running_mean
        if self.training:
            with torch.no_grad():
                self.running_mean.mul_(0.9).add_(h.mean(dim=(0, 1)), alpha=0.1)
        return self.head(self.norm(centred + self.mlp["down"](F.gelu(self.mlp["up"](centred)))))


class ConvBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.conv = nn.Conv1d(16, 16, 3, padding=2, groups=16)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        conv = self.conv(self.norm(h).transpose(1, 2))[..., : h.shape[1]]
        return h + conv.transpose(1, 2)


class ConvInBlock(nn.Module):
    """A causal depthwise conv beside a norm in each block (mixes tokens: not per token)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(pm.VOCAB, 16)
        self.blocks = nn.ModuleList([ConvBlock(), ConvBlock()])
        self.head = nn.Linear(16, pm.VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def deepseek_v3() -> nn.Module:
    """Multi-head latent attention (value heads of 8, query/key heads of 16), dense MLPs."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    return DeepseekV3ForCausalLM(
        DeepseekV3Config(
            vocab_size=pm.VOCAB,
            hidden_size=32,
            intermediate_size=64,
            moe_intermediate_size=16,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=2,
            q_lora_rank=None,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=8,
            max_position_embeddings=64,
            use_cache=False,
            attn_implementation="sdpa",
        )
    )


def fused_mlp() -> nn.Module:
    """One Linear packing gate and up (``gate_up``), then ``down``."""

    class Fused(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(pm.VOCAB, 16)
            self.mlp = nn.ModuleDict({"gate_up": nn.Linear(16, 64), "down": nn.Linear(32, 16)})
            self.head = nn.Linear(16, pm.VOCAB)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            h = self.embed(tokens)
            gate, up = self.mlp["gate_up"](h).chunk(2, dim=-1)
            return self.head(h + self.mlp["down"](F.silu(gate) * up))

    return Fused()


@dataclass(frozen=True)
class Case:
    """A refused plan (``model``, ``axes``, ``refused`` plan options), the refusal's words,
    and the fix (``fixed`` options, on ``fixed_model`` when the fix rewrites the model)."""

    model: Callable[[], nn.Module]
    axes: dict[str, int]
    refused: dict[str, Any]
    match: str
    fixed: dict[str, Any]
    fixed_model: Callable[[], nn.Module] | None = None
    batches: Callable[[int], Any] = pm.token_batches
    trains: bool = True
    extra: dict[str, Any] = field(default_factory=dict)


OPT_ATTN = {
    r".*self_attn\.(q|k|v)_proj\.weight": P("tp", None),
    r".*self_attn\.(q|k|v)_proj\.bias": P("tp"),
    r".*self_attn\.out_proj\.weight": P(None, "tp"),
}
OPT_MLP = {
    r".*fc1\.weight": P("tp", None),
    r".*fc1\.bias": P("tp"),
    r".*fc2\.weight": P(None, "tp"),
}
T5_ATTN = {r".*\.(q|k|v)\.weight": P("tp", None), r".*\.o\.weight": P(None, "tp")}
T5_MLP = {r".*\.wi\.weight": P("tp", None), r".*\.wo\.weight": P(None, "tp")}
MLP = {r"mlp\.up\.(weight|bias)": P("tp"), r"mlp\.down\.weight": P(None, "tp")}
SWIGLU = {r"ffn\.w1\.weight": P("tp", None), r"ffn\.w2\.weight": P(None, "tp")}
HEAD_BLOCK = {r"block\.q\.(weight|bias)": P("tp"), r"block\.o\.weight": P(None, "tp")}
ATTN = {r"attn\.q\.(weight|bias)": P("tp"), r"attn\.o\.weight": P(None, "tp")}
ROBERTA_HEAD = {
    r"classifier\.out_proj\.weight": P("tp", None),
    r"classifier\.out_proj\.bias": P("tp"),
}
FUSED = {r"mlp\.gate_up\.(weight|bias)": P("tp"), r"mlp\.down\.weight": P(None, "tp")}
IMAGES = pm.image_batches(0)[0]

CASES: dict[str, Case] = {
    "global-reshape": Case(
        zoo.opt,
        DP_TP,
        {"rules": _rules({**OPT_ATTN, **OPT_MLP})},
        "reshapes with a global size.*Replicate the tensor-parallel projections",
        {"rules": _rules(OPT_MLP)},
        batches=zoo.token_batches,
    ),
    "sharded-mixed-with-whole": Case(
        zoo.t5,
        DP_TP,
        {"rules": _rules({**T5_ATTN, **T5_MLP})},
        "mixes tensors sharded.*replicate the tensor-parallel projections feeding this module",
        {"rules": _rules(T5_MLP)},
        batches=zoo.token_batches,
    ),
    "reduces-along-the-shard": Case(
        FirstFeature,
        DP_TP,
        {"rules": _rules(MLP)},
        "selects or reduces along the sharded dim.*replicate the "
        "tensor-parallel weights feeding it",
        {"rules": _rules({r"mlp\.down\.weight": P(None, "tp")})},
    ),
    "selects-a-sequence-position": Case(
        pm.roberta_classifier,
        DP_TP,
        {
            "rules": Rules(
                {**ROBERTA_HEAD, **dict(pm.ROBERTA_RULES.patterns)}, logical=SEQ, fsdp="dp"
            )
        },
        "selects or reduces along the sharded dim.*Keep this module's tensor-parallel Linears "
        "replicated",
        {"rules": Rules(pm.ROBERTA_RULES.patterns, logical=SEQ, fsdp="dp")},
        batches=pm.label_batches,
    ),
    "row-wise-fed-no-shard": Case(
        WrongFeed,
        DP_TP,
        {"rules": _rules(MLP)},
        r"'mlp\.down' \(Linear\) is lowered row-wise.*replicate "
        r"'mlp\.down\.weight'",
        {"rules": _rules({r"mlp\.up\.(weight|bias)": P("tp")})},
    ),
    "partial-gradient-outside-a-module": Case(
        HeadScaled,
        DP_TP,
        {"rules": _rules(HEAD_BLOCK)},
        "parameter 'scale' is replicated.*move it into a module that takes the shard",
        {"rules": _rules(HEAD_BLOCK)},
        fixed_model=head_scaled_module,
    ),
    "sharded-parameter-read-elsewhere": Case(
        pm.tied_mlp,
        DP_TP,
        {"rules": pm.VOCAB_RULES},
        r"Replicate it \(spec P\(\) for 'embed\.weight'\)",
        {"rules": pm.MLP_RULES},
    ),
    "buffer-written-from-the-batch": Case(
        pm.running_mean_mlp,
        DP_TP,
        {"rules": pm.MLP_RULES},
        "batch_buffers='average'",
        {"rules": pm.MLP_RULES, "batch_buffers": "average"},
    ),
    "buffer-read-again": Case(
        pm.rereading_mean_mlp,
        DP_TP,
        {"rules": pm.MLP_RULES, "batch_buffers": "average"},
        "Read it before updating it",
        {"rules": pm.MLP_RULES, "batch_buffers": "average"},
        fixed_model=ReadFirstMean,
    ),
    "buffer-over-micro-batches": Case(
        pm.running_mean_mlp,
        DP_TP,
        {"rules": pm.MLP_RULES, "batch_buffers": "average", "microbatches": 2},
        "Use one micro-batch",
        {"rules": pm.MLP_RULES, "batch_buffers": "average"},
    ),
    "no-probe": Case(
        pm.group_norm_cnn,
        DP_TP,
        {"rules": pm.CNN_RULES},
        "pass example_inputs=",
        {"rules": pm.CNN_RULES, "example_inputs": IMAGES},
        batches=pm.image_batches,
    ),
    "forward-fails-on-the-probe": Case(
        pm.group_norm_cnn,
        DP_TP,
        {"rules": pm.CNN_RULES, "example_inputs": torch.zeros(2, 3, 4)},
        "failed in 'stem.0'.*Pass example_inputs=",
        {"rules": pm.CNN_RULES, "example_inputs": IMAGES},
        batches=pm.image_batches,
    ),
    "marked-input-read-inside": Case(
        PreHeadNorm,
        DP_TP,
        {"rules": _rules(ATTN, sp=True)},
        "computes on the input of 'attn'.*Move that computation out of 'attn'",
        {"rules": _rules(ATTN, sp=True)},
        fixed_model=norm_outside,
    ),
    "input-read-inside-under-compiled-selective": Case(
        PreHeadNorm,
        {"dp": 1, "tp": 2},
        {
            "rules": _rules(ATTN),
            "compile": {"backend": "aot_eager"},
            "activation_checkpointing": "selective",
        },
        r"torch\.compile over checkpointed blocks.*activation_checkpointing='none'",
        {"rules": _rules(ATTN), "compile": {"backend": "aot_eager"}},
    ),
    "not-per-token-under-sp": Case(
        ConvInBlock,
        DP_TP,
        {"rules": _rules({r"head\.(weight|bias)": P("tp")}, sp=True)},
        r"'blocks\.0\.conv' \(Conv1d\).*Drop the \('seq', \.\.\.\)",
        {"rules": _rules({r"head\.(weight|bias)": P("tp")})},
    ),
    "replicated-linear-in-a-block-under-sp": Case(
        pm.rotary_lm,
        DP_TP,
        {
            "rules": Rules(
                {r"layers\.\d+\.feed_forward\.w[12]\..*": P(), **dict(pm.ROTARY_RULES.patterns)},
                logical=SEQ,
                fsdp="dp",
                allow_unused=True,
            )
        },
        r"feed_forward\.w1' \(Linear\) inside a repeated block.*Shard it with its partners",
        {"rules": Rules(pm.ROTARY_RULES.patterns, logical=SEQ, fsdp="dp")},
    ),
    "replicated-sibling-of-a-pair": Case(
        SwiGLU,
        DP_TP,
        {"rules": _rules(SWIGLU)},
        r"'ffn\.w3' beside.*is replicated.*Shard 'ffn\.w3\.weight' "
        "column-wise too",
        {"rules": _rules({**SWIGLU, r"ffn\.w3\.weight": P("tp")})},
    ),
    "fused-projection": Case(
        fused_mlp,
        DP_TP,
        {"rules": _rules(FUSED)},
        r"packs several projections.*Replicate 'mlp\.gate_up' \(P\(\)\)",
        {"rules": _rules({r"mlp\.down\.weight": P(None, "tp")})},
    ),
    "heads-split-unevenly": Case(
        zoo.llama,
        {"dp": 1, "tp": 4},
        {"rules": zoo.hf_rules(zoo.llama())},
        "Use a tp size that divides 2",
        {"rules": zoo.hf_rules(zoo.llama())},
        batches=zoo.token_batches,
        extra={"fixed_axes": DP_TP},
    ),
    "context-attention-shapes": Case(
        deepseek_v3,
        {"dp": 2, "cp": 2},
        {"rules": Rules({".*": P()}, fsdp="dp", logical=[("seq", "cp")])},
        r"'model\.layers\.0\.self_attn' calls attention.*without the \('seq', \.\.\.\) context",
        {"rules": Rules({".*": P()}, fsdp="dp")},
        extra={"fixed_axes": {"dp": 4}},
    ),
}


def _mesh(axes: dict[str, int]) -> mt.Mesh:
    return mt.make_mesh(dict(axes), world_size=math.prod(axes.values()), abstract=True)


@pytest.mark.parametrize("name", list(CASES))
def test_the_refusal_names_a_fix_that_plans(name: str) -> None:
    case = CASES[name]
    options = dict(case.refused)
    with pytest.raises(mt.MeshtrainError, match=f"(?s){case.match}") as refusal:
        mt.plan(case.model(), _mesh(case.axes), **options)
    assert str(refusal.value)
    fixed = dict(case.fixed)
    plan = mt.plan(
        (case.fixed_model or case.model)(), _mesh(case.extra.get("fixed_axes", case.axes)), **fixed
    )
    assert not [n for n in plan.notes if "not proven" in n or "refused" in n]


@pytest.mark.spmd
@pytest.mark.filterwarnings("ignore:.*FSDP2-wrapped module .* returned a view tensor")
@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c.trains])
def test_fixed_plans_train_like_one_device(name: str) -> None:
    case = CASES[name]
    report = assert_equivalent(
        case.fixed_model or case.model,
        case.extra.get("fixed_axes", case.axes),
        dict(case.fixed),
        batches=case.batches,
        steps=1,
        optimizer="adamw",
    )
    assert report.passed


@pytest.mark.spmd
@pytest.mark.filterwarnings("ignore:.*FSDP2-wrapped module .* returned a view tensor")
def test_a_norm_of_the_pair_parents_input_trains_under_plain_tensor_parallelism() -> None:
    """Without sequence parallelism the parent keeps its plain input (its column-wise children
    share one replicated DTensor of it): the norm inside it computes as written."""
    report = assert_equivalent(
        PreHeadNorm,
        DP_TP,
        {"rules": _rules(ATTN)},
        batches=pm.token_batches,
        steps=1,
        optimizer="adamw",
    )
    assert report.passed
