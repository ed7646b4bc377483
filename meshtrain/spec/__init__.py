"""The spec layer: ``P``, meshes, rules, P ⇄ DTensor placements and the error hierarchy.

Nothing here issues a collective; only :func:`make_mesh` creates process groups, and only when it
is not asked for an abstract mesh.
"""

from meshtrain.spec.errors import (
    CheckpointError,
    DataError,
    EquivalenceError,
    GraphBreakWarning,
    MeshError,
    MeshtrainError,
    PlanError,
    RecipeError,
    RuleError,
    SpecError,
    TrainingError,
)
from meshtrain.spec.layout import local_shape, shard_slices, validate_spec
from meshtrain.spec.logical import annotate, named_logical_axes
from meshtrain.spec.mesh import Mesh, make_mesh
from meshtrain.spec.partition import P
from meshtrain.spec.placements import distribute, from_placements, to_placements
from meshtrain.spec.rules import ParamSpec, Resolution, Rules

__all__ = [
    "CheckpointError",
    "DataError",
    "EquivalenceError",
    "GraphBreakWarning",
    "Mesh",
    "MeshError",
    "MeshtrainError",
    "P",
    "ParamSpec",
    "PlanError",
    "RecipeError",
    "Resolution",
    "RuleError",
    "Rules",
    "SpecError",
    "TrainingError",
    "annotate",
    "distribute",
    "from_placements",
    "local_shape",
    "make_mesh",
    "named_logical_axes",
    "shard_slices",
    "to_placements",
    "validate_spec",
]
