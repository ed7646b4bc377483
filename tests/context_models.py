"""Tiny models for context-parallel tests, built locally (nothing downloaded): meshtrain's Llama
and ``transformers``' Llama, Qwen2 and Mistral (a sliding window shorter than the sequence),
hidden 32, 2 layers; their rules (parameters replicated, FSDP over ``dp``, the sequence over
``cp``) and token batches of 32-token sequences. Module level, so ranks can import them."""

from __future__ import annotations

import logging

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

import meshtrain as mt
from meshtrain.models import LlamaConfig as OwnLlamaConfig
from meshtrain.models import MoEConfig, build_llama, build_moe
from meshtrain.models.llama import LOGICAL_RULES

logging.getLogger("transformers").setLevel(logging.ERROR)

VOCAB = 128
SEQ = 32
WINDOW = 12  # Mistral's sliding window: shorter than a sequence, longer than a chunk
_SIZES = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    use_cache=False,
    attn_implementation="sdpa",
)


def own_llama() -> torch.nn.Module:
    config = OwnLlamaConfig(
        dim=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        vocab_size=VOCAB,
        multiple_of=32,
        max_seq_len=64,
    )
    return build_llama(config, seed=0)


def hf_llama() -> LlamaForCausalLM:
    return LlamaForCausalLM(LlamaConfig(**_SIZES))


def hf_qwen2() -> Qwen2ForCausalLM:
    return Qwen2ForCausalLM(Qwen2Config(**_SIZES))


def hf_mistral() -> MistralForCausalLM:
    return MistralForCausalLM(MistralConfig(**_SIZES, sliding_window=WINDOW))


def own_moe() -> torch.nn.Module:
    """meshtrain's MoE (Qwen3-style q/k norms, a dense first layer, a shared expert) with the
    balance loss on, whose token counts are the whole batch's: every chunk of every sequence."""
    config = MoEConfig.debug(dim=32, n_layers=2, vocab_size=VOCAB, balance="aux_loss")
    return build_moe(config, seed=0)


MODELS = {
    "llama": own_llama,
    "hf_llama": hf_llama,
    "qwen2": hf_qwen2,
    "mistral": hf_mistral,
    "moe": own_moe,
}


def rules(fsdp: tuple[str, ...] = ("dp",)) -> mt.Rules:
    """Every parameter replicated; FSDP over ``fsdp``; the sequence over ``cp``."""
    return mt.Rules({".*": mt.P()}, fsdp=fsdp, logical=[("seq", "cp")])


def tp_rules(name: str, fsdp: tuple[str, ...] = ()) -> mt.Rules:
    """Tensor parallelism over ``tp`` (meshtrain's Llama: its logical rules; transformers:
    their own tensor-parallel plan) with sequence parallelism inside each context chunk."""
    seq = ("seq", ("cp", "tp"))
    if name == "llama":
        return mt.Rules(logical=[*LOGICAL_RULES, seq], fsdp=fsdp)
    base = mt.Rules.from_hf(MODELS[name](), fsdp=fsdp, tp="tp")
    return mt.Rules(base.patterns, logical=[seq], fsdp=fsdp, gathered=base.gathered)


def batches(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A global batch of 4 sequences of 32 token ids and their next tokens."""
    generator = torch.Generator().manual_seed(300 + step)
    tokens = torch.randint(0, VOCAB, (4, SEQ + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]
