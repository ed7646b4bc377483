"""Shared test configuration: Hypothesis profiles, and the end of the shared SPMD pools.

Profiles: ``default`` is derandomised (the same examples on every run, so CI is reproducible);
``long`` (``HYPOTHESIS_PROFILE=long``, ``nox -s tests_long``) draws many more random examples.

SPMD pools: the SPMD tests share one pool of real gloo ranks per world size, the process-wide
pools of :func:`meshtrain.testing.runner.get_pool`, each started on its first task and kept warm
across tests and Hypothesis examples. This file holds no pool itself; at the end of the session it
prints each shared pool's counters (a pool started more than once was killed by a failing or
timed-out task and respawned, at the cost of one ``import torch`` per rank) and closes them.
"""

from __future__ import annotations

import os
import sys

import pytest
from hypothesis import HealthCheck, settings

_COMMON = {"deadline": None, "print_blob": True, "suppress_health_check": [HealthCheck.too_slow]}
settings.register_profile("default", derandomize=True, max_examples=40, **_COMMON)
settings.register_profile("long", derandomize=False, max_examples=500, **_COMMON)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

_RUNNER = "meshtrain.testing.runner"  # looked up, not imported: in-process runs start no pool


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """One line per shared SPMD pool: ranks, starts, tasks, seconds its last start took."""
    runner = sys.modules.get(_RUNNER)
    stats = runner.shared_pool_stats() if runner is not None else {}
    if stats:
        terminalreporter.section("shared SPMD pools")
    for world_size, pool in stats.items():
        terminalreporter.write_line(
            f"{world_size} ranks: {pool.starts} start(s), {pool.tasks_run} tasks, "
            f"last start {pool.last_start_s:.1f} s"
        )


def pytest_unconfigure(config: pytest.Config) -> None:
    """Close the shared pools once the session's report is written (ranks stop before exit)."""
    runner = sys.modules.get(_RUNNER)
    if runner is not None:
        runner.close_pools()
