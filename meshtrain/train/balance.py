"""The train step's part in mixture-of-experts balancing, for any model that takes it (meshtrain's
:class:`~meshtrain.models.moe.MoE` does; a model without these methods is left alone):

- :func:`set_aux_scale`, before each step's forward: the factor on the balance loss's injected
  gradient (``set_aux_loss_scale``), so that with the step's loss normalised by the GLOBAL loss
  tokens the gradients equal one device's ``loss / global_tokens + aux_loss_coef · aux``.
  Each of the ``R`` token ranks and ``M`` micro-batches backpropagates its share of the balance
  loss (whose mean over the ranks is the micro-batch's global loss, see
  :func:`~meshtrain.models.moe_experts.load_balance_loss`); the data-parallel reduction then
  multiplies by ``R / backward_factor`` (1 under the mean, ``R`` under the sum), so the factor is
  ``loss_scale · backward_factor / (R · M)``: the mean over micro-batches of their balance losses,
  as one device accumulating ``M`` micro-batches trains it.
- :func:`after_optimizer_step`, after each optimizer step that was taken: the loss-free balancing
  update (``after_optimizer_step`` of the model: its biases moved from the step's counts summed
  over the token ranks).

Example (inside :func:`~meshtrain.train.forward_backward`)::

    set_aux_scale(model, loss_scale * backward_factor(plan) / (data_parallel_size(plan) * micro))
"""

from __future__ import annotations

from typing import Any

from torch import nn

from meshtrain.lower.pipeline import PipelinedModel

__all__ = ["after_optimizer_step", "set_aux_scale"]


def _roots(model: Any) -> list[nn.Module]:
    """The modules a flat model or this rank's pipeline stages consist of."""
    return list(model.modules) if isinstance(model, PipelinedModel) else [model]


def set_aux_scale(model: Any, scale: float) -> None:
    """Call ``set_aux_loss_scale(scale)`` on every root module that has it."""
    for root in _roots(model):
        setter = getattr(root, "set_aux_loss_scale", None)
        if callable(setter):
            setter(scale)


def begin_step(model: Any) -> None:
    """Call ``begin_step()`` on every root module that has it (meshtrain's MoE: its routers count
    the step's whole batch, every micro-batch of it)."""
    for root in _roots(model):
        hook = getattr(root, "begin_step", None)
        if callable(hook):
            hook()


def after_optimizer_step(model: Any) -> None:
    """Call ``after_optimizer_step()`` on every root module that has it (no collective: the
    counts meshtrain's MoE moves its biases from were already summed over the token ranks by
    the count reducer during the forward)."""
    for root in _roots(model):
        hook = getattr(root, "after_optimizer_step", None)
        if callable(hook):
            hook()
