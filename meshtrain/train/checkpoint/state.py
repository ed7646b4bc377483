"""What goes into a checkpoint and how it comes back: the tensor state dict keyed by FQN, the
JSON half, and an optimizer made ready to be loaded into (state created, hyper-parameters
restored) with a way to undo that when the load is refused. No collectives here.

Keys: ``model.<fqn>`` for each parameter and ``optim.<fqn>.<state key>`` for each optimizer
state; FQNs lose wrapper segments (activation checkpointing, torch.compile), so a checkpoint
saved with them loads without them. Number-valued optimizer state travels as a 0-d tensor.

Example:
    >>> import torch
    >>> layer = torch.nn.Linear(2, 1)
    >>> sorted(state_dict_to_save(dict(layer.named_parameters()), None, []))
    ['model.bias', 'model.weight']
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from meshtrain.errors import format_shape
from meshtrain.train.checkpoint.files import (
    FORMAT,
    FORMAT_VERSION,
    MODEL_PREFIX,
    OPTIM_PREFIX,
    canonical_fqn,
    format_names,
)

__all__ = [
    "PreparedOptimizer",
    "canonical_params",
    "initialise_optimizer_state",
    "prepare_optimizer",
    "state_dict_to_save",
    "state_json",
    "target_problems",
    "unexpected_message",
]


@dataclass
class PreparedOptimizer:
    """An optimizer made ready for DCP to load into, and how to take that back on failure."""

    optimizer: torch.optim.Optimizer
    targets: dict[str, Tensor]
    numbers: list[tuple[dict[Any, Any], str, Tensor]]  # state dict, key, 0-d tensor loaded
    initialised: list[Tensor]
    original_groups: list[dict[str, Any]]

    def finish(self) -> None:
        """After DCP loaded: number-valued state back to Python numbers."""
        for container, key, loaded in self.numbers:
            container[key] = type(container[key])(loaded.item())

    def undo(self) -> None:
        """The load was refused or failed: drop created state, put hyper-parameters back."""
        for param in self.initialised:
            self.optimizer.state.pop(param, None)
        for group, original in zip(self.optimizer.param_groups, self.original_groups):
            for key in [key for key in group if key != "params" and key not in original]:
                del group[key]
            for key, value in original.items():
                if isinstance(value, Tensor):
                    group[key].copy_(value)
                else:
                    group[key] = value


def prepare_optimizer(
    optimizer: torch.optim.Optimizer,
    saved_optimizer: Mapping[str, Any],
    saved: Mapping[str, Any],
    named: Mapping[str, Tensor],
    problems: list[str],
) -> PreparedOptimizer:
    """Restore the saved hyper-parameters first (they decide which state exists, e.g. amsgrad
    or momentum), create missing state, and list the tensors DCP should load into."""
    original = [
        {key: value.clone() if isinstance(value, Tensor) else value for key, value in group.items()}
        for group in optimizer.param_groups
    ]
    for group in original:
        del group["params"]
    prepared = PreparedOptimizer(optimizer, {}, [], [], original)
    saved_class, groups = saved_optimizer.get("class"), saved_optimizer.get("param_groups", [])
    if saved_class != type(optimizer).__name__:
        problems.append(
            f"it was saved with a {saved_class} optimizer, not {type(optimizer).__name__}: build "
            f"a {saved_class}, or pass optimizer=None to load the model only"
        )
    elif len(groups) != len(optimizer.param_groups):
        problems.append(
            f"its {saved_class} has {len(groups)} param groups, this one "
            f"{len(optimizer.param_groups)}: build the optimizer with the same groups"
        )
    if problems:
        return prepared
    _restore_param_groups(optimizer, groups)
    saved_keys: dict[str, set[str]] = {}
    for key in saved:
        if key.startswith(OPTIM_PREFIX):
            fqn, _, state_key = key[len(OPTIM_PREFIX) :].rpartition(".")
            saved_keys.setdefault(fqn, set()).add(state_key)
    if saved_keys:  # none: saved before the optimizer's first step
        prepared.initialised = initialise_optimizer_state(optimizer)
    for fqn, param in _optimizer_fqns(optimizer, named, problems):
        state = optimizer.state[param] if saved_keys else {}
        for key, value in state.items():
            name = f"{OPTIM_PREFIX}{fqn}.{key}"
            if isinstance(value, Tensor):
                prepared.targets[name] = value.detach()
            elif isinstance(value, (bool, int, float)):
                dtype = torch.float64 if isinstance(value, float) else torch.int64
                prepared.targets[name] = torch.zeros((), dtype=dtype)
                prepared.numbers.append((state, key, prepared.targets[name]))
        left_out = sorted(saved_keys.get(fqn, set()) - set(state))
        if left_out:
            problems.append(
                f"the checkpoint has optimizer state {format_names(left_out)} for {fqn!r} that "
                f"this {saved_class} does not keep: build it with the options it was saved with"
            )
    return prepared


# ----------------------------------------------------------------------------- state dicts


def canonical_params(params: Mapping[str, Tensor], problems: list[str]) -> dict[str, Tensor]:
    """``params`` under their checkpoint FQNs (wrapper segments dropped); clashes are problems."""
    named: dict[str, Tensor] = {}
    for fqn, tensor in params.items():
        canonical = canonical_fqn(fqn)
        if canonical in named and named[canonical] is not tensor:
            problems.append(
                f"parameters {fqn!r} and another both map to FQN {canonical!r} once wrapper "
                "names are dropped: pass each parameter once, under its model FQN"
            )
        named[canonical] = tensor
    return named


def _optimizer_fqns(
    optimizer: torch.optim.Optimizer, named: Mapping[str, Tensor], problems: list[str]
) -> list[tuple[str, Tensor]]:
    fqn_of = {id(tensor): fqn for fqn, tensor in named.items()}
    found = []
    for index, group in enumerate(optimizer.param_groups):
        for param in group["params"]:
            fqn = fqn_of.get(id(param))
            if fqn is None:
                problems.append(
                    f"the optimizer's param group {index} holds a parameter of shape "
                    f"{format_shape(tuple(param.shape))} that is not among the params passed: "
                    "build the optimizer over exactly those parameters"
                )
            else:
                found.append((fqn, param))
    return found


def state_dict_to_save(
    params: Mapping[str, Tensor], optimizer: torch.optim.Optimizer | None, problems: list[str]
) -> dict[str, Tensor]:
    """The tensors DCP saves for this rank: parameters and their optimizer state, by FQN."""
    named = canonical_params(params, problems)
    state_dict = {MODEL_PREFIX + fqn: tensor.detach() for fqn, tensor in named.items()}
    if optimizer is None:
        return state_dict
    for fqn, param in _optimizer_fqns(optimizer, named, problems):
        for key, value in optimizer.state.get(param, {}).items():
            name = f"{OPTIM_PREFIX}{fqn}.{key}"
            if isinstance(value, Tensor):
                state_dict[name] = value.detach()
            elif isinstance(value, (bool, int, float)):
                dtype = torch.float64 if isinstance(value, float) else torch.int64
                state_dict[name] = torch.tensor(value, dtype=dtype)
            elif value is not None:
                problems.append(
                    f"optimizer state {name!r} is a {type(value).__name__}: only tensors and "
                    "numbers can be checkpointed"
                )
    return state_dict


def initialise_optimizer_state(optimizer: torch.optim.Optimizer) -> list[Tensor]:
    """Create the state of parameters that have none, without changing them: one step with zero
    gradients and lr 0 (weight decay is multiplied by lr, so it does nothing either).
    Other parameters' gradients are hidden meanwhile; every gradient and lr is put back."""
    params = [param for group in optimizer.param_groups for param in group["params"]]
    fresh = [param for param in params if param.requires_grad and not optimizer.state.get(param)]
    if not fresh:
        return []
    fresh_ids = {id(param) for param in fresh}
    grads = [param.grad for param in params]
    lrs = [group["lr"] for group in optimizer.param_groups]
    try:
        for param in params:
            param.grad = torch.zeros_like(param) if id(param) in fresh_ids else None
        for group, lr in zip(optimizer.param_groups, lrs):
            group["lr"] = torch.zeros_like(lr) if isinstance(lr, Tensor) else 0.0
        optimizer.step()
    finally:
        for group, lr in zip(optimizer.param_groups, lrs):
            group["lr"] = lr
        for param, grad in zip(params, grads):
            param.grad = grad
    return fresh


def target_problems(targets: Mapping[str, Tensor], saved: Mapping[str, Any]) -> list[str]:
    """What stops DCP loading ``targets`` from a checkpoint whose tensors are ``saved``:
    missing keys, other global shapes or dtypes (this rank's view)."""
    problems = []
    missing = [key for key in targets if key not in saved]
    if any(key.startswith(MODEL_PREFIX) for key in missing):
        problems.append(
            f"parameters missing from the checkpoint: {format_names(missing)}; it was saved from "
            "another model (layer count, names): build the model that saved it"
        )
    elif missing:
        problems.append(
            f"optimizer state missing from the checkpoint: {format_names(missing)}; it was "
            "saved with other optimizer options, or before those parameters had gradients: "
            "build the optimizer it was saved with, or pass optimizer=None"
        )
    for key, target in targets.items():
        entry = saved.get(key)
        if entry is None:
            continue
        if tuple(entry.size) != tuple(target.shape):
            problems.append(
                f"{key!r} has global shape {format_shape(tuple(entry.size))} in the checkpoint "
                f"but {format_shape(tuple(target.shape))} here: build the model that saved it"
            )
        elif entry.properties.dtype != target.dtype:
            problems.append(
                f"{key!r} is {entry.properties.dtype} in the checkpoint but {target.dtype} "
                "here: build the model in the dtype it was saved in"
            )
    return problems


def unexpected_message(unexpected: list[str]) -> str:
    """The problem of checkpoint parameters that no rank loads (a different model)."""
    return (
        f"the checkpoint has parameters that no rank's model has: {format_names(unexpected)}; "
        "it was saved from another model (layer count, names): build the model that saved it"
    )


# --------------------------------------------------------------------- the JSON half


def state_json(
    step: int,
    world_size: int,
    optimizer: torch.optim.Optimizer | None,
    extra: Mapping[str, Any],
    problems: list[str],
) -> str:
    """``meshtrain.json``: format, step, world size, torch version, the optimizer's class and
    hyper-parameters, and the caller's ``extra`` (anything JSON cannot hold is a problem)."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        problems.append(f"step={step!r} must be a whole number ≥ 0")
    bad = _first_non_json(extra, "extra")
    if bad is not None:
        problems.append(
            f"{bad} cannot be written as JSON: encode it first (numbers, strings, lists, dicts; "
            "bytes and tensors as base64 strings)"
        )
        return ""
    optimizer_state = None
    if optimizer is not None:
        optimizer_state = {
            "class": type(optimizer).__name__,
            "param_groups": [_json_hyperparameters(group) for group in optimizer.param_groups],
        }
    state = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "step": step,
        "world_size": world_size,
        "torch_version": torch.__version__,
        "optimizer": optimizer_state,
        "extra": dict(extra),
    }
    return json.dumps(state, indent=1)


def _first_non_json(value: Any, where: str) -> str | None:
    """The path of the first value JSON cannot hold, e.g. ``extra['rng']`` (a Tensor)."""
    if value is None or isinstance(value, (str, int, float, bool)):
        return None
    if isinstance(value, Mapping):
        for key, item in value.items():
            if not isinstance(key, str):
                return f"{where} key {key!r} (a {type(key).__name__}, not a string)"
            found = _first_non_json(item, f"{where}[{key!r}]")
            if found:
                return found
        return None
    if isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            found = _first_non_json(item, f"{where}[{index}]")
            if found:
                return found
        return None
    return f"{where} (a {type(value).__name__})"


def _json_hyperparameters(group: Mapping[str, Any]) -> dict[str, Any]:
    """A param group's hyper-parameters JSON can hold (tensor lrs as numbers, tuples as lists)."""
    hyper: dict[str, Any] = {}
    for key, value in group.items():
        if key == "params":
            continue
        if isinstance(value, Tensor) and value.numel() == 1:
            value = value.item()
        if _first_non_json(value, key) is None:
            hyper[key] = list(value) if isinstance(value, tuple) else value
    return hyper


def _restore_param_groups(optimizer: torch.optim.Optimizer, saved: list[dict[str, Any]]) -> None:
    for group, hyper in zip(optimizer.param_groups, saved):
        for key, value in hyper.items():
            current = group.get(key)
            if isinstance(current, Tensor):
                current.fill_(value)
            else:
                group[key] = tuple(value) if isinstance(current, tuple) else value
