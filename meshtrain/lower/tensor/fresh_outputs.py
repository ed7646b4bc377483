"""Styled outputs the forward updates in place, handed out as fresh tensors.

A tensor-parallel style hands its module's output on as ``DTensor.to_local()``, which autograd
treats as a view made inside a custom function: modifying it in place (``out += residual`` right
after a row-wise Linear) fails at the first forward ("Output 0 of _ToTorchTensorBackward is a view
and is being modified inplace"). The plan-time abstract run finds such modules
(``Plan.fresh_outputs``); their output is copied once after the style's own output hook, so the
forward runs as written and backward is unchanged.

Example (inside :func:`~meshtrain.lower.flat.parallelize`, after tensor parallelism)::

    fresh_outputs(plan, model)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from meshtrain.plan.ir import Plan


def fresh_outputs(plan: Plan, model: nn.Module) -> None:
    """Copy the output of every module of ``plan.fresh_outputs`` that ``model`` holds."""
    modules = dict(model.named_modules())
    for fqn in plan.fresh_outputs:
        if fqn in modules:
            modules[fqn].register_forward_hook(_fresh)


def _fresh(module: nn.Module, args: Any, output: Any) -> Any:
    return output.clone() if isinstance(output, torch.Tensor) else output
