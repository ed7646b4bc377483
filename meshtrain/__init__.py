"""meshtrain: declare a mesh and per-parameter partition specs; get DTensor-based parallel plans.

The layers, bottom up: ``spec`` (P, mesh descriptions, rules) → ``plan`` (the compiler: a Plan
is data) → ``lower`` (``mt.apply``: the plan onto modules with PyTorch's parallel APIs) →
``train`` (the train step, state, checkpoints) → ``recipes`` → ``cli``; ``launch`` starts the
processes (``mt.init_distributed``). See docs/architecture.md.

Example:
    >>> import meshtrain as mt
    >>> mesh = mt.make_mesh(dp=-1, tp=2, world_size=8, abstract=True)
    >>> rules = mt.Rules({r".*\\.wq\\.weight": mt.P("tp", None), r".*": mt.P()}, fsdp="dp")
"""

from meshtrain.errors import (
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
from meshtrain.launch import init_distributed
from meshtrain.lower import apply, constrain, distribute, loss_parallel, micro_batch, shard_map
from meshtrain.plan import Pipeline, Plan, PlanOptions, plan
from meshtrain.spec import Mesh, P, Resolution, Rules, annotate, make_mesh
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
    "PlanOptions",
    "RecipeError",
    "Resolution",
    "RuleError",
    "Rules",
    "SpecError",
    "TrainState",
    "TrainingError",
    "__version__",
    "annotate",
    "apply",
    "constrain",
    "distribute",
    "init_distributed",
    "loss_parallel",
    "make_mesh",
    "make_train_step",
    "micro_batch",
    "plan",
    "shard_map",
]
