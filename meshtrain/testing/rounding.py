"""The one-device reference's own low-precision error, measured: an fp32 twin beside it.

Under a bf16/fp16 policy a plan cannot match one device bit for bit: it rounds partial results
(each rank's gradient, tensor-parallel partial products, all-reduced activations) that one
device rounds as a whole, or not at all. How far apart two correct low-precision computations
of the same value may land depends on every op between the inputs and that value — a model of
it per op type (Linear, norm, embedding, ...) misses whatever it does not model (an output head
fed by a bf16 all-reduce, a relative-position bias table, token-type embeddings). So the
harness measures it instead: beside the low-precision reference it runs the same model in fp32
(:class:`ExactTwin`), from the same parameters on the same batch, and takes each tensor's
difference between the two — the reference's own rounding error, ``ρ``. A plan's result is
another low-precision computation of the same exact value, so its distance from the reference
is at most its own error plus the reference's; the contract allows a multiple of ``ρ`` for it
(:data:`ROUNDING_FACTOR`, see :func:`rounding_bound`).

The twin is the model as built (fp32), never wrapped: no mixed-precision policy, no loss
scaling. Before each step it takes the plan's parameters and buffers, as the reference does.

Example:
    >>> import torch
    >>> from torch import nn
    >>> torch.manual_seed(0) and None
    >>> low = nn.Linear(4, 2)
    >>> twin = ExactTwin(nn.Linear(4, 2))
    >>> twin.take(dict(low.named_parameters()), {})
    >>> x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
    >>> def loss_fn(out, target): return nn.functional.cross_entropy(out, target, reduction="sum")
    >>> with torch.autocast("cpu", torch.bfloat16):
    ...     loss = loss_fn(low(x), y) / 8
    >>> loss.backward()
    >>> own = twin.measure(float(loss.detach()), dict(low.named_parameters()), x, y, loss_fn)
    >>> 0 < own.grads["weight"] < 0.05 * float(low.weight.grad.abs().max())
    True
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from meshtrain.lower import full_tensor
from meshtrain.testing.contract import ROUNDING_FACTOR
from meshtrain.train.loss import LossFn


@dataclass(frozen=True)
class OwnRounding:
    """One step's measured low-precision error of the one-device reference, per quantity: the
    largest ``|low − fp32|`` of the loss, the gradient norm and each gradient (by FQN)."""

    loss: float = 0.0
    grad_norm: float = 0.0
    grads: dict[str, float] = field(default_factory=dict)
    near_ties: dict[int, torch.Tensor] = field(default_factory=dict)


class ExactTwin:
    """The one-device model in fp32 beside the low-precision reference (see the module doc)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.named = dict(model.named_parameters())
        self.buffers = dict(model.named_buffers())

    @torch.no_grad()
    def take(self, params: Mapping[str, torch.Tensor], buffers: Mapping[str, torch.Tensor]) -> None:
        """Start the next step from these parameters and buffers (whole tensors, by FQN)."""
        for fqn, value in params.items():
            if fqn in self.named:
                self.named[fqn].copy_(full_tensor(value.detach()))
        for fqn, value in buffers.items():
            if fqn in self.buffers:
                self.buffers[fqn].copy_(full_tensor(value.detach()))

    def measure(
        self,
        low_loss: float,
        low_params: Mapping[str, torch.Tensor],
        inputs: torch.Tensor,
        targets: torch.Tensor,
        loss_fn: LossFn,
        keywords: Mapping[str, Any] | None = None,
        low_choices: list[TopkCall] | None = None,
        unit: float = 0.0,
    ) -> OwnRounding:
        """Run the step's forward and backward in fp32 and measure the low-precision side's
        error: ``low_params``' gradients (unscaled), ``low_loss`` its loss; with
        ``low_choices`` (its ``topk`` calls), the rows within rounding of a tie."""
        for own in self.named.values():
            own.grad = None
        with RecordTopk() as choices:
            output = self.model(inputs, **(keywords or {}))
        loss = loss_fn(output, targets) / targets.numel()
        loss.backward()
        grads: dict[str, float] = {}
        low_sq = exact_sq = 0.0
        for fqn, param in low_params.items():
            twin = self.named.get(fqn)
            if param.grad is None or twin is None or twin.grad is None:
                continue
            low = full_tensor(param.grad).detach().double()
            high = twin.grad.detach().double()
            grads[fqn] = float((low - high).abs().max()) if low.numel() else 0.0
            low_sq += float(low.pow(2).sum())
            exact_sq += float(high.pow(2).sum())
        ties = near_ties(low_choices, choices.calls, unit) if low_choices else {}
        return OwnRounding(
            loss=abs(low_loss - float(loss.detach())),
            grad_norm=abs(low_sq**0.5 - exact_sq**0.5),
            grads=grads,
            near_ties=ties,
        )

    def buffer_error(self, fqn: str, low: torch.Tensor) -> float:
        """The reference buffer ``low``'s distance from the twin's after the same step."""
        exact = self.buffers.get(fqn)
        if exact is None or exact.shape != low.shape or not low.is_floating_point():
            return 0.0
        return float((low.double() - exact.double()).abs().max()) if low.numel() else 0.0


#: The multiple of a flip allowance (:class:`FlipAllowance`) a plan may add: flipping every
#: near-tie at once is one of the ways a plan may choose; a subset may cancel less.
FLIP_FACTOR = 2.0
#: Near-tie rows flipped per row the reference itself flips against fp32 (see :func:`near_ties`).
FLIP_ROWS = 2


def rounding_bound(
    tolerance: float, unit: float, scale: float, own_error: float, rounded: float | None = None
) -> float:
    """The bound on a plan's difference from the low-precision one-device reference.

    ``tolerance × scale`` is the contract's fp32 reduction-order part (``scale`` the quantity's
    largest magnitude); the low-precision part is ``ROUNDING_FACTOR × max(ρ, u · rounded)``,
    ``ρ`` the reference's own measured error of the quantity (:class:`ExactTwin`) and
    ``u · rounded`` the least a low-precision computation of it carries: one rounding of the
    value (``rounded`` = ``scale``, the default) for what is computed in the compute dtype — a
    gradient, the loss from its logits — and 0 for a running statistic, fp32 arithmetic on
    low-precision activations whose rounding only the twin sees.
    Why a factor of 4: the plan's difference from the reference is its own error plus the
    reference's (2), and the plan rounds again where it splits a sum the reference takes whole
    (each rank's gradient, tensor-parallel partial products, activations all-reduced in the
    compute dtype), at most about as much again per split (2 more). Measured over the zoo, the
    Hugging Face families and drawn modules (``benchmarks/false_alarms.py``), the largest ratio
    of a correct plan's difference to ``ρ`` stays below that; see docs/testing.md.

    Example:
        >>> rounding_bound(1e-6, 2.0**-8, 2.0, 0.01)  # 4 × 0.01 + 2e-6
        0.040002
        >>> rounding_bound(1e-6, 0.0, 2.0, 0.0)  # fp32: the reduction-order part alone
        2e-06
    """
    if unit == 0.0:
        return tolerance * scale
    rounded = scale if rounded is None else rounded
    return tolerance * scale + ROUNDING_FACTOR * max(own_error, unit * rounded)


# ----------------------------------------------------------------------------- discrete choices

#: ``torch.topk`` and its method form: the discrete choices watched for near-ties.
_TOPK = (torch.topk, torch.Tensor.topk)


@dataclass(frozen=True)
class TopkCall:
    """One ``topk`` over the last dim (largest first): its input (fp32 copy) and ``k``."""

    values: torch.Tensor
    k: int


def _topk_args(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> tuple[torch.Tensor, int] | None:
    """``(input, k)`` of a ``topk`` over the last dim, largest first; else ``None``."""
    x = args[0] if args else kwargs.get("input")
    k = args[1] if len(args) > 1 else kwargs.get("k")
    dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
    largest = args[3] if len(args) > 3 else kwargs.get("largest", True)
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or not isinstance(k, int):
        return None
    if dim not in (-1, x.dim() - 1) or not largest or not 0 < k < x.shape[-1]:
        return None
    return x, k


class RecordTopk(TorchFunctionMode):
    """Records every ``topk`` over the last dim while it is active (the reference's forward and
    the twin's), in call order."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[TopkCall] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        found = _topk_args(args, kwargs) if func in _TOPK else None
        if found is not None:
            x, k = found
            self.calls.append(TopkCall(x.detach().float().reshape(-1, x.shape[-1]).clone(), k))
        return func(*args, **kwargs)


def near_ties(low: list[TopkCall], exact: list[TopkCall], unit: float) -> dict[int, torch.Tensor]:
    """Per ``topk`` call (by index), the rows a plan is likeliest to choose the other way.

    A row is a candidate when the gap between its k-th and (k+1)-th value is within
    ``ROUNDING_FACTOR`` × its rounding — its largest ``|low − fp32|``, at least one rounding (u)
    of the k-th value — so that another low-precision computation may tip it. A plan flips about
    as many rows against fp32 as the reference itself does (its *own flips*: rows whose chosen
    set differs from fp32's), so the plan and the reference differ by at most twice that many:
    the ``2 × max(own flips, 1)`` candidates with the smallest gap over rounding are returned.
    Calls whose sequence or shapes differ between the two runs are not compared.

    Example:
        >>> low = [TopkCall(torch.tensor([[0.50, 0.49, 0.01], [0.9, 0.05, 0.05]]), 1)]
        >>> exact = [TopkCall(torch.tensor([[0.49, 0.50, 0.01], [0.9, 0.05, 0.05]]), 1)]
        >>> near_ties(low, exact, 2.0**-8)[0].tolist()
        [True, False]
    """
    if len(low) != len(exact):
        return {}
    ratios: list[torch.Tensor] = []
    own_flips = 0
    for a, b in zip(low, exact):
        if a.values.shape != b.values.shape or a.k != b.k:
            ratios.append(torch.full(a.values.shape[:1], math.inf))
            continue
        ordered = a.values.sort(-1, descending=True).values
        kth, next_ = ordered[:, a.k - 1], ordered[:, a.k]
        rounding = torch.maximum((a.values - b.values).abs().amax(-1), unit * kth.abs())
        ratio = (kth - next_) / rounding.clamp_min(torch.finfo(torch.float32).tiny)
        ratios.append(torch.where(ratio <= ROUNDING_FACTOR, ratio, math.inf))
        own_flips += int((_chosen(a) != _chosen(b)).any(-1).sum())
    flat = torch.cat(ratios) if ratios else torch.zeros(0)
    count = min(FLIP_ROWS * max(own_flips, 1), int(torch.isfinite(flat).sum()))
    if count == 0:
        return {}
    picked = torch.zeros_like(flat, dtype=torch.bool)
    picked[flat.topk(count, largest=False).indices] = True
    found, start = {}, 0
    for index, ratio in enumerate(ratios):
        rows = picked[start : start + ratio.numel()]
        start += ratio.numel()
        if bool(rows.any()):
            found[index] = rows
    return found


def _chosen(call: TopkCall) -> torch.Tensor:
    """A call's chosen set per row, as sorted indices."""
    return call.values.topk(call.k, dim=-1).indices.sort(-1).values


class FlipTopk(TorchFunctionMode):
    """Replays a forward with the given rows of the given ``topk`` calls choosing the other way:
    the (k+1)-th candidate in place of the k-th (values gathered from the input, so gradients
    flow as they would had it been chosen)."""

    def __init__(self, rows: Mapping[int, torch.Tensor]) -> None:
        super().__init__()
        self.rows = dict(rows)
        self.index = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        found = _topk_args(args, kwargs) if func in _TOPK else None
        out = func(*args, **kwargs)
        if found is None:
            return out
        index, self.index = self.index, self.index + 1
        rows = self.rows.get(index)
        if rows is None:
            return out
        x, k = found
        with torch.no_grad():
            order = x.detach().sort(-1, descending=True).indices
        flat = out.indices.reshape(-1, k).clone()
        swapped = order.reshape(-1, x.shape[-1])[:, k]
        flat[:, k - 1] = torch.where(rows.to(flat.device), swapped, flat[:, k - 1])
        indices = flat.reshape(out.indices.shape)
        return torch.return_types.topk((x.gather(-1, indices), indices))


@dataclass(frozen=True)
class FlipAllowance:
    """What choosing the other way at a step's near-ties changes on one device: the largest
    difference of the loss, the gradient norm, each gradient and each buffer (by FQN)."""

    rows: int = 0
    loss: float = 0.0
    grad_norm: float = 0.0
    grads: dict[str, float] = field(default_factory=dict)
    buffers: dict[str, float] = field(default_factory=dict)
