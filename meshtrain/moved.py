"""Module paths that moved into sub-packages, kept importable.

``import meshtrain.train.hf_load`` still works and gives :mod:`meshtrain.train.hf.load`, and
``meshtrain.plan.abstract`` gives :mod:`meshtrain.plan.proof.run`, each with a
``DeprecationWarning`` that names the new path. Where a sub-package took an old module's name
(``meshtrain.plan.pipeline`` was a module, now a package), the package hands out the old
module's names from their new module, with the same warning (:func:`moved_names`). Nothing in
meshtrain imports the old paths. This module imports nothing of meshtrain's.

    >>> MOVED["meshtrain.train.hf_load"]
    'meshtrain.train.hf.load'
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

#: old module → the module it is now
MOVED = {
    "meshtrain.train.atomic": "meshtrain.files",
    "meshtrain.lower.attention_blocks": "meshtrain.lower.context.attention_blocks",
    "meshtrain.lower.balance": "meshtrain.lower.experts.balance",
    "meshtrain.lower.batch_buffers": "meshtrain.lower.data.batch_buffers",
    "meshtrain.lower.batch_norm": "meshtrain.lower.data.batch_norm",
    "meshtrain.lower.context_layout": "meshtrain.lower.context.layout",
    "meshtrain.lower.context_parallel": "meshtrain.lower.context.parallel",
    "meshtrain.lower.data_parallel": "meshtrain.lower.data.parallel",
    "meshtrain.lower.expert_parallel": "meshtrain.lower.experts.parallel",
    "meshtrain.lower.expert_tensor": "meshtrain.lower.experts.tensor",
    "meshtrain.lower.fresh_outputs": "meshtrain.lower.tensor.fresh_outputs",
    "meshtrain.lower.replicated": "meshtrain.lower.tensor.replicated",
    "meshtrain.lower.ring_attention": "meshtrain.lower.context.ring_attention",
    "meshtrain.lower.tensor_parallel": "meshtrain.lower.tensor.parallel",
    "meshtrain.plan.abstract": "meshtrain.plan.proof.run",
    "meshtrain.plan.abstract_boundaries": "meshtrain.plan.proof.boundaries",
    "meshtrain.plan.abstract_effects": "meshtrain.plan.proof.effects",
    "meshtrain.plan.abstract_experts": "meshtrain.plan.proof.experts",
    "meshtrain.plan.abstract_prover": "meshtrain.plan.proof.prover",
    "meshtrain.plan.abstract_refusals": "meshtrain.plan.proof.refusals",
    "meshtrain.plan.abstract_sizes": "meshtrain.plan.proof.sizes",
    "meshtrain.plan.activations": "meshtrain.plan.memory.activations",
    "meshtrain.plan.auto_experts": "meshtrain.plan.auto.experts",
    "meshtrain.plan.context_cost": "meshtrain.plan.context.cost",
    "meshtrain.plan.expert_activations": "meshtrain.plan.experts.activations",
    "meshtrain.plan.expert_cost": "meshtrain.plan.experts.cost",
    "meshtrain.plan.expert_tensor": "meshtrain.plan.experts.tensor",
    "meshtrain.plan.footprint": "meshtrain.plan.memory.footprint",
    "meshtrain.plan.pairs": "meshtrain.plan.tensor.pairs",
    "meshtrain.plan.inferred": "meshtrain.plan.infer",
    "meshtrain.plan.pipeline_cost": "meshtrain.plan.pipeline.cost",
    "meshtrain.plan.probe": "meshtrain.plan.proof.probe",
    "meshtrain.plan.router_counts": "meshtrain.plan.experts.router_counts",
    "meshtrain.plan.router_logits": "meshtrain.plan.experts.router_logits",
    "meshtrain.plan.sequence": "meshtrain.plan.tensor.sequence",
    "meshtrain.plan.shard_dims": "meshtrain.plan.proof.shard_dims",
    "meshtrain.plan.sizes": "meshtrain.plan.memory.sizes",
    "meshtrain.plan.stages": "meshtrain.plan.pipeline.stages",
    "meshtrain.plan.styles": "meshtrain.plan.tensor.styles",
    "meshtrain.plan.tp_cost": "meshtrain.plan.tensor.cost",
    "meshtrain.train.checkpoint_files": "meshtrain.train.checkpoint.files",
    "meshtrain.train.checkpoint_state": "meshtrain.train.checkpoint.state",
    "meshtrain.train.corpus": "meshtrain.train.data.corpus",
    "meshtrain.train.hf_export": "meshtrain.train.hf.export",
    "meshtrain.train.hf_files": "meshtrain.train.hf.files",
    "meshtrain.train.hf_load": "meshtrain.train.hf.load",
    "meshtrain.train.integrity": "meshtrain.train.checkpoint.integrity",
    "meshtrain.train.lock": "meshtrain.files.lock",
    "meshtrain.train.checkpoint.lock": "meshtrain.files.lock",
    "meshtrain.train.safetensors_io": "meshtrain.train.hf.single_file",
    "meshtrain.train.tokenizer": "meshtrain.train.data.tokenizer",
}

#: old module that is now a package of the same name → the module its names are in now
RENAMED_TO_PACKAGE = {
    "meshtrain.plan.auto": "meshtrain.plan.auto.search",
    "meshtrain.plan.context": "meshtrain.plan.context.axis",
    "meshtrain.plan.experts": "meshtrain.plan.experts.axis",
    "meshtrain.plan.pipeline": "meshtrain.plan.pipeline.schedule",
}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old module path and hands out the module that replaced it."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        new = MOVED[spec.name]
        warnings.warn(
            f"{spec.name} moved to {new}; import it from there.", DeprecationWarning, stacklevel=3
        )
        return importlib.import_module(new)

    def exec_module(self, module: ModuleType) -> None:
        """The module was executed when it was imported under its new name."""


def moved_names(package: str) -> Callable[[str], Any]:
    """A package's module ``__getattr__`` that hands out the names of the module it replaced,
    from where they live now (imported on first use, so the package imports nothing)."""

    def __getattr__(name: str) -> Any:
        module = importlib.import_module(RENAMED_TO_PACKAGE[package])
        if name.startswith("__") or not hasattr(module, name):
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        warnings.warn(
            f"{package}.{name} moved to {module.__name__}.{name}; import it from there.",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(module, name)

    return __getattr__


def install() -> None:
    """Make the old module paths importable (once per interpreter)."""
    if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
        sys.meta_path.append(_MovedModules())
