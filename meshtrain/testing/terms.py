"""Per element, the magnitudes a gradient sums over tokens on the one-device reference.

A weight's gradient is a sum over every token ``t`` of one term each: ``dy_t ⊗ x_t`` for a
Linear weight, ``dy_t · x̂_t`` for a norm's scale (``x̂`` the normalised input), ``dy_t`` for a
bias or an embedding row. Under a low-precision policy the plan computes those terms in other
kernels (another batch per rank, another blocking, tensor-parallel partial products rounded
before their sum), so each may round differently by up to the unit roundoff ``u`` of itself:
the two gradients differ by at most ``u · (|G| + Σ_t |term_t|)`` per rounding the plan adds —
a bound that follows the magnitudes actually summed, where the tokens' terms cancel to a small
gradient and where a tensor's elements are far below its largest one.

Tracked: ``nn.Linear`` (weight and bias), ``nn.LayerNorm`` (weight and bias) and RMSNorm-style
scales (``torch.nn.RMSNorm``, meshtrain's ``RMSNorm``, any module whose class name ends in
``RMSNorm`` and holds a 1-D ``weight``: transformers' ``*RMSNorm``, Gemma's ``1 + weight``
included, whose gradient is the same sum). Not tracked, and so kept on the tensor's largest
magnitude: embeddings (a row's terms are single tokens' residual-stream gradients, themselves
sums that cancel: measured on the debug Llama in bf16 over dp 2 × tp 2, a row differed by 1.5e4×
``u`` of its one term) and parameters shared by several modules (tied heads: the other module's
terms are not summed here).

:func:`element_bound` turns the sums into the gradient's bound per element.

Example:
    >>> import torch
    >>> from torch import nn
    >>> layer = nn.Linear(2, 1, bias=False)
    >>> terms = SummedTerms.track(layer, unit=2.0**-8)
    >>> layer(torch.tensor([[1.0, 2.0], [-1.0, -2.0]])).sum().backward()
    >>> terms.summed["weight"].tolist()  # |1| + |-1|, |2| + |-2|: the gradient itself is 0
    [[2.0, 4.0]]
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from meshtrain.testing.contract import UNIT_ROUNDOFF, Contract

#: term(module, x, dy) -> {parameter name: Σ_t |term_t|}, x and dy in float64
TermFn = Callable[[nn.Module, torch.Tensor, torch.Tensor], dict[str, torch.Tensor]]


def _tokens(x: torch.Tensor, features: int) -> torch.Tensor:
    return x.reshape(-1, features)


def _linear_terms(module: nn.Module, x: torch.Tensor, dy: torch.Tensor) -> dict[str, torch.Tensor]:
    dy_abs = _tokens(dy, dy.shape[-1]).abs()
    terms = {"weight": dy_abs.T @ _tokens(x, x.shape[-1]).abs()}
    if getattr(module, "bias", None) is not None:
        terms["bias"] = dy_abs.sum(0)
    return terms


def _layer_norm_terms(
    module: nn.Module, x: torch.Tensor, dy: torch.Tensor
) -> dict[str, torch.Tensor]:
    assert isinstance(module, nn.LayerNorm)
    axes = tuple(range(-len(module.normalized_shape), 0))
    dims = tuple(range(x.dim() - len(axes)))
    mean = x.mean(axes, keepdim=True)
    normalised = (x - mean) / (x.var(axes, unbiased=False, keepdim=True) + module.eps).sqrt()
    return {"bias": dy.abs().sum(dims), "weight": (dy * normalised).abs().sum(dims)}


def _rms_norm_terms(
    module: nn.Module, x: torch.Tensor, dy: torch.Tensor
) -> dict[str, torch.Tensor]:
    eps = getattr(module, "eps", None) or getattr(module, "variance_epsilon", None) or 1e-6
    normalised = x * (x.pow(2).mean(-1, keepdim=True) + eps).rsqrt()
    dims = tuple(range(x.dim() - 1))
    return {"weight": (dy * normalised).abs().sum(dims)}


def term_fn(module: nn.Module) -> TermFn | None:
    """How ``module``'s parameters' gradient terms are summed, or ``None`` if untracked."""
    if isinstance(module, nn.Linear):
        return _linear_terms
    if isinstance(module, nn.LayerNorm):
        return _layer_norm_terms if module.elementwise_affine else None
    weight = getattr(module, "weight", None)
    rms_like = isinstance(module, nn.RMSNorm) or type(module).__name__.endswith("RMSNorm")
    if rms_like and isinstance(weight, torch.Tensor) and weight.dim() == 1:
        return _rms_norm_terms
    return None


class SummedTerms:
    """Collects ``Σ_t |term_t|`` per parameter (by the reference's FQN) over one step's
    backward: forward hooks keep each call's input and hook its output's gradient, so a module
    called several times (tied or shared) adds every call's terms."""

    def __init__(self, unit: float) -> None:
        self.unit = unit
        self.summed: dict[str, torch.Tensor] = {}
        self.whole: set[str] = set()  # bounded on the whole contract too (see element_bound)
        self.loss_scale = 1.0  # fp16: backward starts from the scaled loss; the terms are not

    @classmethod
    def track(cls, reference: nn.Module, unit: float) -> SummedTerms:
        """Hook every tracked module of ``reference`` (nothing when ``unit`` is 0: fp32)."""
        tracker = cls(unit)
        if unit == 0.0:
            return tracker
        uses: dict[int, int] = {}
        for _, param in reference.named_parameters(remove_duplicate=False):
            uses[id(param)] = uses.get(id(param), 0) + 1
        first = {id(param): fqn for fqn, param in reference.named_parameters()}
        for fqn, module in reference.named_modules():
            terms = term_fn(module)
            if terms is None:
                continue
            names = {
                name: first.get(id(param), _join(fqn, name))
                for name, param in module.named_parameters(recurse=False)
                if param.requires_grad and uses.get(id(param)) == 1
            }
            if names:
                module.register_forward_hook(tracker._hook(terms, names))
            if terms is _layer_norm_terms:
                tracker.whole.update(names.values())
        return tracker

    def clear(self) -> None:
        self.summed = {}

    def _hook(self, terms: TermFn, names: dict[str, str]) -> Callable[..., None]:
        def on_forward(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            if not args or not isinstance(output, torch.Tensor) or not output.requires_grad:
                return
            x = args[0].detach()

            def on_grad(dy: torch.Tensor) -> None:
                scaled = dy.detach().double() / self.loss_scale
                for name, total in terms(module, x.double(), scaled).items():
                    if name in names:
                        self._add(names[name], total)

            output.register_hook(on_grad)

        return on_forward

    def _add(self, fqn: str, total: torch.Tensor) -> None:
        self.summed[fqn] = self.summed[fqn] + total if fqn in self.summed else total


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def element_bound(
    contract: Contract, reference: torch.Tensor, summed: torch.Tensor, scale: float, *, whole: bool
) -> torch.Tensor:
    """Per element, the bound on a tracked gradient's difference from one device.

    ``whole=False`` (Linear and RMSNorm weights): the contract's fp32 reordering part of
    ``scale`` (the tensor's largest magnitude, or the step's for a numerically zero tensor) plus,
    per rounding site, ``(1 + ways)·u`` of the magnitudes the element sums — the contract's own
    allowance taken per element instead of at the tensor's largest magnitude.
    ``whole=True`` (LayerNorm weights and biases): the whole contract of ``scale`` plus
    ``u · (|G| + Σ_t |term_t|)``: their terms are single tokens' residual-stream gradients,
    themselves sums that cancel, whose errors follow the stream's magnitude (measured: BART's
    encoder ``final_layer_norm.bias`` at 2.6× the per-element allowance alone, dp 4, bf16).

    Example:
        >>> from meshtrain.testing.contract import Reordering
        >>> c = Contract("approximate", (), 1, "bf16", (Reordering("dp", 2),))
        >>> g, summed = torch.tensor([0.0]), torch.tensor([256.0])
        >>> element_bound(c, g, summed, 1.0, whole=False).item()  # 3 u of 256
        3.0
        >>> round(element_bound(c, g, summed, 1.0, whole=True).item(), 4)  # 3 u of 1, u of 256
        1.0117
    """
    unit = UNIT_ROUNDOFF[contract.precision]
    if whole:
        return contract.tolerance * scale + unit * (reference.double().abs() + summed.double())
    rounding = sum(1 + site.ways for site in contract.rounding_sites) * unit
    return (contract.tolerance - rounding) * scale + rounding * summed.to(torch.float64)
