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

__all__ = [
    "LOGICAL_RULES",
    "Attention",
    "FeedForward",
    "Llama",
    "LlamaConfig",
    "RMSNorm",
    "TransformerBlock",
    "build_llama",
    "default_rules",
    "llama_flops_per_token",
]
