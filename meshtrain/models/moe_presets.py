"""Named shapes of meshtrain's mixture-of-experts model (:class:`~meshtrain.models.moe.MoEConfig`),
for recipes (``[model] name = "moe"``, ``preset = ...``) and sizing.

- ``debug``: the tiny test model (:meth:`MoEConfig.debug`).
- ``qwen3_moe_30b_a3b``: Qwen3-30B-A3B's shape: 48 layers of width 2048, 128 experts of width
  768, top-8, per-head q/k norms, 32 query and 4 key-value heads, vocabulary 151,936 — 30.1B
  parameters, 2.9B active. Qwen3 widens attention to heads of 128 (q: 2048 → 4096); meshtrain's
  attention keeps heads of ``dim / n_heads`` = 64, so the model has 0.4B parameters fewer than
  the published 30.5B.
- ``deepseek_v3_671b``: DeepSeek-V3's shape: 61 layers of width 7168, the first 3 dense (width
  18,432), then 256 routed experts of width 2048 (top-8, sigmoid scores scaled by 2.5,
  bias-based loss-free balancing) and 1 shared expert, vocabulary 129,280. Multi-head latent
  attention (MLA) is **not** modelled: attention is meshtrain's with 128 heads of 56 for
  queries, keys and values, 205.5M parameters per layer where MLA has 187.1M, so the model has
  672.1B parameters, 1.1B (0.17%) more than DeepSeek-V3's 671B; its attention activations are
  smaller than MLA's (q/k/v of 3 × 7,168 per token where MLA's are 128 × (192 + 192 + 128) =
  65,536), which under full checkpointing changes only the recomputed block's peak.

Example:
    >>> moe_preset("debug", n_layers=2).n_layers
    2
    >>> round(moe_preset("deepseek_v3_671b").num_params() / 1e9, 1)
    672.1
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from meshtrain.errors import PlanError
from meshtrain.models.moe import MoEConfig

__all__ = ["MOE_PRESETS", "moe_preset"]


def _qwen3_moe_30b_a3b() -> MoEConfig:
    return MoEConfig(
        dim=2048,
        n_layers=48,
        n_heads=32,
        n_kv_heads=4,
        vocab_size=151936,
        n_experts=128,
        top_k=8,
        moe_inter=768,
        qk_norm=True,
        balance="aux_loss",
        norm_eps=1e-6,
        rope_theta=1e6,
        max_seq_len=40960,
    )


def _deepseek_v3_671b() -> MoEConfig:
    return MoEConfig(
        dim=7168,
        n_layers=61,
        n_heads=128,
        n_kv_heads=128,
        vocab_size=129280,
        n_experts=256,
        top_k=8,
        moe_inter=2048,
        n_shared_experts=1,
        first_dense_layers=3,
        dense_inter=18432,
        score_func="sigmoid",
        route_scale=2.5,
        balance="bias",
        norm_eps=1e-6,
        max_seq_len=4096,
    )


#: preset name → a function building its :class:`MoEConfig`
MOE_PRESETS: dict[str, Callable[[], MoEConfig]] = {
    "debug": MoEConfig.debug,
    "qwen3_moe_30b_a3b": _qwen3_moe_30b_a3b,
    "deepseek_v3_671b": _deepseek_v3_671b,
}


def moe_preset(name: str, **overrides: Any) -> MoEConfig:
    """The :class:`MoEConfig` of preset ``name`` with ``overrides`` (its fields); a PlanError
    naming the valid presets or fields otherwise."""
    if name not in MOE_PRESETS:
        raise PlanError(f"unknown MoE preset {name!r}; choose one of {list(MOE_PRESETS)}.")
    fields = {field.name for field in dataclasses.fields(MoEConfig)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise PlanError(
            f"unknown MoEConfig field(s) {unknown} overriding preset {name!r}; valid fields: "
            f"{sorted(fields)}."
        )
    return dataclasses.replace(MOE_PRESETS[name](), **overrides)
