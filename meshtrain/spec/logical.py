"""Logical axis names on parameters (Flax/MaxText style), kept on the owning module.

Model code says *what* each parameter dim is (``("vocab", "embed")``) and leaves *where* it goes
to logical-axis rules. The names are stored on the module that owns the parameter, keyed by the
parameter's local name, so they survive ``to_empty``, ``load_state_dict`` and parallelisation
(which may replace Parameter objects but keep modules).

Example:
    >>> import torch
    >>> embedding = torch.nn.Embedding(8, 4)
    >>> _ = annotate(embedding, weight=("vocab", "embed"))
    >>> logical_axes(embedding)
    {'weight': ('vocab', 'embed')}
"""

from __future__ import annotations

from typing import TypeVar

from torch import nn

from meshtrain.errors import RuleError, format_shape

#: Logical names of one parameter, one per dim; ``None`` for a dim no rule should shard.
LogicalAxes = tuple[str | None, ...]

_ATTRIBUTE = "_meshtrain_logical_axes"
ModuleT = TypeVar("ModuleT", bound=nn.Module)


def annotate(module: ModuleT, **axes_by_param: LogicalAxes) -> ModuleT:
    """Attach logical axis names to ``module``'s own parameters and return the module.

    Each keyword is a parameter's local name; its value has one logical name per dim.
    Raises :class:`RuleError` when the parameter does not exist or the rank does not match.
    """
    current: dict[str, LogicalAxes] = dict(getattr(module, _ATTRIBUTE, {}))
    own = dict(module.named_parameters(recurse=False))
    for name, names in axes_by_param.items():
        if name not in own:
            raise RuleError(
                f"cannot annotate '{name}' on {type(module).__name__}: it has no parameter of that name "
                f"(its parameters: {sorted(own) or 'none'}). Annotate the module that owns the parameter."
            )
        names = tuple(names)
        if len(names) != own[name].dim():
            raise RuleError(
                f"logical axes {names!r} for parameter '{name}' of {type(module).__name__} (shape "
                f"{format_shape(own[name].shape)}) give {len(names)} names for {own[name].dim()} dims; "
                "give exactly one logical name (or None) per dim.",
                fqn=name,
                shape=own[name].shape,
            )
        current[name] = names
    object.__setattr__(module, _ATTRIBUTE, current)
    return module


def logical_axes(module: nn.Module) -> dict[str, LogicalAxes]:
    """The logical axis names of ``module``'s own parameters (not its children's)."""
    return dict(getattr(module, _ATTRIBUTE, {}))


def named_logical_axes(model: nn.Module) -> dict[str, LogicalAxes]:
    """Logical names of every annotated parameter of ``model``, keyed by parameter FQN.

    Shared (tied) parameters are reported under the first FQN ``named_parameters`` gives them.
    """
    by_fqn: dict[str, LogicalAxes] = {}
    first_fqn = {id(param): fqn for fqn, param in model.named_parameters()}
    for module_fqn, module in model.named_modules():
        for name, names in logical_axes(module).items():
            param = getattr(module, name, None)
            if param is None:
                continue
            fqn = f"{module_fqn}.{name}" if module_fqn else name
            by_fqn.setdefault(first_fqn.get(id(param), fqn), names)
    return by_fqn
