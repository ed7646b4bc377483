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

import sys
import types
from typing import TYPE_CHECKING, Any

from meshtrain.errors import (
    CheckpointError,
    ConfigError,
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
from meshtrain.moved import install as _install_moved_paths

_install_moved_paths()  # old module paths (``meshtrain.plan.abstract``, ...) still import

if TYPE_CHECKING:
    from meshtrain.adapters import LoRALinear, lora, merge_lora
    from meshtrain.launch import init_distributed
    from meshtrain.lower import (
        constrain,
        full_tensor,
        loss_parallel,
        micro_batch,
        shard_batch,
        shard_map,
    )
    from meshtrain.lower.apply import apply
    from meshtrain.lower.distribute import distribute
    from meshtrain.lower.materialise import materialise
    from meshtrain.plan import Pipeline, Plan, PlanOptions, plan
    from meshtrain.spec import Mesh, P, Resolution, Rules, annotate, make_mesh
    from meshtrain.train import TrainState, make_train_step

__version__ = "0.1.0"

#: Where each public name lives. Names are imported on first use, so ``python -m meshtrain``
#: can read a recipe and refuse a bad launch before torch is imported.
_LAZY = {
    **dict.fromkeys(("LoRALinear", "lora", "merge_lora"), "meshtrain.adapters"),
    **dict.fromkeys(("init_distributed",), "meshtrain.launch"),
    **dict.fromkeys(
        (
            "apply",
            "constrain",
            "distribute",
            "full_tensor",
            "loss_parallel",
            "materialise",
            "micro_batch",
            "shard_batch",
            "shard_map",
        ),
        "meshtrain.lower",
    ),
    **dict.fromkeys(("Pipeline", "Plan", "PlanOptions"), "meshtrain.plan"),
    **dict.fromkeys(
        ("Mesh", "P", "Resolution", "Rules", "annotate", "make_mesh"), "meshtrain.spec"
    ),
    **dict.fromkeys(("TrainState", "make_train_step"), "meshtrain.train"),
}


def __getattr__(name: str) -> object:
    """The public names, imported on first use (``mt.testing`` pulls in Hypothesis and the SPMD
    runner; the rest pull in torch)."""
    import importlib

    if name == "testing":
        return importlib.import_module("meshtrain.testing")
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'meshtrain' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY, "testing"})


class _Facade(types.ModuleType):
    """``mt.plan`` is the planning function, as when every name was imported eagerly: importing
    the ``meshtrain.plan`` package binds that name on this module, and must not replace it."""

    @property
    def plan(self) -> Any:
        from meshtrain.plan import plan

        return plan

    @plan.setter
    def plan(self, module: types.ModuleType) -> None:
        """The import system binding the subpackage: ``mt.plan`` stays the function."""


sys.modules[__name__].__class__ = _Facade


__all__ = [
    "CheckpointError",
    "ConfigError",
    "DataError",
    "EquivalenceError",
    "GraphBreakWarning",
    "LoRALinear",
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
    "full_tensor",
    "init_distributed",
    "lora",
    "loss_parallel",
    "make_mesh",
    "make_train_step",
    "materialise",
    "merge_lora",
    "micro_batch",
    "plan",
    "shard_batch",
    "shard_map",
]
