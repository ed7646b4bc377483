"""LoRA (Hu et al. 2021): each targeted ``nn.Linear`` becomes a :class:`LoRALinear` that keeps the
base weight (and bias) under the same names, frozen, and learns a low-rank update
``(alpha / rank) · B @ A`` with ``lora_A`` ``[rank, in]`` (Kaiming-uniform, as peft does) and
``lora_B`` ``[out, rank]`` (zeros, so training starts from the base model exactly). Every other
parameter of the model is frozen.

Base weights keep their FQNs, so a base checkpoint loads into the wrapped model by name; the
adapters add ``<module>.lora_A`` and ``<module>.lora_B``. Targets are regexes that must *fully*
match module FQNs, like the rules' patterns.

Example:
    >>> import torch
    >>> model = torch.nn.ModuleDict({"q": torch.nn.Linear(16, 16), "k": torch.nn.Linear(16, 4)})
    >>> _ = lora(model, rank=4, alpha=8, targets=[r"q"])
    >>> type(model["q"]).__name__, model["q"].lora_A.shape, model["k"].weight.requires_grad
    ('LoRALinear', torch.Size([4, 16]), False)
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from meshtrain.errors import RuleError
from meshtrain.spec.logical import annotate, logical_axes

#: the adapters' local parameter names
ADAPTERS = ("lora_A", "lora_B")


class LoRALinear(nn.Linear):
    """A Linear with a frozen base (``weight``, ``bias``) and trainable ``lora_A``/``lora_B``:
    ``y = x Wᵀ + b + (alpha / rank) · (x Aᵀ) Bᵀ``.

    ``quantized`` names the base's storage ("nf4" for QLoRA, "" otherwise); the planner counts
    its bytes from it, also on the meta device where the weight is not yet quantized.

    Example:
        >>> layer = LoRALinear(nn.Linear(4, 3), rank=2, alpha=4)
        >>> x = torch.randn(5, 4)
        >>> bool(torch.equal(layer(x), F.linear(x, layer.weight, layer.bias)))  # B starts at 0
        True
    """

    def __init__(
        self,
        base: nn.Linear,
        rank: int,
        alpha: float,
        *,
        dtype: torch.dtype | None = None,
        generator: torch.Generator | None = None,
    ) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.register_parameter("bias", base.bias)
        self.rank, self.alpha, self.quantized = rank, float(alpha), ""
        device, dtype = base.weight.device, dtype or _dense_dtype(base.weight)
        self.lora_A = nn.Parameter(torch.empty(rank, self.in_features, device=device, dtype=dtype))
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, rank, device=device, dtype=dtype))
        self.reset_lora_parameters(generator)
        names = logical_axes(base).get("weight")
        if names is not None:
            annotate(self, weight=names)

    @property
    def scale(self) -> float:
        """``alpha / rank``, the factor on the low-rank update."""
        return self.alpha / self.rank

    def reset_parameters(self) -> None:
        """The base's initialisation (as ``nn.Linear``), then the adapters'."""
        super().reset_parameters()
        if hasattr(self, "lora_A"):
            self.reset_lora_parameters()

    @torch.no_grad()
    def reset_lora_parameters(self, generator: torch.Generator | None = None) -> None:
        """``lora_A`` Kaiming-uniform with a = √5 (peft's and ``nn.Linear``'s default), ``lora_B``
        zero."""
        bound = 1.0 / math.sqrt(self.in_features)  # kaiming_uniform_(a=√5) on fan_in
        if self.lora_A.device.type != "meta":
            drawn = torch.empty(
                self.lora_A.shape, dtype=self.lora_A.dtype
            )  # on the generator's CPU
            self.lora_A.copy_(drawn.uniform_(-bound, bound, generator=generator))
        self.lora_B.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = F.linear(x, self.weight, self.bias)
        update = F.linear(F.linear(x.to(self.lora_A.dtype), self.lora_A), self.lora_B)
        return base + (self.scale * update).to(base.dtype)

    def extra_repr(self) -> str:
        quantized = f", base {self.quantized}" if self.quantized else ""
        return f"{super().extra_repr()}, rank={self.rank}, alpha={self.alpha:g}{quantized}"


def lora(
    model: nn.Module,
    *,
    rank: int,
    alpha: float,
    targets: Sequence[str],
    quantize_base: str | None = None,
    dtype: torch.dtype | None = None,
    generator: torch.Generator | None = None,
) -> nn.Module:
    """Wrap every ``nn.Linear`` whose FQN fully matches one of ``targets`` in a
    :class:`LoRALinear` and freeze every other parameter; returns ``model`` (changed in place).

    ``quantize_base="nf4"`` stores the targeted base weights as torchao NF4 tensors (QLoRA; on
    the meta device only marks them, see :mod:`meshtrain.adapters.nf4`). ``dtype`` is the
    adapters' (default: the base weight's, fp32 for an NF4 base); ``generator`` seeds ``lora_A``.

    A pattern that is not a valid regex, a target list that matches no Linear, or a match that
    is not an ``nn.Linear`` (e.g. Hugging Face's ``Conv1D``) is a :class:`RuleError` naming it.

    Example:
        >>> model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
        >>> _ = lora(model, rank=2, alpha=2, targets=["0", "2"])
        >>> [type(m).__name__ for m in model]
        ['LoRALinear', 'ReLU', 'LoRALinear']
    """
    _check_arguments(rank, alpha, targets, quantize_base)
    compiled = [re.compile(pattern) for pattern in targets]
    matched = [
        (fqn, module)
        for fqn, module in model.named_modules()
        if fqn and any(c.fullmatch(fqn) for c in compiled) and not isinstance(module, LoRALinear)
    ]
    refused = [(fqn, m) for fqn, m in matched if type(m) is not nn.Linear]
    if refused:
        fqn, module = refused[0]
        raise RuleError(
            f"LoRA target {fqn!r} is a {type(module).__name__}, not an nn.Linear: meshtrain "
            f"puts adapters on nn.Linear only ({len(refused)} such match(es)). Narrow the "
            f"target regexes {list(targets)} so they match Linear modules only.",
            fqn=fqn,
        )
    if not matched:
        linears = [fqn for fqn, m in model.named_modules() if isinstance(m, nn.Linear)]
        raise RuleError(
            f"LoRA targets {list(targets)} match no module (they must fully match module FQNs). "
            f"Linear modules of this model, e.g.: {linears[:6]}. Write patterns that fully "
            "match such names (a bare 'wq' matches a top-level module only).",
            rule=", ".join(targets),
        )
    for param in model.parameters():
        param.requires_grad_(False)
    for fqn, module in matched:
        assert isinstance(module, nn.Linear)
        wrapped = LoRALinear(module, rank, alpha, dtype=dtype, generator=generator)
        if quantize_base is not None:
            from meshtrain.adapters.nf4 import quantize_weight

            quantize_weight(wrapped, fqn)
        parent, _, name = fqn.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, name, wrapped)
    return model


def adapter_names(model: nn.Module) -> dict[str, str]:
    """Adapter parameter FQN → its base weight's FQN, for every :class:`LoRALinear` in ``model``.

    Example:
        >>> model = lora(nn.Sequential(nn.Linear(2, 2)), rank=1, alpha=1, targets=["0"])
        >>> adapter_names(model)
        {'0.lora_A': '0.weight', '0.lora_B': '0.weight'}
    """
    names: dict[str, str] = {}
    for fqn, module in model.named_modules():
        if isinstance(module, LoRALinear):
            prefix = f"{fqn}." if fqn else ""
            for adapter in ADAPTERS:
                names[prefix + adapter] = prefix + "weight"
    return names


def _dense_dtype(weight: torch.Tensor) -> torch.dtype:
    return weight.dtype if weight.dtype.is_floating_point else torch.float32


def _check_arguments(
    rank: int, alpha: float, targets: Sequence[str], quantize_base: str | None
) -> None:
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise RuleError(f"LoRA rank={rank!r} must be a positive integer (e.g. rank=8).")
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not alpha > 0:
        raise RuleError(f"LoRA alpha={alpha!r} must be a positive number (e.g. alpha=16).")
    if isinstance(targets, str) or not targets:
        raise RuleError(
            f"LoRA targets={targets!r} must be a non-empty list of regexes that fully match "
            r"module FQNs, e.g. [r'layers\.\d+\.attn\.w[qkv]']."
        )
    for pattern in targets:
        try:
            re.compile(pattern)
        except (re.error, TypeError) as err:
            raise RuleError(
                f"LoRA target {pattern!r} is not a valid regex ({err}). Fix the pattern.",
                rule=str(pattern),
            ) from None
    if quantize_base not in (None, "nf4"):
        raise RuleError(
            f"LoRA quantize_base={quantize_base!r} is not supported: use 'nf4' (QLoRA's 4-bit "
            "NormalFloat base) or None."
        )
