"""Element-wise bounds on one optimizer step, given a bound on the gradient it was fed.

Both runs start the step from the same parameters and optimizer states (the harness re-syncs
them), so the only difference entering the update is the gradient's: at most ``delta`` per
element (absolute; a number, or a tensor of one bound per element). Under Adam, where
``delta`` spans zero the comparison can only check that each update is at most ``lr``. What that
does to the new parameters depends on the update rule:

* SGD (momentum μ, dampening d, weight decay, Nesterov): the update is linear in the gradient,
  ``|Δθ| ≤ lr · (1 - d) · (1 + μ·nesterov) · delta``.
* Adam / AdamW: the update ``lr · m̂ / (√v̂ + eps)`` is not Lipschitz where ``v̂`` is near zero.
  Over the interval ``g ± delta`` the mean-value theorem bounds the change by
  ``|Δm̂| / (s + eps) + |m̂| · |Δv̂| / (2 s (s + eps)²)``, with ``s`` the smallest ``√v̂`` on the
  interval. Where a gradient is within ``delta`` of zero at step one, ``s`` is 0 and the change
  can be a whole update of either sign — Adam's first steps are close to ``lr · sign(g)``, so a
  reduction-order difference in a near-zero gradient legitimately moves a parameter by up to
  ``2 lr``. The bound is capped there by ``lr · (|f| + max |f|)``, ``f`` the reference's update
  direction: never more than the largest update the reference made.

Each bound adds the rounding of both results (2ε·|value|: one ulp each side, where the two may
straddle a power of two) and of the update itself (2ε·|update|). Other optimizers have no update model
here: the harness then checks loss and gradients at every step and reports, but does not bound,
their parameters.

Example:
    >>> import torch
    >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1, momentum=0.9)
    >>> rule = update_rule(opt)
    >>> rule.kind, rule.lr
    ('sgd', 0.1)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from meshtrain.testing.contract import EPS_FP32

#: Absolute rounding of float32 below its normal range: half the smallest subnormal per operation,
#: and an update is a handful of operations on each side (the relative ε model stops there).
UNDERFLOW_FP32 = 8 * 2.0**-150

#: Optimizer state entries compared after each step, per update rule.
STATE_KEYS = {"sgd": ("momentum_buffer",), "adam": ("exp_avg", "exp_avg_sq"), "none": ()}


@dataclass(frozen=True)
class UpdateRule:
    """The hyper-parameters of one optimizer's update (``kind`` 'sgd', 'adam' or 'none')."""

    kind: str
    lr: float = 0.0
    momentum: float = 0.0
    dampening: float = 0.0
    nesterov: bool = False
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    name: str = ""


def update_rule(optimizer: torch.optim.Optimizer) -> UpdateRule:
    """The update rule of ``optimizer`` (its first parameter group), or kind 'none'."""
    group = optimizer.param_groups[0]
    name = type(optimizer).__name__
    if len(optimizer.param_groups) > 1 and any(
        g["lr"] != group["lr"] for g in optimizer.param_groups
    ):
        return UpdateRule("none", name=f"{name} with per-group learning rates")
    if isinstance(optimizer, torch.optim.SGD):
        return UpdateRule(
            "sgd",
            lr=float(group["lr"]),
            momentum=float(group["momentum"]),
            dampening=float(group["dampening"]),
            nesterov=bool(group["nesterov"]),
            name=name,
        )
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)) and not group.get("amsgrad"):
        beta1, beta2 = group["betas"]
        return UpdateRule(
            "adam",
            lr=float(group["lr"]),
            betas=(float(beta1), float(beta2)),
            eps=float(group["eps"]),
            name=name,
        )
    return UpdateRule("none", name=name)


def param_bound(
    rule: UpdateRule,
    grad: torch.Tensor,
    delta: float | torch.Tensor,
    old_state: dict[str, torch.Tensor],
    step: int,
    new_param: torch.Tensor,
) -> torch.Tensor:
    """Element-wise bound on ``|θ_plan − θ_reference|`` after one step (see the module doc).

    ``grad`` is the reference's (clipped) gradient, ``old_state`` its optimizer state before the
    step (empty at step one), ``step`` the 1-based step count, ``new_param`` its new value.
    """
    rounding = 2 * EPS_FP32 * new_param.abs() + UNDERFLOW_FP32
    if rule.kind == "sgd":
        gain = (1 - rule.dampening if old_state else 1.0) * (1 + rule.momentum * rule.nesterov)
        buffer = old_state.get("momentum_buffer", torch.zeros_like(grad)).abs()
        step_size = rule.lr * (gain * (grad.abs() + delta) + 2 * rule.momentum * buffer)
        return rule.lr * gain * delta + rounding + 2 * EPS_FP32 * step_size
    beta1, beta2 = rule.betas
    bc1, bc2 = 1 - beta1**step, 1 - beta2**step
    # in float64: products of tiny gradients and perturbations underflow fp32 to 0, and a 0/0
    # read as "no change" would hide a real one (a 1e-30 perturbation moves Adam by ~1e-26)
    dtype = new_param.dtype
    grad = grad.double()
    m_old = old_state.get("exp_avg", torch.zeros_like(grad)).double()
    v_old = old_state.get("exp_avg_sq", torch.zeros_like(grad)).double()
    smallest_g = (grad.abs() - delta).clamp_min(0)
    s_min = ((beta2 * v_old + (1 - beta2) * smallest_g**2) / bc2).sqrt()
    dm_hat = (1 - beta1) * delta / bc1
    dv_hat = (1 - beta2) * (2 * grad.abs() + delta) * delta / bc2
    m_hat_max = (beta1 * m_old.abs() + (1 - beta1) * (grad.abs() + delta)) / bc1
    slope = dm_hat / (s_min + rule.eps) + m_hat_max * dv_hat / (2 * s_min * (s_min + rule.eps) ** 2)
    m_hat = (beta1 * m_old + (1 - beta1) * grad) / bc1
    v_hat = (beta2 * v_old + (1 - beta2) * grad**2) / bc2
    direction = (m_hat / (v_hat.sqrt() + rule.eps)).abs()
    cap = direction + _largest_direction(rule, m_old, v_old, grad, delta, bc1, bc2)
    change = torch.minimum(torch.nan_to_num(slope, nan=0.0, posinf=torch.inf), cap)
    # torch scales m by lr / bc1 before dividing by √v̂ + eps: that product can be subnormal, and
    # its absolute rounding (UNDERFLOW_FP32) is divided by at least eps, on either side
    underflow = 2 * UNDERFLOW_FP32 / rule.eps
    bound = rule.lr * change + rounding + underflow + 2 * EPS_FP32 * rule.lr * (direction + change)
    return bound.to(dtype)


def _largest_direction(
    rule: UpdateRule,
    m_old: torch.Tensor,
    v_old: torch.Tensor,
    grad: torch.Tensor,
    delta: float | torch.Tensor,
    bc1: float,
    bc2: float,
) -> torch.Tensor:
    """The largest ``|m̂ / √v̂|`` any gradient in ``grad ± delta`` gives (an upper bound on the
    plan's update direction): ``(A + Bx) / √(C + Dx²)`` peaks at an end of the interval or at
    ``x = BC / (AD)``."""
    beta1, beta2 = rule.betas
    a, b = beta1 * m_old.double() / bc1, (1 - beta1) / bc1
    c, d = beta2 * v_old.double() / bc2, (1 - beta2) / bc2
    low, high = grad.double() - delta, grad.double() + delta
    critical = torch.where(a != 0, b * c / (a * d), low).clamp(min=low, max=high)
    best = torch.zeros_like(low)
    for x in (low, high, critical):
        numerator, denominator = (a + b * x).abs(), (c + d * x * x).sqrt()
        value = torch.where(denominator > 0, numerator / denominator.clamp_min(1e-300), 0.0)
        best = torch.maximum(best, value)
    return best.to(grad.dtype)


def state_bound(
    rule: UpdateRule,
    key: str,
    grad: torch.Tensor,
    delta: float | torch.Tensor,
    new_state: torch.Tensor,
) -> torch.Tensor:
    """Element-wise bound on one optimizer state entry's difference after the step, plus the
    rounding of both sides: 2ε of the largest term the update adds up. A moving average's
    terms can cancel (``β·m`` against ``(1 - β)·g``), so the terms — the weighted gradient, and
    the decayed old state, at most the new state plus that — bound the rounding, not the
    (possibly tiny) result."""
    beta1, beta2 = rule.betas
    size = grad.abs() + delta
    if key == "momentum_buffer":
        change = torch.zeros_like(new_state) + delta
        terms = new_state.abs() + 2 * size  # μ·buf ≤ |new| + |g|, and the gradient term
    elif key == "exp_avg":
        change = torch.zeros_like(new_state) + (1 - beta1) * delta
        terms = new_state.abs() + 2 * (1 - beta1) * size
    else:
        change = (1 - beta2) * (2 * grad.abs() + delta) * delta
        terms = new_state.abs()  # both terms are non-negative: the sum bounds each
    return change + 2 * EPS_FP32 * (terms + change) + UNDERFLOW_FP32
