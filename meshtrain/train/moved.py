"""Module paths of the training runtime that moved into sub-packages, kept importable.

``import meshtrain.train.hf_load`` still works and gives :mod:`meshtrain.train.hf.load`, with a
``DeprecationWarning`` that names the new path. Nothing else in meshtrain imports the old paths.

    >>> MOVED["hf_load"]
    'meshtrain.train.hf.load'
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from collections.abc import Sequence
from types import ModuleType

#: old module name under ``meshtrain.train`` → the module it is now
MOVED = {
    "checkpoint_files": "meshtrain.train.checkpoint.files",
    "checkpoint_state": "meshtrain.train.checkpoint.state",
    "integrity": "meshtrain.train.checkpoint.integrity",
    "lock": "meshtrain.train.checkpoint.lock",
    "hf_export": "meshtrain.train.hf.export",
    "hf_files": "meshtrain.train.hf.files",
    "hf_load": "meshtrain.train.hf.load",
    "safetensors_io": "meshtrain.train.hf.single_file",
    "corpus": "meshtrain.train.data.corpus",
    "tokenizer": "meshtrain.train.data.tokenizer",
}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``meshtrain.train.<old>`` and hands out the module that replaced it."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        prefix, _, name = fullname.rpartition(".")
        if prefix != "meshtrain.train" or name not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        new = MOVED[spec.name.rpartition(".")[2]]
        warnings.warn(
            f"{spec.name} moved to {new}; import it from there.", DeprecationWarning, stacklevel=3
        )
        return importlib.import_module(new)

    def exec_module(self, module: ModuleType) -> None:
        """The module was executed when it was imported under its new name."""


def install() -> None:
    """Make the old module paths importable (once per interpreter)."""
    if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
        sys.meta_path.append(_MovedModules())
