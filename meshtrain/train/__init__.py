"""The training runtime: ``TrainState`` and the train step, the learning-rate schedule, loss
normalisation by global tokens, global-norm clipping and fp16 loss scaling.

Data (:mod:`meshtrain.train.data`), checkpoints (:mod:`meshtrain.train.checkpoint`) and metrics
(:mod:`meshtrain.train.metrics`) are imported from their modules (they pull in DCP, numpy memory
maps, wandb). The loop a recipe describes is :func:`meshtrain.recipes.run.train`. Each name
here is imported from its module on first use.
"""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from meshtrain.train.batch import Batch, DataPosition
    from meshtrain.train.clip import clip_grad_norm_, global_grad_norm
    from meshtrain.train.loss import IGNORE_INDEX, global_token_count, summed_cross_entropy
    from meshtrain.train.scaler import LossScaler
    from meshtrain.train.schedule import WarmupCosine, linear_scaling
    from meshtrain.train.state import TrainState
    from meshtrain.train.step import TrainStep, forward_backward, make_train_step

#: each name → its module, imported on first use: ``import meshtrain.train.data.documents`` (a
#: vocabulary the recipe schema reads) no longer pulls in the train step, DTensor and dynamo
_HOMES = {
    "Batch": "batch",
    "DataPosition": "batch",
    "clip_grad_norm_": "clip",
    "global_grad_norm": "clip",
    "IGNORE_INDEX": "loss",
    "global_token_count": "loss",
    "summed_cross_entropy": "loss",
    "LossScaler": "scaler",
    "WarmupCosine": "schedule",
    "linear_scaling": "schedule",
    "TrainState": "state",
    "TrainStep": "step",
    "forward_backward": "step",
    "make_train_step": "step",
}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'meshtrain.train' has no attribute {name!r}")
    return getattr(importlib.import_module(f"meshtrain.train.{_HOMES[name]}"), name)


__all__ = [
    "IGNORE_INDEX",
    "Batch",
    "DataPosition",
    "LossScaler",
    "TrainState",
    "TrainStep",
    "WarmupCosine",
    "clip_grad_norm_",
    "forward_backward",
    "global_grad_norm",
    "global_token_count",
    "linear_scaling",
    "make_train_step",
    "summed_cross_entropy",
]
