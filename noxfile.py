"""Developer sessions: ``nox -s tests`` (the first tier), ``lint``, ``typecheck``, ``docs``,
``tests_extended`` (the second tier), ``tests_long``, ``bench`` (benchmarks; not part of the
default run). CI (``.ci/run``) runs ``tests`` (the README's test command), ``tests_extended``,
``lint``, ``typecheck`` and ``docs``, one after another.

Each session builds its own virtual environment. On machines without a GPU, torch is pinned
through ``constraints/cpu.txt`` so pip does not fetch the newest (CUDA) build; set
``MESHTRAIN_CONSTRAINTS`` to another file (or to an empty string) on GPU machines.
"""

from __future__ import annotations

import os

import nox

nox.options.sessions = ["tests", "lint", "typecheck", "docs"]
nox.options.reuse_existing_virtualenvs = True

_CONSTRAINTS = os.environ.get("MESHTRAIN_CONSTRAINTS", "constraints/cpu.txt")
PIN = ["-c", _CONSTRAINTS] if _CONSTRAINTS else []
#: each tier's log ends with its slowest tests: where CI's time goes, run by run
SLOWEST = ["--durations=30"]


@nox.session
def tests(session: nox.Session) -> None:
    """The first tier (every test not marked ``extended``; derandomised Hypothesis profile: the
    same examples every run). The README's test command; CI runs it first on every change."""
    session.install(*PIN, "-e", ".[test]")
    session.run("pytest", "-m", "not extended", *SLOWEST, *session.posargs)


@nox.session
def tests_extended(session: nox.Session) -> None:
    """The second tier only (tests marked ``extended``): the rest of the schedule × composition
    grid, compiled pipelines, multi-node launches, PyTorch-limit regressions, the QLoRA launches.
    CI runs it on every change, after ``tests``."""
    session.install(*PIN, "-e", ".[test]")
    session.run("pytest", "-m", "extended", *SLOWEST, *session.posargs)


@nox.session
def tests_long(session: nox.Session) -> None:
    """Both tiers with the long, randomised Hypothesis profile (many more examples per property);
    run before resolving a change to planning or lowering."""
    session.install(*PIN, "-e", ".[test]")
    session.run("pytest", *session.posargs, env={"HYPOTHESIS_PROFILE": "long"})


@nox.session
def lint(session: nox.Session) -> None:
    """ruff lint and format check."""
    session.install("ruff==0.17.6")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy over the package (torch installed so its types are checked, not ignored)."""
    session.install(*PIN, "-e", ".[typecheck]")
    session.run("mypy")


@nox.session
def docs(session: nox.Session) -> None:
    """Build the documentation site; warnings (broken links, missing pages) are errors."""
    session.install("mkdocs==1.6.1", "mkdocs-material==9.8.1")
    session.run("mkdocs", "build", "--strict", "--site-dir", "site")


#: every benchmark script ``nox -s bench`` runs, in order
BENCHMARKS = (
    "overhead",
    "peer",
    "planning",
    "compute",
    "harness",
    "gpu",
    "mutation",
    "moe",
    "moe_parallel",
    "moe_planning",
    "context_sizing",
    "long_context",
    "attention_tiles",
    "proof_precision",
    "recipe_ab",
    "false_alarms",
    "generation",
)


@nox.session
def bench(session: nox.Session) -> None:
    """Benchmarks under ``benchmarks/``: each prints a table and writes JSON to benchmarks/results."""
    session.install(*PIN, "-e", ".[test,bench]")
    for name in BENCHMARKS:
        session.run("python", f"benchmarks/{name}.py", "--out", f"benchmarks/results/{name}.json")
