"""Models meshtrain did not write, built tiny and random from local configs (nothing downloaded),
with the rules a user would write for them from the docs: Hugging Face Llama, Qwen2, Qwen3, OLMo2,
GPT-2, BERT and ViT, and a small CNN with BatchNorm; beyond those, an encoder–decoder (BART, T5), fused
projections (GPT-NeoX, Phi-3), attention reshaped with global head counts (OPT) and soft-capping
(Gemma2). Factories live at module level so ranks can import them;
dropout is off (a model with dropout is not deterministic, see the harness's hint).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import (
    BartConfig,
    BartForConditionalGeneration,
    BertConfig,
    BertForMaskedLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Olmo2Config,
    Olmo2ForCausalLM,
    OPTConfig,
    OPTForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    T5Config,
    T5ForConditionalGeneration,
    ViTConfig,
    ViTForImageClassification,
)

from meshtrain import P, Rules

logging.getLogger("transformers").setLevel(logging.ERROR)  # tiny vocabularies: token-id warnings

VOCAB = 128


def llama() -> LlamaForCausalLM:
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            use_cache=False,
        )
    )


def qwen2() -> Qwen2ForCausalLM:
    return Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            use_cache=False,
        )
    )


def qwen3() -> Qwen3ForCausalLM:
    """Per-head q/k norms between the column- and row-wise projections (their TP plan:
    ``replicated_with_grad_allreduce``)."""
    return Qwen3ForCausalLM(
        Qwen3Config(
            vocab_size=VOCAB,
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


def olmo2() -> Olmo2ForCausalLM:
    """q/k norms over all heads' features (their TP plan: ``colwise_gather_output`` on q/k/v,
    ``rowwise_split_input`` on o)."""
    return Olmo2ForCausalLM(
        Olmo2Config(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            use_cache=False,
            eos_token_id=None,  # the default (50279) is outside the tiny vocabulary
            pad_token_id=1,
        )
    )


def _gpt2(tied: bool, dropout: float = 0.0) -> GPT2LMHeadModel:
    return GPT2LMHeadModel(
        GPT2Config(
            vocab_size=VOCAB,
            n_embd=32,
            n_layer=2,
            n_head=4,
            n_positions=64,
            use_cache=False,
            resid_pdrop=dropout,
            embd_pdrop=dropout,
            attn_pdrop=dropout,
            tie_word_embeddings=tied,
            bos_token_id=0,
            eos_token_id=0,
        )
    )


def gpt2() -> GPT2LMHeadModel:
    """GPT-2 as published: Conv1D projections, fused q/k/v, the head tied to the embedding."""
    return _gpt2(tied=True)


def gpt2_with_dropout() -> GPT2LMHeadModel:
    """GPT-2 with its published dropout (0.1): not deterministic across ranks."""
    return _gpt2(tied=True, dropout=0.1)


def gpt2_untied() -> GPT2LMHeadModel:
    """GPT-2 with its own head (tied weights cannot span pipeline stages)."""
    return _gpt2(tied=False)


def _bert(tied: bool) -> BertForMaskedLM:
    return BertForMaskedLM(
        BertConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=64,
            max_position_embeddings=64,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            tie_word_embeddings=tied,
        )
    )


def bert() -> BertForMaskedLM:
    """BERT for masked LM as published: q/k/v under attention.self, the output dense under
    attention.output, the decoder tied to the word embeddings (and its bias to the head's)."""
    return _bert(tied=True)


def bert_untied() -> BertForMaskedLM:
    return _bert(tied=False)


def vit() -> ViTForImageClassification:
    return ViTForImageClassification(
        ViTConfig(
            image_size=16,
            patch_size=4,
            num_channels=3,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=64,
            num_labels=10,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
    )


def bart() -> BartForConditionalGeneration:
    """An encoder–decoder: given only ``input_ids`` it feeds the decoder the inputs shifted right,
    so it trains on ``(tokens, next tokens)`` batches like a causal LM; tied embeddings."""
    return BartForConditionalGeneration(
        BartConfig(
            vocab_size=VOCAB,
            d_model=32,
            encoder_layers=1,
            decoder_layers=1,
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


class T5Seq2Seq(nn.Module):
    """T5 fed the way a user feeds it in a causal-LM loop: decoder inputs are the encoder's tokens
    shifted right (T5 takes no ``input_ids``-only call)."""

    def __init__(self) -> None:
        super().__init__()
        self.t5 = T5ForConditionalGeneration(
            T5Config(
                vocab_size=VOCAB,
                d_model=32,
                d_kv=8,
                d_ff=64,
                num_layers=1,
                num_decoder_layers=1,
                num_heads=4,
                relative_attention_num_buckets=8,
                dropout_rate=0.0,
                use_cache=False,
                decoder_start_token_id=0,
                pad_token_id=0,
                eos_token_id=1,
            )
        )

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        decoder = self.t5._shift_right(tokens)
        return self.t5(input_ids=tokens, decoder_input_ids=decoder).logits


def t5() -> T5Seq2Seq:
    return T5Seq2Seq()


def gpt_neox() -> GPTNeoXForCausalLM:
    """Fused q/k/v laid out per head (``[heads, 3, head_dim]``): column-wise by heads is exact."""
    return GPTNeoXForCausalLM(
        GPTNeoXConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=64,
            use_cache=False,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            bos_token_id=0,
            eos_token_id=0,
        )
    )


def phi3() -> Phi3ForCausalLM:
    """Fused ``qkv_proj`` (``[q; k; v]`` stacked) and ``gate_up_proj``: their TP plan gathers the
    fused outputs (``colwise_gather_output``)."""
    return Phi3ForCausalLM(
        Phi3Config(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            original_max_position_embeddings=64,
            use_cache=False,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attention_dropout=0.0,
            pad_token_id=0,
            bos_token_id=0,
            eos_token_id=0,
        )
    )


def opt() -> OPTForCausalLM:
    """OPT's attention reshapes with the global head count (``view(bsz, -1, num_heads, ...)``)."""
    return OPTForCausalLM(
        OPTConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            ffn_dim=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            word_embed_proj_dim=32,
            max_position_embeddings=64,
            dropout=0.0,
            attention_dropout=0.0,
            activation_dropout=0.0,
            layerdrop=0.0,
            use_cache=False,
            pad_token_id=1,
            bos_token_id=0,
            eos_token_id=0,
        )
    )


def gemma2() -> Gemma2ForCausalLM:
    """Soft-capped attention scores and final logits (``tanh(x / cap) * cap``)."""
    return Gemma2ForCausalLM(
        Gemma2Config(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            max_position_embeddings=64,
            sliding_window=8,
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
            use_cache=False,
            pad_token_id=0,
            bos_token_id=0,
            eos_token_id=1,
        )
    )


class ConvBlock(nn.Module):
    """Conv → BatchNorm → ReLU with a residual connection."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.norm = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.norm(self.conv(x)))


class SmallCNN(nn.Module):
    """A stem, a ModuleList of residual conv blocks with BatchNorm, pooling and a classifier."""

    def __init__(self, channels: int = 8, n_blocks: int = 2, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, channels, 3, padding=1), nn.BatchNorm2d(channels))
        self.blocks = nn.ModuleList(ConvBlock(channels) for _ in range(n_blocks))
        self.head = nn.Linear(channels, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        h = self.stem(images)
        for block in self.blocks:
            h = block(h)
        return self.head(h.mean(dim=(2, 3)))


def cnn() -> SmallCNN:
    return SmallCNN()


# ---------------------------------------------------------------- rules, as the docs teach


def hf_rules(model: nn.Module, *, sequence_parallel: bool = False) -> Rules:
    """The model's own plan (Llama, Qwen2, Qwen3, OLMo2, Phi-3, Gemma2, GPT-NeoX)."""
    return Rules.from_hf(model, fsdp="dp", sequence_parallel=sequence_parallel)


GPT2_RULES = Rules(
    {  # Conv1D weights are [in, out]: column-wise shards dim 1; c_attn is fused
        r"transformer\.wte\.weight": P("tp", None),
        r"transformer\.h\.\d+\.mlp\.c_fc\.weight": P(None, "tp"),
        r"transformer\.h\.\d+\.mlp\.c_fc\.bias": P("tp"),
        r"transformer\.h\.\d+\.mlp\.c_proj\.weight": P("tp", None),
        r".*": P(),
    },
    fsdp="dp",
)

BERT_RULES = Rules(
    {
        r"bert\.embeddings\.word_embeddings\.weight": P("tp", None),
        r".*\.attention\.self\.(query|key|value)\.weight": P("tp", None),
        r".*\.attention\.self\.(query|key|value)\.bias": P("tp"),
        r".*\.attention\.output\.dense\.weight": P(None, "tp"),
        r".*\.intermediate\.dense\.weight": P("tp", None),
        r".*\.intermediate\.dense\.bias": P("tp"),
        r".*\.layer\.\d+\.output\.dense\.weight": P(None, "tp"),
        r"cls\.predictions\.bias": P("tp"),
        r".*": P(),
    },
    fsdp="dp",
)

BERT_UNTIED_RULES = Rules(
    {  # the decoder has its own weight and bias; cls.predictions.bias is unused
        **{
            pattern: spec
            for pattern, spec in BERT_RULES.patterns
            if "cls" not in pattern and pattern != ".*"
        },
        r"cls\.predictions\.decoder\.weight": P("tp", None),
        r"cls\.predictions\.decoder\.bias": P("tp"),
        r".*": P(),
    },
    fsdp="dp",
)

VIT_RULES = Rules(
    {
        r".*\.attention\.(q|k|v)_proj\.weight": P("tp", None),
        r".*\.attention\.(q|k|v)_proj\.bias": P("tp"),
        r".*\.attention\.o_proj\.weight": P(None, "tp"),
        r".*\.mlp\.fc1\.weight": P("tp", None),
        r".*\.mlp\.fc1\.bias": P("tp"),
        r".*\.mlp\.fc2\.weight": P(None, "tp"),
        r".*": P(),
    },
    fsdp="dp",
)

OPT_RULES = Rules(
    {  # Megatron's pairs, as for Llama: q/k/v and fc1 column-wise, out_proj and fc2 row-wise
        r".*\.self_attn\.(q|k|v)_proj\.weight": P("tp", None),
        r".*\.self_attn\.(q|k|v)_proj\.bias": P("tp"),
        r".*\.self_attn\.out_proj\.weight": P(None, "tp"),
        r".*\.fc1\.weight": P("tp", None),
        r".*\.fc1\.bias": P("tp"),
        r".*\.fc2\.weight": P(None, "tp"),
        r".*": P(),
    },
    fsdp="dp",
)

BART_RULES = Rules(
    {  # every attention (encoder, decoder, cross) and feed-forward pair; OPT's patterns fit
        **{pattern: spec for pattern, spec in OPT_RULES.patterns if pattern != ".*"},
        r".*\.encoder_attn\.(q|k|v)_proj\.weight": P("tp", None),
        r".*\.encoder_attn\.(q|k|v)_proj\.bias": P("tp"),
        r".*\.encoder_attn\.out_proj\.weight": P(None, "tp"),
        r".*": P(),
    },
    fsdp="dp",
)

T5_RULES = Rules(
    {
        r".*\.(SelfAttention|EncDecAttention)\.(q|k|v)\.weight": P("tp", None),
        r".*\.(SelfAttention|EncDecAttention)\.o\.weight": P(None, "tp"),
        r".*\.DenseReluDense\.wi\.weight": P("tp", None),
        r".*\.DenseReluDense\.wo\.weight": P(None, "tp"),
        r".*": P(),
    },
    fsdp="dp",
)

REPLICATED = Rules({r".*": P()}, fsdp="dp")


def with_sequence_parallelism(rules: Rules) -> Rules:
    return Rules(rules.patterns, logical=[("seq", "tp")], fsdp=rules.fsdp)


def without_data_axes(rules: Rules) -> Rules:
    """The same rules for a mesh without a data axis (pipeline × tensor parallel)."""
    return Rules(rules.patterns, logical=rules.logical)


# ---------------------------------------------------------------- batches


def token_batches(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A global batch of 8 sequences of 16 token ids and their next tokens."""
    tokens = torch.randint(0, VOCAB, (8, 17), generator=torch.Generator().manual_seed(100 + step))
    return tokens[:, :-1], tokens[:, 1:]


def image_batches(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A global batch of 8 random 16×16 RGB images and their labels."""
    generator = torch.Generator().manual_seed(200 + step)
    return torch.randn(8, 3, 16, 16, generator=generator), torch.randint(
        0, 10, (8,), generator=generator
    )


def counted_step(
    model: nn.Module, rules: Rules, axes: dict[str, int], **options: Any
) -> tuple[dict, dict, dict, dict]:
    """On every rank: plan and apply ``model`` (a causal LM: a Hugging Face one, whose output has
    ``logits``, or one that returns them) on ``axes`` with ``options`` (``zero``,
    ``microbatches``), take one warm-up step, then count the collectives of a second one;
    returns the counts, the plan's predicted counts, the payload bytes and the predicted bytes,
    by (kind, axis)."""
    import meshtrain as mt
    from meshtrain.testing.comms import CollectiveCounter

    mesh = mt.make_mesh(axes)
    plan = mt.plan(model, mesh, rules, batch_size=2, seq_len=16, **options)
    mt.apply(plan, model)
    inputs, targets = token_batches(0)
    first = 2 * mesh.coordinates(torch.distributed.get_rank()).get("dp", 0)
    mine = slice(first, first + 2)  # batch_size 2 per data-parallel rank, as planned
    micro = plan.options.microbatches

    def step() -> None:
        for i in range(micro):
            with mt.micro_batch(plan, model, last=i == micro - 1), mt.loss_parallel(plan):
                output = model(inputs[mine])
                logits = output.logits if hasattr(output, "logits") else output
                F.cross_entropy(logits.flatten(0, 1), targets[mine].flatten()).backward()

    step()
    model.zero_grad()
    with CollectiveCounter(mesh) as counter:
        step()
    totals = plan.collective_totals()
    predicted = {k: n for k, (n, _) in totals.items()}
    predicted_bytes = {k: b for k, (_, b) in totals.items()}
    return dict(counter.counts), predicted, dict(counter.bytes), predicted_bytes
