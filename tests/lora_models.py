"""Models with LoRA adapters for the tier-2 tests, built at module level so ranks can import
them: meshtrain's debug Llama and a tiny Hugging Face Llama (random, from a config), adapters on
attention and MLP projections, ``lora_B`` drawn non-zero so the low-rank path carries signal
from the first step (a fresh adapter's B is zero, which would leave lora_A untrained at step 1)."""

from __future__ import annotations

import torch
import zoo
from torch import nn

from meshtrain.adapters import LoRALinear, lora
from meshtrain.models import LlamaConfig, build_llama

LLAMA_TARGETS = [r"layers\.\d+\.attention\.w[qkvo]", r"layers\.\d+\.feed_forward\.w[123]"]
HF_TARGETS = [
    r"model\.layers\.\d+\.self_attn\.(q|k|v|o)_proj",
    r"model\.layers\.\d+\.mlp\.\w+_proj",
]


def _perturb(model: nn.Module) -> nn.Module:
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, LoRALinear):
                module.lora_B.normal_(0.0, 0.02)
    return model


def llama_lora() -> nn.Module:
    model = build_llama(LlamaConfig.debug())
    return _perturb(lora(model, rank=4, alpha=8, targets=LLAMA_TARGETS))


def hf_llama_lora() -> nn.Module:
    return _perturb(lora(zoo.llama(), rank=4, alpha=8, targets=HF_TARGETS))


def qlora_llama() -> nn.Module:
    """A Llama of dim 256 (NF4 quantizes blocks of 64 × 256 elements, and FSDP's dim-0 shards of
    its 256×256 attention weights keep whole blocks) with NF4 bases under the adapters."""
    config = LlamaConfig(
        dim=256, n_layers=2, n_heads=4, n_kv_heads=4, vocab_size=256, multiple_of=32, max_seq_len=64
    )
    model = build_llama(config)
    targets = [r"layers\.\d+\.attention\.w[qo]"]
    return _perturb(lora(model, rank=4, alpha=8, targets=targets, quantize_base="nf4"))
