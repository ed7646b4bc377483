"""Training runtime pieces: loss normalisation by global tokens and global-norm clipping."""

from meshtrain.train.clip import clip_grad_norm_, global_grad_norm
from meshtrain.train.loss import global_token_count

__all__ = ["clip_grad_norm_", "global_grad_norm", "global_token_count"]
