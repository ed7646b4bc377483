"""Plants the mutation benchmark's mutants into processes the benchmark starts (on
``PYTHONPATH`` only there: ``benchmarks/mutation.py`` puts this folder first).

- ``MESHTRAIN_MUTANT=<plant>``: the plant of ``tests/mutants/plants.py`` of that name is entered
  at start-up, for the whole process (a torchrun worker, or a pytest run by hand).
- ``MESHTRAIN_MUTANT_FILE=<path>``: every task an SPMD pool rank runs
  (``meshtrain.testing.runner._run_task``) runs inside the plant the file names at the time (empty:
  none), so one warm pool serves every mutant.

Nothing happens without either variable.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parents[3]
_RUNNER = "meshtrain.testing.runner"


def _plant(name: str) -> contextlib.AbstractContextManager[Any]:
    if str(_ROOT) not in sys.path:
        sys.path.insert(0, str(_ROOT))
    plants = importlib.import_module("tests.mutants.plants")
    return getattr(plants, name)()


def _wrap(runner: Any, active: Path) -> None:
    original = runner._run_task

    def planted(rank: int, payload: bytes) -> Any:
        name = active.read_text().strip() if active.exists() else ""
        if not name:
            return original(rank, payload)
        with _plant(name):
            return original(rank, payload)

    runner._run_task = planted


class _RunnerHook(importlib.abc.MetaPathFinder):
    """Wraps the runner's task function once the runner module is loaded."""

    def __init__(self, active: Path) -> None:
        self.active = active

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != _RUNNER:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        loader, active = spec.loader, self.active
        original = loader.exec_module  # type: ignore[attr-defined]

        def exec_module(module: Any) -> None:
            original(module)
            _wrap(module, active)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


if os.environ.get("MESHTRAIN_MUTANT"):
    _plant(os.environ["MESHTRAIN_MUTANT"]).__enter__()
elif os.environ.get("MESHTRAIN_MUTANT_FILE"):
    sys.meta_path.insert(0, _RunnerHook(Path(os.environ["MESHTRAIN_MUTANT_FILE"])))
