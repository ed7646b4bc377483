"""The training runtime: ``TrainState`` and the train step, the learning-rate schedule, loss
normalisation by global tokens, global-norm clipping and fp16 loss scaling.

Data (:mod:`meshtrain.train.data`), checkpoints (:mod:`meshtrain.train.checkpoint`) and metrics
(:mod:`meshtrain.train.metrics`) are imported from their modules (they pull in DCP, numpy memory
maps, wandb). The loop a recipe describes is :func:`meshtrain.recipes.run.train`.
"""

from meshtrain.train.batch import Batch, DataPosition
from meshtrain.train.clip import clip_grad_norm_, global_grad_norm
from meshtrain.train.loss import IGNORE_INDEX, global_token_count, summed_cross_entropy
from meshtrain.train.scaler import LossScaler
from meshtrain.train.schedule import WarmupCosine, linear_scaling
from meshtrain.train.state import TrainState
from meshtrain.train.step import TrainStep, forward_backward, make_train_step

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
