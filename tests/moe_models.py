"""Tiny mixture-of-experts models for expert-parallel tests, built locally from transformers'
configs (hidden 32, 4 or 8 experts, 2 layers): Qwen3-MoE, Mixtral and Qwen2-MoE (a shared
expert beside the routed ones), and their expert-parallel rules."""

from __future__ import annotations

import torch
from transformers import (
    MixtralConfig,
    MixtralForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

import meshtrain as mt

VOCAB = 64
_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    use_cache=False,
)


def qwen3_moe(experts: int = 8) -> Qwen3MoeForCausalLM:
    config = Qwen3MoeConfig(
        **_COMMON,
        head_dim=8,
        moe_intermediate_size=16,
        num_experts=experts,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    )
    return Qwen3MoeForCausalLM(config)


def qwen3_moe_4() -> Qwen3MoeForCausalLM:
    return qwen3_moe(4)


def mixtral() -> MixtralForCausalLM:
    config = MixtralConfig(**_COMMON, num_local_experts=4, num_experts_per_tok=2)
    return MixtralForCausalLM(config)


def qwen2_moe() -> Qwen2MoeForCausalLM:
    config = Qwen2MoeConfig(
        **_COMMON,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    )
    return Qwen2MoeForCausalLM(config)


def ep_rules(fsdp: str | tuple[str, ...] = ("dp",), axis: str = "ep") -> mt.Rules:
    """Expert weights over ``axis``, everything else data-parallel."""
    return mt.Rules(
        {r".*\.experts\.(gate_up_proj|down_proj)": mt.P(axis, None, None), ".*": mt.P()}, fsdp=fsdp
    )


def token_batches(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A global batch of 8 sequences of 8 token ids and their next tokens."""
    tokens = torch.randint(0, VOCAB, (8, 9), generator=torch.Generator().manual_seed(300 + step))
    return tokens[:, :-1], tokens[:, 1:]


def meshtrain_moe() -> torch.nn.Module:
    """meshtrain's reference MoE, tiny: ``MoEConfig.debug`` (a dense first layer, 8 experts of
    width 32, top-2, one shared expert) over this file's vocabulary."""
    from meshtrain.models import MoEConfig, build_moe

    return build_moe(MoEConfig.debug(vocab_size=VOCAB), seed=0)
