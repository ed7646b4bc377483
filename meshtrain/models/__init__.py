"""Reference models, written to be parallelised and annotated with logical axis names.

Models import only from :mod:`meshtrain.spec`; they never import the planner.

Example:
    >>> from meshtrain.models import LlamaConfig, build_llama
    >>> build_llama(LlamaConfig.debug()).config.dim
    64
"""

from meshtrain.models.llama import (
    LOGICAL_RULES,
    Attention,
    FeedForward,
    Llama,
    LlamaConfig,
    RMSNorm,
    TransformerBlock,
    build_llama,
    default_rules,
    llama_flops_per_token,
)
from meshtrain.models.moe import (
    MoE,
    MoEBlock,
    MoEConfig,
    MoEFeedForward,
    build_moe,
    moe_layers,
    moe_stats,
)
from meshtrain.models.moe import default_rules as moe_default_rules
from meshtrain.models.moe_experts import GroupedExperts, Router, load_balance_loss

__all__ = [
    "LOGICAL_RULES",
    "Attention",
    "FeedForward",
    "GroupedExperts",
    "Llama",
    "LlamaConfig",
    "MoE",
    "MoEBlock",
    "MoEConfig",
    "MoEFeedForward",
    "RMSNorm",
    "Router",
    "TransformerBlock",
    "build_llama",
    "build_moe",
    "default_rules",
    "llama_flops_per_token",
    "load_balance_loss",
    "moe_default_rules",
    "moe_layers",
    "moe_stats",
]
