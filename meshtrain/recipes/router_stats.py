"""Router statistics of a mixture-of-experts model, every step, for the metrics sinks.

For each MoE layer of meshtrain's model (:func:`~meshtrain.models.moe.moe_layers`) the tokens its
router sent to each expert in the step's last forward, summed over the batch ranks
(``Plan.batch_axes``: the data axes and the expert axis), and its balance loss, averaged over
them. The metrics are ``moe/tokens_per_expert/<layer>`` (the counts as one string, expert 0
first: sinks record numbers and strings, and the console shows numbers only), ``moe/load_ratio`` (the busiest expert's tokens over the mean, the
largest over layers: 1.0 is perfectly balanced) and ``moe/balance_loss`` (summed over layers).
One all-reduce per step of ``layers × (experts + 1)`` floats, on every rank alike. A pipeline
stage reports its own layers.

Example:
    >>> import torch
    >>> from meshtrain.models.moe import MoEConfig, build_moe
    >>> model = build_moe(MoEConfig.debug())
    >>> _ = model(torch.zeros(1, 8, dtype=torch.long))
    >>> stats = router_metrics(model, None)()
    >>> sum(map(int, stats["moe/tokens_per_expert/layers.1"].split())), stats["moe/load_ratio"] >= 1
    (16, True)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshtrain.lower import PipelinedModel
from meshtrain.models.moe import moe_layers

__all__ = ["router_metrics"]


def router_metrics(
    model: nn.Module | PipelinedModel, group: dist.ProcessGroup | None
) -> Callable[[], dict[str, Any]] | None:
    """A function returning the step's router metrics (module docstring), reduced over
    ``group`` (the batch ranks; None: this process alone); None for a model without MoE layers.
    ``model`` may be this rank's pipeline stages."""
    modules = model.modules if isinstance(model, PipelinedModel) else [model]
    layers = {name: ffn for module in modules for name, ffn in moe_layers(module).items()}
    if not layers:
        return None

    def collect() -> dict[str, Any]:
        ffns = list(layers.values())
        counts = torch.stack([ffn.router.tokens_per_expert.detach().float() for ffn in ffns])
        losses = torch.stack([
            ffn.last_aux_loss.detach().float().reshape(()) if ffn.last_aux_loss is not None
            else counts.new_zeros(())
            for ffn in ffns
        ])  # fmt: skip
        packed = torch.cat([counts.flatten(), losses.to(counts.device)])
        ranks = 1
        if group is not None:
            dist.all_reduce(packed, group=group)
            ranks = dist.get_world_size(group)
        packed = packed.cpu()
        total = packed[: counts.numel()].view_as(counts)
        stats: dict[str, Any] = {}
        ratios = []
        for name, row in zip(layers, total):
            mean = float(row.mean())
            ratios.append(float(row.max()) / mean if mean > 0 else 0.0)
            stats[f"moe/tokens_per_expert/{name}"] = " ".join(str(round(n)) for n in row.tolist())
        stats["moe/load_ratio"] = max(ratios)
        stats["moe/balance_loss"] = float(packed[counts.numel() :].sum()) / ranks
        return stats

    return collect
