"""meshtrain's MoE ⇄ Hugging Face ``Qwen3MoeForCausalLM``: configs, names and the rotary layout.

The Llama's table (:mod:`meshtrain.models.llama_hf`) with the MoE's own tensors:

====================================================  ==============================================
meshtrain                                             transformers (Qwen3-MoE layout)
====================================================  ==============================================
``layers.<i>.attention.q_norm/k_norm.weight``         ``model.layers.<i>.self_attn.q_norm/k_norm.weight``
``layers.<i>.feed_forward.router.weight``             ``model.layers.<i>.mlp.gate.weight``
``layers.<i>.feed_forward.experts.gate_up_proj``      ``model.layers.<i>.mlp.experts.gate_up_proj``
``layers.<i>.feed_forward.experts.down_proj``         ``model.layers.<i>.mlp.experts.down_proj``
``layers.<i>.feed_forward.shared_expert.w1/w3/w2``    ``model.layers.<i>.mlp.shared_expert.gate/up/down_proj``
``layers.<i>.feed_forward.w1/w3/w2`` (dense layers)   ``model.layers.<i>.mlp.gate/up/down_proj``
====================================================  ==============================================

Expert weights have the same fused layout on both sides, so they map whole. That fused layout is
what a transformers model holds in memory (its ``state_dict()``); ``save_pretrained`` (and the
published Qwen3-MoE checkpoints) store one 2-D tensor per expert instead
(``mlp.experts.<e>.gate_proj.weight``, ...): the loader finds those for a fused name the
checkpoint lacks and assembles the fused weight from them, each rank reading only the experts it
holds (:mod:`meshtrain.train.hf.experts`). The rotary row order
of ``wq``/``wk`` (:func:`~meshtrain.models.llama_hf.rotary_rows`) also permutes the per-head
``q_norm``/``k_norm`` weights (they scale the same head dims before the rotation). The dense first
layers are Qwen3-MoE's ``mlp_only_layers``.

What maps to ``Qwen3MoeForCausalLM`` and what does not: the config must use softmax scores,
``route_scale`` 1, no bias balancing (Qwen3-MoE has no score-correction bias) and per-head q/k
norms; a shared expert is named as Qwen2-MoE names its ``shared_expert`` (meshtrain has no
``shared_expert_gate``), so a model with shared experts has names but no transformers config to
export to. :func:`hf_config_from_moe` refuses the rest by name.

Pure: no ``transformers`` import; configs are the dicts of ``config.json``.

Example:
    >>> config = MoEConfig.debug(n_shared_experts=0, qk_norm=True)
    >>> moe_hf_sources(config)["layers.1.feed_forward.router.weight"][0]
    'model.layers.1.mlp.gate.weight'
    >>> moe_config_from_hf(hf_config_from_moe(config)) == config
    True
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from meshtrain.errors import CheckpointError
from meshtrain.models.llama_hf import hf_sources, llama_to_hf, rotary_rows
from meshtrain.models.moe import MoEConfig

__all__ = [
    "check_moe_config",
    "hf_config_from_moe",
    "moe_config_from_hf",
    "moe_hf_sources",
    "moe_to_hf",
]

_ATTENTION = (
    "attention.wq.weight",
    "attention.wk.weight",
    "attention.wv.weight",
    "attention.wo.weight",
    "attention_norm.weight",
    "ffn_norm.weight",
)
_DENSE = ("feed_forward.w1.weight", "feed_forward.w3.weight", "feed_forward.w2.weight")
_QK_NORMS = {
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
}
_ROUTED = {
    "feed_forward.router.weight": "mlp.gate.weight",
    "feed_forward.experts.gate_up_proj": "mlp.experts.gate_up_proj",
    "feed_forward.experts.down_proj": "mlp.experts.down_proj",
}
_SHARED = {
    "feed_forward.shared_expert.w1.weight": "mlp.shared_expert.gate_proj.weight",
    "feed_forward.shared_expert.w3.weight": "mlp.shared_expert.up_proj.weight",
    "feed_forward.shared_expert.w2.weight": "mlp.shared_expert.down_proj.weight",
}


def _layer_names(config: MoEConfig, layer: int) -> dict[str, str]:
    """meshtrain name (within block ``layer``) → transformers name, for the MoE-only tensors."""
    names = dict(_QK_NORMS) if config.qk_norm else {}
    if config.is_moe_layer(layer):
        names.update(_ROUTED)
        names.update(_SHARED if config.n_shared_experts else {})
    return names


def moe_hf_sources(
    config: MoEConfig, *, tied: bool = False
) -> dict[str, tuple[str, Tensor | None]]:
    """meshtrain FQN → (transformers name, row order or ``None``) for loading a transformers
    checkpoint into a :class:`~meshtrain.models.moe.MoE` (``load_hf``'s ``sources``)."""
    llama = hf_sources(config.llama(), tied=tied)
    sources = {fqn: source for fqn, source in llama.items() if _kept(config, fqn)}
    head_rows = rotary_rows(1, config.head_dim)
    for layer in range(config.n_layers):
        for name, hf_name in _layer_names(config, layer).items():
            rows = head_rows if name in _QK_NORMS else None
            sources[f"layers.{layer}.{name}"] = (f"model.layers.{layer}.{hf_name}", rows)
    return sources


def _kept(config: MoEConfig, fqn: str) -> bool:
    """Whether a Llama FQN exists in the MoE: all but a routed layer's dense feed-forward."""
    parts = fqn.split(".")
    if parts[0] != "layers" or ".".join(parts[2:]) not in _DENSE:
        return True
    return not config.is_moe_layer(int(parts[1]))


def moe_to_hf(config: MoEConfig, fqn: str, tensor: Tensor) -> list[tuple[str, Tensor]]:
    """One meshtrain tensor (full) as the transformers tensor it becomes (export's ``rename``).

    Example:
        >>> config = MoEConfig.debug()
        >>> [n for n, _ in moe_to_hf(config, "layers.2.feed_forward.experts.down_proj", torch.ones(1))]
        ['model.layers.2.mlp.experts.down_proj']
    """
    parts = fqn.split(".")
    if len(parts) > 2 and parts[0] == "layers" and parts[1].isdigit():
        rest, layer = ".".join(parts[2:]), int(parts[1])
        names = _layer_names(config, layer) if layer < config.n_layers else {}
        if rest in names:
            if rest in _QK_NORMS:
                rows = rotary_rows(1, config.head_dim)
                tensor = torch.empty_like(tensor).index_copy_(0, rows, tensor)
            return [(f"model.layers.{layer}.{names[rest]}", tensor)]
        if not _kept(config, fqn):
            raise _unknown(fqn)
    try:
        return llama_to_hf(config.llama(), fqn, tensor)
    except CheckpointError:
        raise _unknown(fqn) from None


def _unknown(fqn: str) -> CheckpointError:
    return CheckpointError(
        f"{fqn!r} is not a parameter of meshtrain's MoE with this MoEConfig, so it has no "
        "transformers name. Export a checkpoint of a run of this model, or pass a transform "
        "that maps or drops it."
    )


def hf_config_from_moe(config: MoEConfig) -> dict[str, Any]:
    """The ``config.json`` of a ``Qwen3MoeForCausalLM`` with ``config``'s shapes and routing; a
    :class:`CheckpointError` naming what Qwen3-MoE cannot express.

    Example:
        >>> hf_config_from_moe(MoEConfig.debug(n_shared_experts=0, qk_norm=True))["mlp_only_layers"]
        [0]
    """
    unsupported = {
        f"n_shared_experts={config.n_shared_experts} (Qwen3-MoE has no shared expert)": (
            config.n_shared_experts > 0
        ),
        f"score_func={config.score_func!r} (softmax only)": config.score_func != "softmax",
        f"route_scale={config.route_scale} (1 only)": config.route_scale != 1.0,
        'balance="bias" (no score-correction bias)': config.balance == "bias",
        "qk_norm=False (Qwen3 normalises q and k per head)": not config.qk_norm,
    }
    bad = [name for name, is_bad in unsupported.items() if is_bad]
    if bad:
        raise CheckpointError(
            f"MoEConfig cannot be written as a Qwen3MoeForCausalLM: {'; '.join(bad)}. Export a "
            "model configured like Qwen3-MoE, or keep meshtrain's own checkpoint."
        )
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": config.dim,
        "intermediate_size": config.dense_inter or config.moe_inter,
        "moe_intermediate_size": config.moe_inter,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_kv_heads,
        "head_dim": config.head_dim,
        "num_experts": config.n_experts,
        "num_experts_per_tok": config.top_k,
        "norm_topk_prob": config.norm_topk_prob,
        "decoder_sparse_step": 1,
        "mlp_only_layers": list(range(config.first_dense_layers)),
        "router_aux_loss_coef": config.aux_loss_coef if config.balance == "aux_loss" else 0.0,
        "vocab_size": config.vocab_size,
        "rms_norm_eps": config.norm_eps,
        "rope_theta": config.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "max_position_embeddings": config.max_seq_len,
        "hidden_act": "silu",
        "attention_bias": False,
        "use_sliding_window": False,
        "tie_word_embeddings": False,
        "dtype": "float32",
    }


def moe_config_from_hf(hf: Mapping[str, Any], source: str = "config.json") -> MoEConfig:
    """The :class:`MoEConfig` of a ``Qwen3MoeForCausalLM`` ``config.json``; a
    :class:`CheckpointError` naming ``source`` for what meshtrain's MoE cannot compute the same
    way (another model type, biases, another activation, rope scaling, sliding windows, sparse
    layers other than "all after the first dense ones", a head width other than hidden / heads).
    ``balance`` is ``"aux_loss"`` when ``router_aux_loss_coef`` is positive.
    """
    dim, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    dense = sorted(int(layer) for layer in hf.get("mlp_only_layers") or [])
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    unsupported = {
        "model_type": hf.get("model_type", "qwen3_moe") != "qwen3_moe",
        "attention_bias": bool(hf.get("attention_bias", False)),
        "hidden_act": hf.get("hidden_act", "silu") != "silu",
        "rope type": rope.get("rope_type", rope.get("type", "default")) != "default",
        "sliding window": bool(hf.get("use_sliding_window", False)),
        "decoder_sparse_step": int(hf.get("decoder_sparse_step", 1)) != 1,
        "mlp_only_layers": dense != list(range(len(dense))),
        "head_dim": int(hf.get("head_dim") or dim // heads) * heads != dim,
    }
    bad = [name for name, is_bad in unsupported.items() if is_bad]
    if bad:
        raise CheckpointError(
            f"{source}: meshtrain's MoE cannot compute this model the same way ({', '.join(bad)} "
            "differ from what it models). Train it as the transformers model itself: "
            '[model] hf = "DIR" in the recipe.'
        )
    coef = float(hf.get("router_aux_loss_coef", 0.0))
    return MoEConfig(
        dim=dim,
        n_layers=int(hf["num_hidden_layers"]),
        n_heads=heads,
        n_kv_heads=int(hf.get("num_key_value_heads") or heads),
        vocab_size=int(hf["vocab_size"]),
        n_experts=int(hf.get("num_experts") or hf["num_local_experts"]),
        top_k=int(hf["num_experts_per_tok"]),
        moe_inter=int(hf["moe_intermediate_size"]),
        first_dense_layers=len(dense),
        dense_inter=int(hf["intermediate_size"]) if dense else 0,
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        balance="aux_loss" if coef > 0 else "none",
        aux_loss_coef=coef if coef > 0 else 0.001,
        qk_norm=True,
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        max_seq_len=int(hf.get("max_position_embeddings", 2048)),
    )


#: MoEConfig fields that are training settings, not the function a checkpoint computes.
_TRAINING_FIELDS = frozenset({"balance", "aux_loss_coef", "bias_update_rate", "kernel"})


def check_moe_config(config: MoEConfig, hf: Mapping[str, Any], source: str) -> None:
    """Refuse (:class:`CheckpointError`) a transformers ``config.json`` (``hf``, read from
    ``source``) that is not a Qwen3-MoE meshtrain's MoE computes, or not the same model as
    ``config``: each differing field with both values. Balancing settings may differ (a
    checkpoint's routers train on under any balance).

    Example:
        >>> config = MoEConfig.debug(n_shared_experts=0, qk_norm=True)
        >>> check_moe_config(config, hf_config_from_moe(config), "config.json")
        >>> check_moe_config(MoEConfig.debug(n_shared_experts=0, qk_norm=True, top_k=3),
        ...                  hf_config_from_moe(config), "ckpt/config.json")
        Traceback (most recent call last):
        ...
        meshtrain.errors.CheckpointError: the model differs from the one 'ckpt/config.json' describes: top_k = 3 here but 2 there. Set [model] top_k to match, or give another init_from, or use [model] hf = DIR to train the transformers model itself.
    """
    theirs = moe_config_from_hf(hf, source)
    differ = [
        field
        for field in MoEConfig.__dataclass_fields__
        if field not in _TRAINING_FIELDS and getattr(config, field) != getattr(theirs, field)
    ]
    if differ:
        values = "; ".join(
            f"{name} = {getattr(config, name)!r} here but {getattr(theirs, name)!r} there"
            for name in differ
        )
        raise CheckpointError(
            f"the model differs from the one {source!r} describes: {values}. Set [model] "
            f"{', '.join(differ)} to match, or give another init_from, or use [model] hf = DIR "
            "to train the transformers model itself."
        )
