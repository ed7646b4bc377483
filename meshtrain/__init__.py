"""meshtrain: declare a mesh and per-parameter partition specs; get DTensor-based parallel plans.

Example:
    >>> import meshtrain as mt
    >>> mesh = mt.make_mesh(dp=-1, tp=2, world_size=8, abstract=True)
    >>> rules = mt.Rules({r".*\\.wq\\.weight": mt.P("tp", None), r".*": mt.P()}, fsdp="dp")
"""

from meshtrain.plan import Pipeline, Plan, constrain, plan, shard_map
from meshtrain.spec import (
    CheckpointError,
    DataError,
    EquivalenceError,
    GraphBreakWarning,
    Mesh,
    MeshError,
    MeshtrainError,
    P,
    PlanError,
    RecipeError,
    Resolution,
    RuleError,
    Rules,
    SpecError,
    TrainingError,
    annotate,
    distribute,
    make_mesh,
)
from meshtrain.train import TrainState, make_train_step

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    """``mt.testing`` is imported on first use (it pulls in Hypothesis and the SPMD runner)."""
    if name == "testing":
        import importlib

        return importlib.import_module("meshtrain.testing")
    raise AttributeError(f"module 'meshtrain' has no attribute {name!r}")


__all__ = [
    "CheckpointError",
    "DataError",
    "EquivalenceError",
    "GraphBreakWarning",
    "Mesh",
    "MeshError",
    "MeshtrainError",
    "P",
    "Pipeline",
    "Plan",
    "PlanError",
    "RecipeError",
    "Resolution",
    "RuleError",
    "Rules",
    "SpecError",
    "TrainState",
    "TrainingError",
    "__version__",
    "annotate",
    "constrain",
    "distribute",
    "make_mesh",
    "make_train_step",
    "plan",
    "shard_map",
]
