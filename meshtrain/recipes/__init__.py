"""Recipes: TOML files that name a model, a mesh, rules, parallel options and training settings,
and what is done with them — train (:mod:`~meshtrain.recipes.run`), size
(:mod:`~meshtrain.recipes.sizing`) and shrink for ``meshtrain check``.

The layer above :mod:`meshtrain.train`: recipes know models and the runtime; nothing below
imports them.

Example:
    >>> from meshtrain.recipes import load_recipe
    >>> load_recipe("debug").name
    'debug'
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from meshtrain.recipes.models import FactoryBuilder, HFBuilder, LlamaBuilder
    from meshtrain.recipes.recipe import (
        OptimizerBuilder,
        Recipe,
        apply_overrides,
        describe_shrink,
        load_recipe,
        recipe_from_toml,
        shrink,
    )
    from meshtrain.recipes.schema import parse_spec
    from meshtrain.recipes.sections import (
        CheckpointSection,
        DataSection,
        LoggingSection,
        LoRASection,
        ModelSection,
        ParallelSection,
        PipelineSection,
        TrainSection,
    )

#: Where each public name lives; imported on first use, so reading a recipe's file
#: (:mod:`meshtrain.recipes.source`) and the launcher's checks (:mod:`~meshtrain.recipes.preflight`)
#: import no torch.
_LAZY = {
    **dict.fromkeys(
        (
            "OptimizerBuilder",
            "Recipe",
            "apply_overrides",
            "describe_shrink",
            "load_recipe",
            "recipe_from_toml",
            "shrink",
        ),
        "meshtrain.recipes.recipe",
    ),
    **dict.fromkeys(("FactoryBuilder", "HFBuilder", "LlamaBuilder"), "meshtrain.recipes.models"),
    **dict.fromkeys(
        (
            "CheckpointSection",
            "DataSection",
            "LoggingSection",
            "LoRASection",
            "ModelSection",
            "ParallelSection",
            "PipelineSection",
            "TrainSection",
        ),
        "meshtrain.recipes.sections",
    ),
    "parse_spec": "meshtrain.recipes.schema",
}


def __getattr__(name: str) -> object:
    """A public name, imported on first use."""
    import importlib

    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'meshtrain.recipes' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "CheckpointSection",
    "DataSection",
    "FactoryBuilder",
    "HFBuilder",
    "LlamaBuilder",
    "LoRASection",
    "LoggingSection",
    "ModelSection",
    "OptimizerBuilder",
    "ParallelSection",
    "PipelineSection",
    "Recipe",
    "TrainSection",
    "apply_overrides",
    "describe_shrink",
    "load_recipe",
    "parse_spec",
    "recipe_from_toml",
    "shrink",
]
