"""Experts modules in the activation trace: a stand-in that saves what the dispatch saves.

The activation trace (:mod:`meshtrain.plan.memory.activations`) runs a model's forward on fake tensors.
An experts module (:func:`~meshtrain.plan.experts.axis.is_experts_module`) cannot run there: its
routing has data-dependent shapes and transformers' ``grouped_mm`` wants bf16 on fake tensors.
:func:`traced_experts` replaces its forward with the abstract run's dense stand-in
(:func:`~meshtrain.plan.proof.experts.dense_forward`: ``[T, H]`` in and out, every weight
met, so gradients flow) whose own saved tensors are *not* counted, and in their place reports
what one rank's dropless dispatch keeps for backward **under uniform routing**
(:func:`~meshtrain.plan.experts.cost.moe_working_set`: the ``T·k`` sorted rows, the results
back and their weighted products, and for the ``T·k`` rows received their tokens, the experts'
gate-up output ``[2I]``, its SwiGLU ``[I]`` and the down projection ``[H]``), in the traced
dtype. Under uniform routing that figure does not depend on the expert-parallel size, so one
trace serves every ``ep``. Of it, selective checkpointing keeps the matmul outputs (gate-up and
down: ``T·k · (2I + H)``). A skewed step keeps more on its busiest rank (the plan's notes give
the worst case). ``bincount`` (a router's tokens per expert) is given its ``minlength`` shape.

Example:
    >>> import torch
    >>> from torch import nn
    >>> experts = nn.Module()
    >>> experts.num_experts = 4
    >>> experts.gate_up_proj = nn.Parameter(torch.ones(4, 6, 2))
    >>> experts.down_proj = nn.Parameter(torch.ones(4, 2, 3))
    >>> layer = expert_layer(experts, "experts", top_k=2, hidden=2)
    >>> dispatch_bytes(layer, tokens=5, element_bytes=4)  # 10 rows of (5·2 + 3·3) and (6 + 2) × 4 B
    (760, 320)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from meshtrain.plan.experts.cost import ExpertLayer, moe_working_set
from meshtrain.plan.proof.experts import dense_forward

#: what the stand-in reports: (experts module fqn, bytes saved, bytes selective checkpointing keeps)
Report = Callable[[str, int, int], None]


def expert_layer(module: nn.Module, fqn: str, *, top_k: int, hidden: int) -> ExpertLayer:
    """``module``'s experts as costing sees them (its own parameters' shapes, experts on dim 0)."""
    shapes = tuple(tuple(p.shape) for p in module.parameters(recurse=False))
    return ExpertLayer(fqn, shapes[0][0], top_k, hidden, shapes)  # experts: every dim 0


def dispatch_bytes(layer: ExpertLayer, *, tokens: int, element_bytes: int) -> tuple[int, int]:
    """(saved, kept by selective checkpointing): one layer's uniform-routing dispatch for
    ``tokens`` tokens (:func:`moe_working_set`), and its gate-up and down outputs."""
    saved = moe_working_set(layer, tokens=tokens, ep=1, activation_bytes=element_bytes)
    kept = element_bytes * tokens * layer.top_k * (2 * layer.inter + layer.hidden)
    return saved, kept


def traced_experts(
    module: nn.Module, fqn: str, report: Report, paused: Callable[[], Any]
) -> Callable[..., torch.Tensor]:
    """A forward for experts module ``module`` (see module doc): the dense stand-in's output,
    computed inside ``paused()`` (a context in which the trace counts nothing), and the
    dispatch's bytes given to ``report``."""
    dense = dense_forward(module)

    def forward(
        hidden_states: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
        *args: Any,
        **kwargs: Any,
    ) -> torch.Tensor:
        with paused():
            out = dense(hidden_states, top_k_index, top_k_weights)
        tokens, top_k = hidden_states.numel() // hidden_states.shape[-1], top_k_index.shape[-1]
        layer = expert_layer(module, fqn, top_k=top_k, hidden=hidden_states.shape[-1])
        report(
            fqn, *dispatch_bytes(layer, tokens=tokens, element_bytes=hidden_states.element_size())
        )
        return out

    return forward


def counts_shape(
    ids: torch.Tensor, weights: torch.Tensor | None = None, minlength: int = 0
) -> torch.Tensor:
    """``bincount(ids, minlength=n)`` as zeros of its shape (ids below ``n``: a router's tokens
    per expert); without ``minlength`` the size is the ids' values', which a shape-only run cannot know."""
    if minlength < 1:
        raise RuntimeError(
            f"bincount without minlength on ids of shape {list(ids.shape)} has a data-dependent "
            "size a shape-only run (activation trace, abstract run) cannot know. Pass minlength."
        )
    dtype = torch.long if weights is None else weights.dtype
    return torch.zeros(minlength, dtype=dtype, device=ids.device)


def tensor_attributes(model: nn.Module) -> dict[tuple[str, str], Any]:
    """Every module's plain attributes by module and name (a forward may store a tensor in one:
    an MoE layer's last balance loss, a router's last counts)."""
    return {
        (fqn, name): value
        for fqn, module in model.named_modules()
        for name, value in vars(module).items()
    }


def restore_attributes(model: nn.Module, kept: dict[tuple[str, str], Any]) -> None:
    """Put back the attributes a traced forward set to fake tensors, or remove those it added
    (fake tensors must not outlive the trace: the model is planned again, trained and saved)."""
    for fqn, module in model.named_modules():
        for name, value in list(vars(module).items()):
            if isinstance(value, FakeTensor):
                if (fqn, name) not in kept:
                    delattr(module, name)
                elif kept[fqn, name] is not value:
                    setattr(module, name, kept[fqn, name])


__all__ = [
    "counts_shape",
    "dispatch_bytes",
    "expert_layer",
    "restore_attributes",
    "tensor_attributes",
    "traced_experts",
]
