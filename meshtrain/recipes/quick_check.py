"""The schema's checks that need no torch, run by the launcher before torch is imported.

The full schema (:mod:`meshtrain.recipes.schema`) resolves every key's type, and some types come
from layers that import torch (precision, checkpointing modes, ZeRO stages, wandb modes,
``on_nonfinite``, the model config). This runs the same checks — the same messages — on
everything that does not: unknown sections, unknown keys in every section but ``[model]`` (whose
keys include the model config's), and each key's type, choices and bounds where its type is the
sections' own. The full schema still runs afterwards, on the rest.

Example:
    >>> check_recipe_quickly({"model": {}, "mesh": {"dp": 2}, "train": {"steps": "abc"}}, "r.toml")
    Traceback (most recent call last):
    meshtrain.errors.RecipeError: r.toml: train.steps = "abc" is a string, but steps must be a positive integer. Write e.g. steps = 3.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from collections.abc import Mapping
from typing import Any

from meshtrain.errors import RecipeError, did_you_mean
from meshtrain.recipes import sections
from meshtrain.recipes.schema import Key, _derive, check_sections, check_table
from meshtrain.recipes.sections import SECTION_TYPES
from meshtrain.tables import toml_value

__all__ = ["check_recipe_quickly"]

#: The names the sections' annotations take from layers that import torch.
_LOWER_NAMES = (
    "LlamaConfig",
    "Checkpointing",
    "Precision",
    "ZeroStage",
    "WandbMode",
    "OnNonFinite",
    "DocumentFormat",
    "Decay",
)


class _Unresolved:
    """Stands for a type that lives in a layer importing torch."""


@functools.cache
def _quick_keys(section: str) -> tuple[tuple[str, ...], dict[str, Key]]:
    """Every key name of ``section``, and the :class:`Key` of those whose type needs no torch."""
    section_type = SECTION_TYPES[section]
    assert dataclasses.is_dataclass(section_type) and isinstance(section_type, type)
    localns = dict.fromkeys(_LOWER_NAMES, _Unresolved)
    hints = typing.get_type_hints(section_type, vars(sections), localns)
    names, keys = [], {}
    for field in dataclasses.fields(section_type):
        if field.metadata.get("subsection") is not None:
            continue  # a table of its own, checked as its own section
        name = field.metadata.get("toml") or field.name
        names.append(name)
        lazy_choices = callable(field.metadata.get("choices"))  # a lower layer's vocabulary
        if "_Unresolved" not in repr(hints[field.name]) and not lazy_choices:
            keys[name] = _derive(field, hints[field.name])
    return tuple(names), keys


def check_recipe_quickly(data: Mapping[str, Any], source: str) -> None:
    """Raise the schema's :class:`RecipeError` for what can be judged without torch (see the
    module docstring)."""
    check_sections(source, data)
    for section, table in _tables(data):
        if section == "model" or not isinstance(SECTION_TYPES.get(section), type):
            continue
        names, keys = _quick_keys(section)
        plain = {
            key: value for key, value in table.items() if f"{section}.{key}" not in SECTION_TYPES
        }
        for key, value in plain.items():
            if key not in names:
                raise RecipeError(
                    f"{source}: unknown key {section}.{key} = {toml_value(value)}"
                    f"{did_you_mean(key, list(names), f'keys of [{section}]')}. Remove it or use "
                    "one of those keys."
                )
        known = {key: value for key, value in plain.items() if key in keys}
        check_table(source, section, known, keys=keys)


def _tables(data: Mapping[str, Any], prefix: str = "") -> list[tuple[str, Mapping[str, Any]]]:
    """``(section, table)`` for each table, nested ones (``parallel.pipeline``) included."""
    found = []
    for name, table in data.items():
        section = f"{prefix}{name}"
        if isinstance(table, Mapping) and section in SECTION_TYPES:
            found.append((section, table))
            found += _tables(table, f"{section}.")
    return found
