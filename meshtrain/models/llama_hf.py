"""meshtrain's Llama ⇄ Hugging Face ``LlamaForCausalLM``: configs, names and the rotary layout.

The two models compute the same function with differently laid out weights:

==============================================  ==============================================
meshtrain (torchtitan names)                    transformers
==============================================  ==============================================
``tok_embeddings.weight``                       ``model.embed_tokens.weight``
``layers.<i>.attention.wq/wk/wv/wo.weight``     ``model.layers.<i>.self_attn.q/k/v/o_proj.weight``
``layers.<i>.feed_forward.w1/w3/w2.weight``     ``model.layers.<i>.mlp.gate/up/down_proj.weight``
``layers.<i>.attention_norm.weight``            ``model.layers.<i>.input_layernorm.weight``
``layers.<i>.ffn_norm.weight``                  ``model.layers.<i>.post_attention_layernorm.weight``
``norm.weight``, ``output.weight``              ``model.norm.weight``, ``lm_head.weight``
==============================================  ==============================================

Neither model fuses q/k/v or gate/up, so every tensor maps to one tensor of the same shape. The
one layout difference is rotary: meshtrain rotates adjacent pairs ``(x[2i], x[2i+1])`` of each
head (Meta's layout), transformers rotates halves (``rotate_half``: ``x[i]`` with
``x[i + head_dim/2]``). Permuting the rows of ``wq`` and ``wk`` within each head turns one into
the other — what transformers' own ``convert_llama_weights_to_hf`` does — so :func:`rotary_rows`
is a row order, applied when reading (only this rank's rows) and inverted when writing. A tied
checkpoint (``tie_word_embeddings``) has no ``lm_head.weight``: meshtrain's untied ``output``
then reads ``model.embed_tokens.weight``. Exports are untied.

Pure: no ``transformers`` import; configs are the dicts of ``config.json``.

Example:
    >>> config = LlamaConfig.debug()
    >>> hf_sources(config)["layers.0.attention.wk.weight"][0]
    'model.layers.0.self_attn.k_proj.weight'
    >>> llama_config_from_hf(hf_config_from_llama(config)).ffn_dim == config.ffn_dim
    True
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from meshtrain.errors import CheckpointError
from meshtrain.models.llama import LlamaConfig

__all__ = [
    "hf_config_from_llama",
    "hf_sources",
    "llama_config_from_hf",
    "llama_to_hf",
    "rotary_rows",
]

_LAYER_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_TOP_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def rotary_rows(n_heads: int, head_dim: int) -> Tensor:
    """For each row of a meshtrain ``wq``/``wk`` (``n_heads · head_dim`` rows), the row of the
    transformers weight it holds: row ``2i + c`` of a head is row ``c · head_dim/2 + i`` there.

    Example:
        >>> rotary_rows(1, 4).tolist()
        [0, 2, 1, 3]
    """
    half = head_dim // 2
    within = torch.arange(head_dim).view(2, half).t().reshape(-1)  # [0, half, 1, half+1, ...]
    return (torch.arange(n_heads)[:, None] * head_dim + within[None, :]).reshape(-1)


def hf_sources(config: LlamaConfig, *, tied: bool = False) -> dict[str, tuple[str, Tensor | None]]:
    """meshtrain FQN → (transformers name, row order or ``None``) for loading a transformers
    checkpoint into a :class:`~meshtrain.models.llama.Llama`. ``tied``: the checkpoint ties the
    head to the embedding, so ``output.weight`` reads ``model.embed_tokens.weight``."""
    sources: dict[str, tuple[str, Tensor | None]] = {
        name: (hf_name, None) for name, hf_name in _TOP_NAMES.items()
    }
    if tied:
        sources["output.weight"] = (_TOP_NAMES["tok_embeddings.weight"], None)
    q_rows = rotary_rows(config.n_heads, config.head_dim)
    k_rows = rotary_rows(config.n_kv_heads, config.head_dim)
    for layer in range(config.n_layers):
        for name, hf_name in _LAYER_NAMES.items():
            rows = q_rows if name == "attention.wq.weight" else None
            rows = k_rows if name == "attention.wk.weight" else rows
            sources[f"layers.{layer}.{name}"] = (f"model.layers.{layer}.{hf_name}", rows)
    return sources


def llama_to_hf(config: LlamaConfig, fqn: str, tensor: Tensor) -> list[tuple[str, Tensor]]:
    """One meshtrain tensor (full) as the transformers tensor it becomes: renamed, and for
    ``wq``/``wk`` with rows put back in transformers' rotary order.

    Example:
        >>> config = LlamaConfig.debug()
        >>> [name for name, _ in llama_to_hf(config, "norm.weight", torch.ones(64))]
        ['model.norm.weight']
    """
    parts = fqn.split(".")
    if fqn in _TOP_NAMES:
        return [(_TOP_NAMES[fqn], tensor)]
    rest = ".".join(parts[2:])
    if len(parts) < 3 or parts[0] != "layers" or rest not in _LAYER_NAMES:
        raise CheckpointError(
            f"{fqn!r} is not a parameter of meshtrain's Llama, so it has no transformers name. "
            "Export a checkpoint of a Llama run, or pass a transform that maps or drops it."
        )
    heads = {"attention.wq.weight": config.n_heads, "attention.wk.weight": config.n_kv_heads}
    if rest in heads:
        rows = rotary_rows(heads[rest], config.head_dim)
        tensor = torch.empty_like(tensor).index_copy_(0, rows, tensor)
    return [(f"model.layers.{parts[1]}.{_LAYER_NAMES[rest]}", tensor)]


def hf_config_from_llama(config: LlamaConfig) -> dict[str, Any]:
    """The ``config.json`` of a ``LlamaForCausalLM`` with ``config``'s shapes (untied).

    Example:
        >>> hf_config_from_llama(LlamaConfig.debug())["intermediate_size"]
        192
    """
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": config.dim,
        "intermediate_size": config.ffn_dim,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_kv_heads,
        "head_dim": config.head_dim,
        "vocab_size": config.vocab_size,
        "rms_norm_eps": config.norm_eps,
        "rope_theta": config.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "max_position_embeddings": config.max_seq_len,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "dtype": "float32",
    }


def llama_config_from_hf(hf: Mapping[str, Any], source: str = "config.json") -> LlamaConfig:
    """The :class:`LlamaConfig` of a ``LlamaForCausalLM`` ``config.json``; a
    :class:`CheckpointError` naming ``source`` for what meshtrain's Llama cannot compute the same
    way (biases, another activation, rope scaling, a head width other than hidden / heads).

    ``multiple_of`` is the intermediate size and ``ffn_dim_multiplier`` its ratio to Llama's
    ``8·dim/3``, so ``ffn_dim`` comes out as the checkpoint's width.

    Example:
        >>> llama_config_from_hf({"hidden_size": 64, "intermediate_size": 128,
        ...     "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        ...     "vocab_size": 256}).ffn_dim
        128
    """
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    unsupported = {
        "attention_bias": bool(hf.get("attention_bias", False)),
        "mlp_bias": bool(hf.get("mlp_bias", False)),
        "hidden_act": hf.get("hidden_act", "silu") != "silu",
        "rope type": rope.get("rope_type", rope.get("type", "default")) != "default",
    }
    dim, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    unsupported["head_dim"] = int(hf.get("head_dim") or dim // heads) * heads != dim
    bad = [name for name, is_bad in unsupported.items() if is_bad]
    if bad:
        raise CheckpointError(
            f"{source}: meshtrain's Llama cannot compute this model the same way ({', '.join(bad)} "
            "differ from Llama 3's). Train it as the transformers model itself: "
            '[model] hf = "DIR" in the recipe.'
        )
    hidden = int(2 * 4 * dim / 3)
    width = int(hf["intermediate_size"])
    base = LlamaConfig(dim=dim, n_layers=1, n_heads=heads, n_kv_heads=heads, vocab_size=1)
    return dataclasses.replace(
        base,
        n_layers=int(hf["num_hidden_layers"]),
        n_kv_heads=int(hf.get("num_key_value_heads") or heads),
        vocab_size=int(hf["vocab_size"]),
        multiple_of=width,
        ffn_dim_multiplier=width / hidden,
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        max_seq_len=int(hf.get("max_position_embeddings", 2048)),
    )
