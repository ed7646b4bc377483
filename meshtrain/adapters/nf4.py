"""QLoRA's frozen base in 4-bit NormalFloat (Dettmers et al. 2023), held as torchao's
``NF4Tensor`` (torchao is an optional dependency: ``pip install meshtrain[qlora]``).

torchao stores each weight as 4-bit codes (two per byte) in blocks of 64 elements, one int8 scale
per block, and the scales double-quantized in groups of 256 with one bf16 factor per group: about
0.5 + 1/64 bytes per element (:func:`nf4_bytes`). The forward dequantizes the weight to the
input's dtype; the base gets no gradient.

Example:
    >>> nf4_bytes(4096 * 4096) / (4096 * 4096)
    0.5157471895217896
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from meshtrain.errors import PlanError

BLOCK_SIZE = 64  # elements per int8 scale
SCALER_BLOCK_SIZE = 256  # scales per bf16 factor


def nf4_bytes(numel: int) -> int:
    """Bytes torchao's NF4 tensor keeps for ``numel`` elements: the 4-bit codes, one int8 scale
    per 64-element block, one bf16 factor per 256 scales, and one bf16 scale mean."""
    blocks = math.ceil(numel / BLOCK_SIZE)
    return math.ceil(numel / 2) + blocks + 2 * math.ceil(blocks / SCALER_BLOCK_SIZE) + 2


def is_nf4(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is torchao's NF4 tensor (checked by name: torchao is optional)."""
    return type(tensor).__name__ == "NF4Tensor"


def quantize_weight(module: nn.Linear, fqn: str = "") -> None:
    """Store ``module.weight`` as NF4 (frozen), or only mark it on the meta device (the planner
    counts it as NF4; quantize once real weights are loaded)."""
    module.quantized = "nf4"  # type: ignore[assignment,unused-ignore]
    weight = module.weight
    if is_nf4(weight):
        return
    numel = weight.numel()
    if numel % (BLOCK_SIZE * SCALER_BLOCK_SIZE):
        raise PlanError(
            f"cannot store '{fqn}.weight' (shape {tuple(weight.shape)}) as NF4: torchao quantizes in "
            f"blocks of {BLOCK_SIZE} elements with scales in groups of {SCALER_BLOCK_SIZE}, so its "
            f"{numel} elements must be a multiple of {BLOCK_SIZE * SCALER_BLOCK_SIZE}. Leave this "
            "module out of the LoRA targets or do not quantize the base.",
            fqn=f"{fqn}.weight",
            shape=tuple(weight.shape),
        )
    if weight.device.type == "meta":
        return
    to_nf4 = _to_nf4()
    dense = weight.detach().to(torch.bfloat16)
    module.weight = nn.Parameter(to_nf4(dense, BLOCK_SIZE, SCALER_BLOCK_SIZE), requires_grad=False)


def dequantize(tensor: torch.Tensor) -> torch.Tensor:
    """A dense copy of an NF4 tensor (in its bf16 dtype); any other tensor as it is."""
    if is_nf4(tensor):
        dense: torch.Tensor = tensor.get_original_weight()  # type: ignore[attr-defined]
        return dense
    return tensor


def _to_nf4() -> Any:
    try:
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4
    except ImportError:
        raise PlanError(
            "quantize_base='nf4' needs torchao's NF4 tensor, and torchao is not installed. "
            "Install it with `pip install meshtrain[qlora]` (torchao 0.18), or train LoRA "
            "without quantize_base."
        ) from None
    return to_nf4
