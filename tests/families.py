"""Eleven Hugging Face families the project's own zoo does not use, built tiny and random from
local configs (nothing downloaded, dropout off): Mistral, Phi-3, Gemma2, GPT-NeoX, OPT,
Qwen2-MoE, Mixtral, T5, BART, DistilBERT and RoBERTa. Factories live at module level so ranks can
import them; encoder–decoders are wrapped so one tensor of token ids feeds both sides.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import (
    BartConfig,
    BartForConditionalGeneration,
    DistilBertConfig,
    DistilBertForMaskedLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    OPTConfig,
    OPTForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    RobertaConfig,
    RobertaForMaskedLM,
    T5Config,
    T5ForConditionalGeneration,
)

VOCAB = 128
SMALL: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 64,
    "max_position_embeddings": 64,
}


def mistral() -> nn.Module:
    return MistralForCausalLM(MistralConfig(**SMALL, num_key_value_heads=2, use_cache=False))


def phi3() -> nn.Module:
    return Phi3ForCausalLM(
        Phi3Config(
            **SMALL,
            num_key_value_heads=2,
            use_cache=False,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attention_dropout=0.0,
        )
    )


def gemma2() -> nn.Module:
    return Gemma2ForCausalLM(
        Gemma2Config(
            **SMALL,
            num_key_value_heads=2,
            head_dim=8,
            use_cache=False,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        )
    )


def gpt_neox() -> nn.Module:
    return GPTNeoXForCausalLM(
        GPTNeoXConfig(
            **SMALL,
            use_cache=False,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            bos_token_id=0,
            eos_token_id=0,
        )
    )


def opt() -> nn.Module:
    return OPTForCausalLM(
        OPTConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=2,
            ffn_dim=64,
            num_attention_heads=4,
            max_position_embeddings=64,
            word_embed_proj_dim=32,
            dropout=0.0,
            attention_dropout=0.0,
            activation_dropout=0.0,
            layerdrop=0.0,
            use_cache=False,
            pad_token_id=1,
            bos_token_id=2,
            eos_token_id=2,
        )
    )


def qwen2_moe() -> nn.Module:
    return Qwen2MoeForCausalLM(
        Qwen2MoeConfig(
            **SMALL,
            num_key_value_heads=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
            num_experts=4,
            num_experts_per_tok=2,
            use_cache=False,
        )
    )


def mixtral() -> nn.Module:
    return MixtralForCausalLM(
        MixtralConfig(
            **SMALL,
            num_key_value_heads=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            use_cache=False,
        )
    )


class Seq2Seq(nn.Module):
    """An encoder–decoder fed one tensor: the tokens go to the encoder and, as the decoder's
    inputs, to the decoder; returns the logits."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=tokens, decoder_input_ids=tokens).logits


def t5() -> nn.Module:
    return Seq2Seq(
        T5ForConditionalGeneration(
            T5Config(
                vocab_size=VOCAB,
                d_model=32,
                d_kv=8,
                d_ff=64,
                num_layers=2,
                num_decoder_layers=2,
                num_heads=4,
                dropout_rate=0.0,
                use_cache=False,
                decoder_start_token_id=0,
                pad_token_id=0,
                eos_token_id=1,
            )
        )
    )


def bart() -> nn.Module:
    return Seq2Seq(
        BartForConditionalGeneration(
            BartConfig(
                vocab_size=VOCAB,
                d_model=32,
                encoder_layers=2,
                decoder_layers=2,
                encoder_attention_heads=4,
                decoder_attention_heads=4,
                encoder_ffn_dim=64,
                decoder_ffn_dim=64,
                max_position_embeddings=64,
                dropout=0.0,
                attention_dropout=0.0,
                activation_dropout=0.0,
                use_cache=False,
                pad_token_id=1,
                bos_token_id=0,
                eos_token_id=2,
                decoder_start_token_id=2,
                forced_eos_token_id=None,
            )
        )
    )


def distilbert() -> nn.Module:
    return DistilBertForMaskedLM(
        DistilBertConfig(
            vocab_size=VOCAB,
            dim=32,
            n_layers=2,
            n_heads=4,
            hidden_dim=64,
            max_position_embeddings=64,
            dropout=0.0,
            attention_dropout=0.0,
            pad_token_id=0,
        )
    )


def roberta() -> nn.Module:
    return RobertaForMaskedLM(
        RobertaConfig(
            **SMALL,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            pad_token_id=1,
            type_vocab_size=2,
        )
    )


FAMILIES = {
    "mistral": mistral,
    "phi3": phi3,
    "gemma2": gemma2,
    "gpt-neox": gpt_neox,
    "opt": opt,
    "qwen2-moe": qwen2_moe,
    "mixtral": mixtral,
    "t5": t5,
    "bart": bart,
    "distilbert": distilbert,
    "roberta": roberta,
}


def token_batches(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """8 sequences of 16 token ids (from 3: clear of pad/bos/eos ids) and their next tokens."""
    tokens = torch.randint(3, VOCAB, (8, 17), generator=torch.Generator().manual_seed(500 + step))
    return tokens[:, :-1], tokens[:, 1:]
