"""Training runtime pieces: loss normalisation by global tokens, global-norm clipping and fp16
loss scaling."""

from meshtrain.train.clip import clip_grad_norm_, global_grad_norm
from meshtrain.train.loss import global_token_count
from meshtrain.train.scaler import LossScaler

__all__ = ["LossScaler", "clip_grad_norm_", "global_grad_norm", "global_token_count"]
