"""Parameter-efficient fine-tuning: LoRA adapters on a frozen base (:func:`lora`), a 4-bit NF4
base for QLoRA (:mod:`meshtrain.adapters.nf4`), and merging adapters back into the base weights
(:func:`merge_lora`).

The layer sits between ``spec`` and ``plan``: the planner reads the adapters' modules to derive
their layouts from the base's, and ``train`` and ``recipes`` merge and apply them.

Example:
    >>> import torch, meshtrain as mt
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    >>> _ = mt.lora(model, rank=2, alpha=4, targets=[r"0"])
    >>> sorted(n for n, p in model.named_parameters() if p.requires_grad)
    ['0.lora_A', '0.lora_B']
"""

from meshtrain.adapters.lora import LoRALinear, adapter_names, lora
from meshtrain.adapters.merge import merge_lora
from meshtrain.adapters.nf4 import nf4_bytes

__all__ = ["LoRALinear", "adapter_names", "lora", "merge_lora", "nf4_bytes"]
