"""``TrainState``: everything a training run is, as one optree pytree.

Leaves: the parameters (by FQN; DTensors under a plan), the optimizer state (by FQN and state
key), the step, the RNG state and the data position. The planned model and its optimizer ride
along as static metadata: they are what the tensors belong to, not values to map over.

PyTorch updates parameters in place, so a state returned by the train step shares its tensors
with the state passed in: treat the returned state as the current one and the old one as spent
(as one would after ``jax.jit(..., donate_argnums=0)``).

Example:
    >>> import optree, torch
    >>> model = torch.nn.Linear(2, 2)
    >>> state = TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
    >>> sorted(state.params), state.step
    (['bias', 'weight'], 0)
    >>> len(optree.tree_leaves(state, namespace=NAMESPACE))  # 2 params, step, rng, position
    5
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import optree
import torch

from meshtrain.train.batch import DataPosition

#: The optree namespace :class:`TrainState` is registered in (``optree.tree_map(fn, state,
#: namespace=NAMESPACE)``).
NAMESPACE = "meshtrain"


@dataclass(frozen=True)
class TrainState:
    """One training run's state; see the module docstring. Build it with :meth:`create`."""

    params: dict[str, torch.Tensor]
    opt_state: dict[str, dict[str, torch.Tensor]]
    step: int
    rng: torch.Tensor
    data: DataPosition
    model: Any = dataclasses.field(compare=False)
    optimizer: torch.optim.Optimizer = dataclasses.field(compare=False)

    @classmethod
    def create(
        cls,
        model: Any,
        optimizer: torch.optim.Optimizer,
        *,
        step: int = 0,
        data: DataPosition | None = None,
        rng: torch.Tensor | None = None,
    ) -> TrainState:
        """The state of ``model`` (an ``nn.Module`` or what ``plan.apply`` returned) and its
        ``optimizer``; ``rng`` defaults to the current CPU generator state."""
        params = dict(_named_parameters(model))
        return cls(
            params=params,
            opt_state=_optimizer_state(optimizer, params),
            step=step,
            rng=torch.get_rng_state() if rng is None else rng,
            data=data if data is not None else DataPosition(),
            model=model,
            optimizer=optimizer,
        )

    def advance(self, *, data: DataPosition, rng: torch.Tensor) -> TrainState:
        """The state after one optimizer step (parameters and optimizer state read afresh)."""
        return dataclasses.replace(
            self,
            opt_state=_optimizer_state(self.optimizer, self.params),
            step=self.step + 1,
            rng=rng,
            data=data,
        )


def _named_parameters(model: Any) -> Iterator[tuple[str, torch.Tensor]]:
    yield from model.named_parameters()


def _optimizer_state(
    optimizer: torch.optim.Optimizer, params: dict[str, torch.Tensor]
) -> dict[str, dict[str, torch.Tensor]]:
    return {
        fqn: {
            key: value
            for key, value in optimizer.state.get(param, {}).items()
            if isinstance(value, torch.Tensor)
        }
        for fqn, param in params.items()
    }


def _flatten(state: TrainState) -> tuple[tuple[Any, ...], tuple[Any, Any], tuple[str, ...]]:
    children = (state.params, state.opt_state, state.step, state.rng, state.data)
    return children, (state.model, state.optimizer), ("params", "opt_state", "step", "rng", "data")


def _unflatten(metadata: tuple[Any, Any], children: Any) -> TrainState:
    params, opt_state, step, rng, data = children
    model, optimizer = metadata
    return TrainState(params, opt_state, step, rng, data, model, optimizer)


optree.register_pytree_node(
    TrainState,  # type: ignore[arg-type]
    _flatten,  # type: ignore[arg-type]
    _unflatten,  # type: ignore[arg-type]
    namespace=NAMESPACE,
)
