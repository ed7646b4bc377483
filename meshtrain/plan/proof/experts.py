"""Experts modules in the plan-time abstract run: emulated whole, densely.

An experts module (see :func:`~meshtrain.plan.experts.axis.is_experts_module`) routes tokens with
data-dependent shapes (``nonzero`` over the hit experts, ``bincount`` offsets) and often through
kernels the fake-tensor mode cannot run (transformers' ``grouped_mm`` wants bf16 there). The
abstract run only needs what the module does to shapes and to shards: ``[tokens, hidden]`` in,
``[tokens, hidden]`` out, every expert weight meeting every token. :func:`dense_forward` computes
exactly that with plain ops (each 3-D weight contracted with the tokens over its hidden-sized dim,
the routing weights mixed in), so a token shard stays a token shard, a whole input stays whole, a
hidden-sharded input is refused as a mix, and a replicated expert weight meeting sharded tokens
is found as a partial gradient like any parameter.

Example:
    >>> import torch
    >>> from torch import nn
    >>> experts = nn.Module()
    >>> experts.num_experts = 4
    >>> experts.gate_up_proj = nn.Parameter(torch.ones(4, 6, 2))
    >>> experts.down_proj = nn.Parameter(torch.ones(4, 2, 3))
    >>> run = dense_forward(experts)
    >>> run(torch.ones(5, 2), torch.zeros(5, 2, dtype=torch.long), torch.ones(5, 2)).shape
    torch.Size([5, 2])
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn


def dense_forward(module: nn.Module) -> Callable[..., torch.Tensor]:
    """A forward for ``module`` with its experts forward's signature (hidden ``[T, H]``, top-k
    indices and weights ``[T, k]``) that returns ``[T, H]`` computed from every parameter of the
    module (see module doc); its parameters are read at call time (``functional_call``'s)."""

    def forward(
        hidden_states: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
        *args: Any,
        **kwargs: Any,
    ) -> torch.Tensor:
        mix = top_k_weights.sum(-1, keepdim=True).to(hidden_states.dtype)
        for weight in module.parameters(recurse=False):
            mix = mix + _meet(hidden_states, weight)
        return hidden_states * mix

    return forward


def _meet(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``[T, 1]``: the tokens contracted with ``weight`` over its hidden-sized dim (the last,
    else the middle of a 3-D weight), or a product of sums for a weight with none (a bias)."""
    size = hidden.shape[-1]
    weight = weight.to(hidden.dtype)
    if weight.ndim == 3 and weight.shape[-1] == size:
        matrix = weight.reshape(-1, size)
    elif weight.ndim == 3 and weight.shape[1] == size:
        matrix = weight.transpose(1, 2).reshape(-1, size)
    else:
        return hidden.sum(-1, keepdim=True) * weight.sum()
    return (hidden @ matrix.t()).sum(-1, keepdim=True)
