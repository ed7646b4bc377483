"""Dynamic loss scaling for fp16 that decides the same on every rank.

fp16 gradients underflow without scaling and overflow with too much. The loss is multiplied by
``scale`` before backward; after it, gradients are divided by ``scale`` and checked for inf/NaN.
With sharded gradients each rank sees only its shards, so the "found non-finite" flag is
all-reduced (max) over every rank before anyone decides: either every rank steps or every rank
skips, and the scale stays identical everywhere. On overflow the scale is multiplied by
``backoff_factor`` (never below ``min_scale``); after ``growth_interval`` finite steps in a row,
by ``growth_factor``. ``hysteresis`` overflows are needed before the scale backs off, as
DeepSpeed counts them: each overflow skips its step and uses one, the last one backs off, and
the count is refilled only when the scale grows. ``dynamic=False`` keeps ``init_scale`` fixed
(DeepSpeed's static ``loss_scale``): overflowing steps are still skipped on every rank.

Example (on every rank, fp16 plan)::

    scaler = LossScaler()
    scaler.scale(loss).backward()
    if scaler.unscale_(model.parameters()):      # False on every rank when any rank overflowed
        clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    scaler.update()
    optimizer.zero_grad()

    >>> LossScaler(init_scale=8.0).scale(torch.tensor(2.0))
    tensor(16.)
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from meshtrain.errors import PlanError


class LossScaler:
    """Loss scale state and the unscale/check/update steps (see the module docstring)."""

    def __init__(
        self,
        init_scale: float = 2.0**16,
        *,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        hysteresis: int = 1,
        min_scale: float = 0.0,
        dynamic: bool = True,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        if (not init_scale > 0 or not growth_factor > 1 or not 0 < backoff_factor < 1
                or growth_interval < 1 or hysteresis < 1 or not 0 <= min_scale <= init_scale):  # fmt: skip
            raise PlanError(
                f"LossScaler(init_scale={init_scale}, growth_factor={growth_factor}, "
                f"backoff_factor={backoff_factor}, growth_interval={growth_interval}, "
                f"hysteresis={hysteresis}, min_scale={min_scale}) needs init_scale > 0, "
                "growth_factor > 1, 0 < backoff_factor < 1, growth_interval ≥ 1, "
                "hysteresis ≥ 1 and 0 ≤ min_scale ≤ init_scale."
            )
        self.scale_value = float(init_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self.min_scale = float(min_scale)
        self.dynamic = dynamic
        self.group = group
        self.finite_steps = 0
        self.skipped_steps = 0
        self.overflows_left = hysteresis
        self._found_inf: bool | None = None

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss × scale`` (call ``backward`` on this)."""
        return loss * self.scale_value

    @torch.no_grad()
    def unscale_(
        self, parameters: Iterable[torch.nn.Parameter], scale: float | None = None
    ) -> bool:
        """Divide gradients by ``scale`` (default: the scaler's own value) in place; True when
        every rank's gradients are finite. The train step passes the scale its gradients carry
        when a data-parallel mean divides them after backward (see ``TrainStep``)."""
        groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for param in parameters:
            grad = param.grad
            if grad is None:
                continue
            local = grad.to_local() if isinstance(grad, DTensor) else grad
            groups.setdefault((local.device, local.dtype), []).append(local)
        flag_device = _flag_device(self.group)
        found = torch.zeros(1, device=flag_device)
        for (device, _), grads in groups.items():  # the flag and 1/scale live beside the grads
            found_here = torch.zeros(1, device=device)
            inverse = torch.full(
                (1,), 1.0 / (self.scale_value if scale is None else scale), device=device
            )
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found_here, inverse)
            found = torch.maximum(found, found_here.to(flag_device))
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(found, op=dist.ReduceOp.MAX, group=self.group)
        self._found_inf = bool(found.item())
        return not self._found_inf

    def update(self) -> None:
        """Adjust the scale after a step (back off on overflow, grow after a finite streak)."""
        if self._found_inf is None:
            raise PlanError("LossScaler.update() before unscale_(): unscale the gradients first.")
        if self._found_inf:
            self.finite_steps = 0
            self.skipped_steps += 1
            if self.dynamic and self.overflows_left == 1:
                self.scale_value = max(self.scale_value * self.backoff_factor, self.min_scale)
            elif self.dynamic:
                self.overflows_left -= 1
        else:
            self.finite_steps += 1
            if self.dynamic and self.finite_steps == self.growth_interval:
                self.scale_value *= self.growth_factor
                self.finite_steps = 0
                self.overflows_left = self.hysteresis
        self._found_inf = None

    def state_dict(self) -> dict[str, float | int]:
        return {
            "scale": self.scale_value,
            "finite_steps": self.finite_steps,
            "skipped_steps": self.skipped_steps,
            "overflows_left": self.overflows_left,
        }

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        self.scale_value = float(state["scale"])
        self.finite_steps = int(state["finite_steps"])
        self.skipped_steps = int(state["skipped_steps"])
        self.overflows_left = int(state.get("overflows_left", self.hysteresis))


def _flag_device(group: dist.ProcessGroup | None) -> torch.device:
    """CUDA under NCCL (which reduces CUDA tensors only), else the CPU."""
    if dist.is_available() and dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
