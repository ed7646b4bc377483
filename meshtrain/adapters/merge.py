"""Merging LoRA adapters into their base weights, over plain state dicts (FQN → tensor), for
export: ``W' = W + (alpha / rank) · B @ A`` for every ``<m>.weight`` with ``<m>.lora_A`` and
``<m>.lora_B`` beside it; the adapter keys are dropped and every other entry is passed through.

Example:
    >>> import torch
    >>> state = {"q.weight": torch.zeros(2, 3), "q.lora_A": torch.ones(1, 3),
    ...          "q.lora_B": torch.ones(2, 1), "norm.weight": torch.ones(3)}
    >>> merged = merge_lora(state, alpha=2)
    >>> sorted(merged), merged["q.weight"][0].tolist()
    (['norm.weight', 'q.weight'], [2.0, 2.0, 2.0])
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from meshtrain.adapters.nf4 import dequantize
from meshtrain.errors import CheckpointError


def merge_lora(state: Mapping[str, torch.Tensor], *, alpha: float) -> dict[str, torch.Tensor]:
    """A new state dict with each adapter pair merged into its base weight (in the base's dtype,
    computed in fp32; an NF4 base is dequantized to bf16) and the adapter keys dropped; the rank
    of each pair is read off ``lora_A``'s first dim. Tensors must be whole (``full_tensor()`` of a
    DTensor). A ``lora_A`` without its ``lora_B`` or base weight, or mismatched shapes, is a
    :class:`CheckpointError` naming the keys. ``state`` is not changed."""
    merged = dict(state)
    for key in state:
        if not key.endswith("lora_A"):
            continue
        prefix = key[: -len("lora_A")]
        b_key, weight_key = prefix + "lora_B", prefix + "weight"
        missing = [k for k in (b_key, weight_key) if k not in state]
        if missing:
            raise CheckpointError(
                f"adapter '{key}' has no {missing} beside it: a LoRA module keeps 'weight', "
                "'lora_A' and 'lora_B' together. Pass the whole state dict of the model.",
                fqn=key,
            )
        a, b, weight = state[key], state[b_key], dequantize(state[weight_key])
        rank = a.shape[0]
        if b.shape != (weight.shape[0], rank) or a.shape != (rank, weight.shape[1]):
            raise CheckpointError(
                f"adapters '{key}' {tuple(a.shape)} and '{b_key}' {tuple(b.shape)} do not fit "
                f"'{weight_key}' {tuple(weight.shape)}: expected lora_A [rank, in] and lora_B "
                "[out, rank]. Pass full tensors (DTensor.full_tensor()), not shards.",
                fqn=key,
            )
        update = (alpha / rank) * (b.float() @ a.float())
        merged[weight_key] = (weight.float() + update).to(weight.dtype)
        del merged[key], merged[b_key]
    return merged
