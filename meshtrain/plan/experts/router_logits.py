"""Refusing transformers' own balance loss where it would be each rank's: a transformers MoE
model (Mixtral, Qwen2-MoE, Qwen3-MoE, ...) with ``config.output_router_logits = True`` computes
``load_balancing_loss_func`` inside its forward from the router logits of the tokens it was
given. When the plan splits the batch over several token ranks (data, expert or context axes),
those are each rank's tokens: the loss's token fractions and its gradient would differ from one
device's, silently. Refused at plan time, naming the model and the fix; meshtrain's own MoE
(``MoEConfig(balance="aux_loss")``) sums its fractions over the token ranks instead.

Example:
    >>> from torch import nn
    >>> from meshtrain.spec.mesh import make_mesh
    >>> model = nn.Linear(2, 2)
    >>> model.config = type("Config", (), {"output_router_logits": True})()
    >>> refuse_router_logits(model, make_mesh({"dp": 1}), ("dp",))  # one rank: nothing to refuse
    >>> refuse_router_logits(model, make_mesh({"dp": 2}, world_size=2, abstract=True), ("dp",))
    Traceback (most recent call last):
    ...
    meshtrain.errors.PlanError: Linear has config.output_router_logits=True: ...
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from torch import nn

from meshtrain.errors import PlanError
from meshtrain.spec.mesh import Mesh

__all__ = ["refuse_router_logits"]


def refuse_router_logits(model: nn.Module, mesh: Mesh, axes: Sequence[str | None]) -> None:
    """Raise :class:`PlanError` when ``model.config.output_router_logits`` is true and ``axes``
    (the plan's token axes; ``None`` entries skipped) span more than one rank."""
    config = getattr(model, "config", None)
    if not getattr(config, "output_router_logits", False):
        return
    named = tuple(axis for axis in axes if axis)
    ranks = math.prod(mesh.size(axis) for axis in named)
    if ranks <= 1:
        return
    raise PlanError(
        f"{type(model).__name__} has config.output_router_logits=True: transformers computes its "
        f"load-balancing loss from the router logits of each rank's own tokens, and this plan "
        f"splits the batch over {ranks} ranks (axes {list(named)} of mesh {mesh}), so the loss's "
        "token fractions and gradient would differ from one device's. Set "
        "model.config.output_router_logits = False before planning (meshtrain's step trains the "
        "cross-entropy of the logits), or train meshtrain's MoE with "
        "MoEConfig(balance='aux_loss'), whose balance loss counts every rank's tokens."
    )
