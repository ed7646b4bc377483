"""QLoRA's frozen base in 4-bit NormalFloat (Dettmers et al. 2023), held as torchao's
``NF4Tensor`` (torchao is an optional dependency: ``pip install meshtrain[qlora]``).

torchao stores each weight as 4-bit codes (two per byte) in blocks of 64 elements, one int8 scale
per block, and the scales double-quantized in groups of 256 with one bf16 factor per group: about
0.5 + 1/64 bytes per element (:func:`nf4_bytes`). The forward dequantizes the weight to the
input's dtype; the base gets no gradient.

The double quantization subtracts one number per tensor, the mean of its block scales, and under
FSDP2 every shard must carry the whole tensor's mean (torchao rebuilds the gathered weight with the
mean of the rank that gathers it). So a weight is quantized whole (:func:`quantize_weight`), or
shard by shard with the whole tensor's mean (:func:`quantize` with ``scaler_mean``, the mean from
:func:`scale_sums` added up over the shards): both give the same bytes. On the meta device the
base is an NF4 tensor with meta storage (:func:`meta_nf4`), so the plan, ``fully_shard`` and
``to_empty`` see its true layout before any weight exists.

Planning needs no torchao: the planner sizes an NF4 weight from its element count
(:func:`nf4_bytes`) and the module's ``quantized`` mark. Without torchao a base on the meta device
is a dense bf16 meta tensor marked "nf4", planned byte for byte as the NF4 tensor would be;
applying such a plan to train refuses (:func:`require_nf4`), naming the ``qlora`` extra. torchao
is imported in one place (:func:`torchao_nf4`), with its load-time log lines silenced.

Example:
    >>> nf4_bytes(4096 * 4096) / (4096 * 4096)
    0.5157471895217896
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
from collections.abc import Iterator
from types import ModuleType
from typing import Any, NoReturn

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
    """Store ``module.weight`` as NF4 (frozen): quantized from its values, or on the meta device
    an NF4 tensor with meta storage (:func:`meta_nf4`) to be filled shard by shard once the model
    is applied (:func:`write_nf4`)."""
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
        planned = torchao_nf4() is None  # planning only: sized by the mark, not the tensor
        stored = _planned_nf4(weight.shape) if planned else meta_nf4(tuple(weight.shape))
    else:
        stored = quantize(weight.detach().to(DTYPE))
    module.weight = nn.Parameter(stored, requires_grad=False)


def meta_nf4(shape: tuple[int, ...], dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """An NF4 tensor of ``shape`` whose storage is on the meta device (no memory): what a base
    weight built on the meta device becomes, so FSDP2 shards it as NF4.

    Example:
        >>> meta_nf4((128, 256)).quantized_data.shape
        torch.Size([16384])
    """
    nf4_class, tensor_args = _torchao()
    numel = math.prod(shape)
    blocks = numel // BLOCK_SIZE

    def empty(size: tuple[int, ...], kind: torch.dtype) -> torch.Tensor:
        return torch.empty(size, dtype=kind, device="meta")

    strides = tuple(math.prod(shape[dim + 1 :]) for dim in range(len(shape)))
    args = tensor_args(torch.Size(shape), strides, 0, dtype, torch.device("meta"), False)
    return nf4_class(
        args,
        BLOCK_SIZE,
        blocks,
        SCALER_BLOCK_SIZE,
        empty((blocks,), torch.int8),
        empty((blocks // SCALER_BLOCK_SIZE,), dtype),
        empty((), dtype),
        empty((numel // 2,), torch.uint8),
        empty((16,), dtype),
    )


def scale_sums(dense: torch.Tensor) -> torch.Tensor:
    """``[sum of the block scales, number of blocks]`` of ``dense`` in float64: summed over a
    weight's shards, they give the whole weight's scale mean (:func:`scale_mean`).

    Example:
        >>> scale_sums(torch.ones(2, 64) * torch.tensor([[1.0], [3.0]]))
        tensor([4., 2.], dtype=torch.float64)
    """
    scales = dense.reshape(-1, BLOCK_SIZE).abs().amax(dim=1)
    count = torch.tensor(float(scales.numel()), dtype=torch.float64, device=scales.device)
    return torch.stack([scales.sum(dtype=torch.float64), count])


def scale_mean(sums: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The mean block scale from :func:`scale_sums` (added up over shards), in ``dtype``."""
    return (sums[0] / sums[1]).to(dtype)


def quantize(dense: torch.Tensor, scaler_mean: torch.Tensor | None = None) -> torch.Tensor:
    """``dense`` (bf16) as torchao's NF4 tensor, its scales double-quantized around
    ``scaler_mean`` (default: ``dense``'s own mean block scale, from :func:`scale_sums`). A shard
    quantized with its whole tensor's mean holds exactly the bytes of that shard of the whole
    tensor quantized at once (blocks and scale groups never straddle shards).

    Example:
        >>> weight = torch.randn(128, 256, dtype=torch.bfloat16)
        >>> whole = quantize(weight)
        >>> half = quantize(weight[:64], whole.scaler_mean)
        >>> torch.equal(half.quantized_scalers, whole.quantized_scalers[:256])
        True
    """
    dense = dense.contiguous()
    mean = scale_mean(scale_sums(dense), dense.dtype) if scaler_mean is None else scaler_mean
    stored = _to_nf4()(dense, BLOCK_SIZE, SCALER_BLOCK_SIZE)  # its codes and the shared table
    scales = dense.reshape(-1, BLOCK_SIZE).abs().amax(dim=1)  # torchao's first-level scales
    groups = (scales - mean.to(scales.device, scales.dtype)).view(-1, SCALER_BLOCK_SIZE)
    factor = 256 / (2 * groups.abs().amax(dim=1, keepdim=True))  # as torchao computes them
    codes = (groups * factor).round().clamp(-128, 127).flatten().to(torch.int8)
    stored.quantized_scalers = codes
    stored.quantization_factor = factor.flatten().contiguous()
    stored.scaler_mean = mean.to(scales.device, scales.dtype)
    return stored


def write_nf4(target: torch.Tensor, dense: torch.Tensor, scaler_mean: torch.Tensor) -> None:
    """Quantize ``dense`` (this rank's part of a weight, any float dtype) into the NF4 tensor
    ``target`` in place, around the whole weight's ``scaler_mean``: storage on the meta device
    (after ``to_empty``, torchao leaves part of it there) is replaced, real storage is copied
    into, so views FSDP2 keeps of it stay valid."""
    new = quantize(dense.to(device=target.device, dtype=target.dtype), scaler_mean)
    for name in _STORAGE:
        current, value = getattr(target, name), getattr(new, name)
        if current.is_meta or current.shape != value.shape:
            setattr(target, name, value)
        else:
            current.copy_(value)


#: the tensors an NF4 tensor is made of (torchao's attribute names)
_STORAGE = ("quantized_scalers", "quantization_factor", "quantized_data", "scaler_mean", "nf4")
DTYPE = torch.bfloat16  # what an NF4 base dequantizes to


def dequantize(tensor: torch.Tensor) -> torch.Tensor:
    """A dense copy of an NF4 tensor (in its bf16 dtype); any other tensor as it is."""
    if is_nf4(tensor):
        dense: torch.Tensor = tensor.get_original_weight()  # type: ignore[attr-defined]
        return dense
    return tensor


def register_nf4() -> None:
    """Make torchao's NF4 tensor known to ``torch.load(weights_only=True)`` (torchao registers it
    when imported), for reading a QLoRA checkpoint's NF4 shards."""
    _torchao()


def require_nf4(model: nn.Module) -> None:
    """Refuse (:class:`PlanError`) to run ``model`` when a weight marked for NF4 storage is not an
    NF4 tensor: it was built on the meta device for planning without torchao, and training it
    would silently keep the base in bf16.

    Example:
        >>> require_nf4(nn.Linear(2, 2))  # nothing marked for NF4
    """
    for fqn, module in model.named_modules():
        weight = module._parameters.get("weight") if getattr(module, "quantized", "") else None
        if weight is not None and not is_nf4(weight) and torchao_nf4() is None:
            _missing(f"training the QLoRA base '{fqn}.weight' (quantize_base='nf4')")


@functools.cache
def torchao_nf4() -> ModuleType | None:
    """torchao's NF4 module, or ``None`` when torchao cannot be imported: the one place meshtrain
    imports torchao, with its load-time log lines (compiled extensions this machine cannot load,
    pytree registration notices) silenced; warnings of meshtrain's own are untouched."""
    logging.getLogger("torch.utils._pytree").addFilter(_enum_constant_notice)
    try:
        with _quiet_loggers("torchao", "torch.utils._pytree"):
            from torchao.quantization.quantize_.workflows.nf4 import nf4_tensor
    except ImportError:
        return None
    return nf4_tensor


def _enum_constant_notice(record: logging.LogRecord) -> bool:
    """False for torch's notice that an Enum registered as a pytree constant (torchao registers
    its enums in each module it loads, also after :func:`torchao_nf4`) needs no registration."""
    return "is an Enum subclass and is now natively supported" not in record.getMessage()


@contextlib.contextmanager
def _quiet_loggers(*names: str) -> Iterator[None]:
    """Only errors from the loggers ``names`` while the block runs."""
    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def _planned_nf4(shape: torch.Size) -> torch.Tensor:
    """The stand-in for an NF4 base when torchao is absent: dense bf16 on the meta device (the
    NF4 tensor's dtype and shape), counted as NF4 by the planner through the module's mark."""
    return torch.empty(shape, dtype=DTYPE, device="meta")


def _to_nf4() -> Any:
    module = torchao_nf4()
    if module is None:
        _missing()
    return module.to_nf4


def _torchao() -> tuple[Any, Any]:
    """torchao's NF4 tensor class and its constructor's metadata record."""
    module = torchao_nf4()
    if module is None:
        _missing()
    return module.NF4Tensor, module.SubclassTensorArgs


def _missing(subject: str = "quantize_base='nf4'") -> NoReturn:
    raise PlanError(
        f"{subject} needs torchao's NF4 tensor, and torchao is not installed. Install it with "
        "`pip install meshtrain[qlora]` (torchao 0.18), or train LoRA without quantize_base."
    ) from None
