"""Router statistics of a mixture-of-experts model, every step, for the metrics sinks.

For each MoE layer of meshtrain's model (:func:`~meshtrain.models.moe.moe_layers`) the tokens its
router sent to each expert in the step's last forward over the whole batch (the routers' counts,
already summed over the token ranks by the count reducer lowering installs) and the whole
batch's balance loss, exactly as :func:`~meshtrain.models.moe.moe_stats` computes them (one
all-reduce per step of ``layers × experts`` probability sums over the token ranks, on every rank
alike; under any ``balance``). The metrics are ``moe/tokens_per_expert/<layer>`` (the counts as
one string, expert 0 first: sinks record numbers and strings, and the console shows numbers
only), ``moe/load_ratio`` (the busiest expert's tokens over the mean, the largest over layers:
1.0 is perfectly balanced) and ``moe/balance_loss`` (summed over layers). A pipeline stage
reports its own layers.

Example:
    >>> import torch
    >>> from meshtrain.models.moe import MoEConfig, build_moe
    >>> model = build_moe(MoEConfig.debug())
    >>> _ = model(torch.zeros(1, 8, dtype=torch.long))
    >>> stats = router_metrics(model)()
    >>> sum(map(int, stats["moe/tokens_per_expert/layers.1"].split())), stats["moe/load_ratio"] >= 1
    (16, True)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from meshtrain.lower import PipelinedModel
from meshtrain.models.moe import moe_layers, moe_stats

__all__ = ["router_metrics"]


def router_metrics(model: nn.Module | PipelinedModel) -> Callable[[], dict[str, Any]] | None:
    """A function returning the step's router metrics (module docstring); None for a model
    without MoE layers. ``model`` may be this rank's pipeline stages. The sums run over the
    token ranks (context ranks included) through the count reducer of the layers
    (``mt.apply`` installs it)."""
    modules = model.modules if isinstance(model, PipelinedModel) else [model]
    modules = [module for module in modules if moe_layers(module)]
    if not modules:
        return None

    def collect() -> dict[str, Any]:
        stats: dict[str, Any] = {}
        ratios, loss = [], 0.0
        for module in modules:
            found = moe_stats(module)
            for name, value in found.items():
                if name.startswith("moe/tokens_per_expert/"):
                    stats[name] = " ".join(str(n) for n in value)
            ratios.append(found["moe/load_ratio"])
            loss += found["moe/balance_loss"]
        stats["moe/load_ratio"] = max(ratios)
        stats["moe/balance_loss"] = loss
        return stats

    return collect
