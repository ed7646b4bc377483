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
from meshtrain.recipes.schema import (
    CheckpointSection,
    DataSection,
    LoggingSection,
    ModelSection,
    ParallelSection,
    PipelineSection,
    TrainSection,
    parse_spec,
)

__all__ = [
    "CheckpointSection",
    "DataSection",
    "FactoryBuilder",
    "HFBuilder",
    "LlamaBuilder",
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
