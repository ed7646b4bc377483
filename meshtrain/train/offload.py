"""Optimizer-state offload: the optimizer's states live on the host between steps, and each
parameter's states visit its device only for that parameter's update.

FSDP2's ``CPUOffloadPolicy`` (``offload=True`` in a plan) moves parameters, gradients and
optimizer states to the host and steps there. ``offload_optimizer=True`` moves only the states:
parameters and gradients stay on the device, the update runs there, one parameter at a time, so
the device holds one parameter's states at most during the step and none while forward and
backward run. The update is the optimizer's own (``step`` on one parameter at a time gives the
same values for element-wise optimizers: SGD, Adam, AdamW). On a machine without an accelerator
host and device are one and the states stay where they are.

Example:
    >>> import torch
    >>> param = torch.nn.Parameter(torch.ones(3))
    >>> optimizer = offload_states(torch.optim.AdamW([param], lr=0.1))
    >>> param.grad = torch.ones(3)
    >>> optimizer.step()
    >>> type(optimizer).__name__, optimizer.state[param]["exp_avg"].device.type
    ('AdamW', 'cpu')
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch.distributed.tensor import DTensor

from meshtrain.errors import PlanError

OptimizerT = TypeVar("OptimizerT", bound=torch.optim.Optimizer)

#: optimizers whose update is element-wise, so stepping one parameter at a time is exact
ELEMENTWISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)


def offload_states(optimizer: OptimizerT, host: str | torch.device = "cpu") -> OptimizerT:
    """``optimizer`` (changed in place) keeping its states on ``host`` between steps; its class
    name, state keys and state dict stay the same (checkpoints load either way). Offloading an
    offloaded optimizer changes nothing."""
    if isinstance(optimizer, _HostStates):
        return optimizer
    if not isinstance(optimizer, ELEMENTWISE):
        raise PlanError(
            f"offload_optimizer keeps states on the host and steps one parameter at a time, which "
            f"is exact for element-wise optimizers only ({[c.__name__ for c in ELEMENTWISE]}); "
            f"got {type(optimizer).__name__}. Use one of those, or offload=True (FSDP2's full "
            "CPU offload)."
        )
    base = type(optimizer)
    optimizer.__class__ = type(base.__name__, (_HostStates, base), {"_host": torch.device(host)})
    return optimizer


class _HostStates(torch.optim.Optimizer):
    """Mixed in before the optimizer's class by :func:`offload_states`."""

    _host: torch.device

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        groups = [group["params"] for group in self.param_groups]
        try:
            for index, params in enumerate(groups):
                for param in params:
                    if param.grad is None:
                        continue
                    for group in self.param_groups:
                        group["params"] = []
                    self.param_groups[index]["params"] = [param]
                    _move(self.state[param], _device(param))
                    super().step()
                    _move(self.state[param], self._host)
        finally:
            for group, params in zip(self.param_groups, groups):
                group["params"] = params
        return loss


def _device(tensor: torch.Tensor) -> torch.device:
    return tensor.to_local().device if isinstance(tensor, DTensor) else tensor.device


def _move(state: dict[str, Any], device: torch.device) -> None:
    """Each state tensor's data to ``device`` (a DTensor's local shard; scalars such as Adam's
    ``step`` stay where the optimizer keeps them)."""
    for key, value in state.items():
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            continue
        local = value._local_tensor if isinstance(value, DTensor) else value
        if local.device == device:
            continue
        moved = local.to(device)
        if isinstance(value, DTensor):
            value._local_tensor = moved
        else:
            state[key] = moved
