"""Mutation benchmark: the kill rate of the first-tier suite and of ``assert_equivalent``.

Each mutant of ``tests/mutants/catalogue.py`` — a realistic lowering or runtime bug, or a
numerically neutral rewrite — is planted alone, never on disk: in this process and, through
``tests/mutants/site/sitecustomize.py``, around every task of every SPMD rank. For each one:

- *killed*: the first-tier tests the catalogue names fail (run in this process with
  ``pytest.main``, the rank pools kept warm between mutants);
- *caught*: ``assert_equivalent`` on its case, 2 steps, the bug planted on every rank through
  ``rank_context``, raises (its clean run passes: checked once per case);
- *named*: the report's failing tensors include one the catalogue expects (a module or
  parameter name, or ``<global>`` for the loss and gradient norm);
- *caught in bf16*: the same case under ``precision="bf16"`` (its clean bf16 run passes, checked
  once per case) raises — the low-precision contract, which allows a multiple of one device's own
  bf16 error, must keep the fp32 contract's teeth.

Equivalent mutants pass when nothing flags them. Prints a table, writes JSON, and writes the
figure into ``docs/testing.md`` between the ``mutation-benchmark`` markers.

Usage::

    python benchmarks/mutation.py --out benchmarks/results/mutation.json
    python benchmarks/mutation.py --only tie-skipped --no-docs   # one mutant
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SITE = ROOT / "tests" / "mutants" / "site"
DOCS = ROOT / "docs" / "testing.md"
BEGIN, END = "<!-- mutation-benchmark:begin -->", "<!-- mutation-benchmark:end -->"

ACTIVE = Path(os.environ.get("MESHTRAIN_MUTANT_FILE", "/nonexistent"))


def _prepare() -> None:
    """Ranks started from here import ``tests.*`` and plant what the file ``ACTIVE`` names (set
    once, in the parent: spawned ranks re-import this module and inherit the environment)."""
    global ACTIVE
    sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
    if "MESHTRAIN_MUTANT_FILE" not in os.environ:
        ACTIVE = Path(tempfile.mkdtemp(prefix="meshtrain-mutant-")) / "active"
        ACTIVE.write_text("")
        os.environ["MESHTRAIN_MUTANT_FILE"] = str(ACTIVE)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(SITE), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    )


_CLEAN_SUITE: dict[tuple[str, ...], dict[str, Any]] = {}


def run_suite(mutant: Any) -> dict[str, Any]:
    """The mutant's first-tier tests, planted here and (through ``ACTIVE``) in every rank task;
    the same tests run once without any mutant first (a kill counts only if they pass clean)."""
    from tests.mutants.catalogue import plant_name

    if mutant.tests not in _CLEAN_SUITE:
        _CLEAN_SUITE[mutant.tests] = _pytest(mutant.tests, "", contextlib.nullcontext())
    clean = _CLEAN_SUITE[mutant.tests]
    result = _pytest(mutant.tests, plant_name(mutant), mutant.plant())
    if clean["exit"] != 0:
        result["killed"] = None
        result["why"] = f"fails without the mutant (exit {clean['exit']}): {clean['tail'][-1:]}"
    return result


def _pytest(tests: tuple[str, ...], name: str, plant: Any) -> dict[str, Any]:
    import pytest

    ACTIVE.write_text(name)
    out = io.StringIO()
    began = time.perf_counter()
    args = [
        "-q",
        "-x",
        "-p",
        "no:cacheprovider",
        "-m",
        "not extended",
        "--tb=line",
        "-W",
        "ignore::pytest.PytestAssertRewriteWarning",
        *tests,
    ]
    try:
        with plant, contextlib.redirect_stdout(out):
            code = int(pytest.main(args))
    finally:
        ACTIVE.write_text("")
    tail = [line for line in out.getvalue().splitlines() if line.strip()][-6:]
    # 1: tests failed (killed); 0: passed (survived); 2-5: interrupted, internal, usage, none run
    return {
        "exit": code,
        "killed": code == 1,
        "seconds": round(time.perf_counter() - began, 1),
        "tail": tail,
    }


_CLEAN: dict[str, dict[str, Any]] = {}


def run_harness(mutant: Any) -> dict[str, Any]:
    """``assert_equivalent`` on the mutant's case, 2 steps, planted on every rank; then the same
    case in bf16 (``bf16``: the same keys)."""
    result = _run_case(mutant, mutant.harness)
    result["bf16"] = _run_bf16(mutant)
    return result


def _run_bf16(mutant: Any) -> dict[str, Any]:
    """The bf16 case (not exercised when it computes exactly what it computes clean: the bug's
    code is off the path a low-precision policy takes)."""
    low = mutant.low_precision or _in_bf16(mutant.harness)
    if low is None:
        return {"caught": None, "why": mutant.why_not or "no harness case"}
    return _run_case(mutant, low)


def _in_bf16(case: Any) -> Any:
    """The case under a bf16 policy (as it is when it asks for a precision of its own). A
    low-precision policy is lowered through FSDP2 over a data axis, so a case refused for want
    of one (tensor or pipeline parallelism alone) gets ``dp: 2`` and its rules FSDP over it: the
    same bug, on twice the ranks."""
    import dataclasses
    import math

    import meshtrain as mt
    from meshtrain import Rules

    if case is None or "precision" in case.options:
        return case
    low = dataclasses.replace(case, options={**case.options, "precision": "bf16"})
    mesh = mt.make_mesh(low.mesh, world_size=math.prod(low.mesh.values()), abstract=True)
    try:
        mt.plan(low.model(), mesh, **low.options)
        return low
    except mt.PlanError as error:
        if "data axis" not in str(error):
            return low
    rules = low.options["rules"]
    data = {"dp": 2, **low.mesh} if "dp" not in low.mesh else {**low.mesh, "dp": 2}
    options = {
        **low.options,
        "rules": Rules(rules.patterns, logical=rules.logical, fsdp="dp", gathered=rules.gathered),
    }
    return dataclasses.replace(low, mesh=data, options=options)


def _run_case(mutant: Any, case: Any) -> dict[str, Any]:
    if case is None:
        return {"caught": None, "named": None, "why": mutant.why_not}
    key = repr((case.model, case.mesh, case.options, case.extra))
    if key not in _CLEAN:
        _CLEAN[key] = _check(case, None)
    if _CLEAN[key]["caught"] is not False:
        return {
            "caught": None,
            "named": None,
            "why": f"its case fails without the mutant: {_CLEAN[key]['first']}",
        }
    began = time.perf_counter()
    result = _check(case, mutant.plant)
    if not result["caught"] and result.get("signature") == _CLEAN[key].get("signature"):
        return {
            "caught": None,
            "named": None,
            "why": "not exercised: the case computes exactly what it computes without the mutant",
        }
    result.pop("signature", None)
    result["clean_passes"] = True
    result["seconds"] = round(time.perf_counter() - began, 1)
    if result["caught"]:
        result["named"] = any(re.search(mutant.names, fqn) for fqn in result["fqns"])
    return result


def _check(case: Any, plant: Any) -> dict[str, Any]:
    import meshtrain as mt
    from meshtrain.testing import assert_equivalent

    extra = dict(case.extra)
    try:
        report = assert_equivalent(
            case.model, case.mesh, case.options, steps=2, rank_context=plant, **extra
        )
    except mt.EquivalenceError as error:
        report = error.report  # type: ignore[attr-defined]
        first = report.first_divergence
        fqns = sorted({c.fqn for c in report.failures})
        return {
            "caught": True,
            "how": "report",
            "first": f"step {first.step} {first.quantity} {first.fqn} ({first.ratio:.3g}x bound)",
            "fqns": fqns,
        }
    except Exception as error:  # a crash on the ranks is flagged too, though it names nothing
        text = str(error)
        # a rank's own exception line (``SomeError: ...``), else the error's first line
        raised = re.findall(r"^\s*(\w+(?:Error|Exception): .*)$", text, flags=re.M)
        line = (raised or text.strip().splitlines() or [""])[0].strip()[:200]
        return {
            "caught": True,
            "how": f"raised {type(error).__name__}",
            "first": line,
            "fqns": re.findall(r"'([\w.]+)'", line),
        }
    return {
        "caught": False,
        "how": "passed",
        "first": "",
        "fqns": [],
        "signature": _signature(report),
    }


def _signature(report: Any) -> list[tuple[int, str, str, float]]:
    """What a passing run computed, as its differences from one device: the same for a mutant
    whose code the case never reaches (the runs are deterministic on the same ranks)."""
    return [(c.step, c.quantity, c.fqn, c.abs_error) for c in report.comparisons]


def verdict(mutant: Any, suite: dict[str, Any], harness: dict[str, Any]) -> bool:
    """Whether the mutant was handled right: flagged by both (by neither when equivalent)."""
    caught = harness["caught"]
    if mutant.equivalent:
        return not suite["killed"] and caught is not True
    return bool(suite["killed"]) and caught is not False


def table(rows: list[dict[str, Any]]) -> str:
    def mark(value: Any) -> str:
        return "n/a" if value is None else "yes" if value else "NO"

    lines = [
        "| mutant | kind | suite kills | harness catches (2 steps) | report names it | "
        "harness catches in bf16 |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        eq = " (equivalent)" if row["equivalent"] else ""
        low = row["harness"].get("bf16", {}).get("caught")
        lines.append(
            f"| `{row['name']}`{eq} | {row['kind']} | {mark(row['suite']['killed'])} | "
            f"{mark(row['harness']['caught'])} | {mark(row['harness'].get('named'))} | "
            f"{mark(low)} |"
        )
    return "\n".join(lines)


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    real = [r for r in rows if not r["equivalent"]]
    neutral = [r for r in rows if r["equivalent"]]
    exercised = [r for r in real if r["harness"]["caught"] is not None]
    low = [r["harness"].get("bf16", {}) for r in real]
    low_exercised = [h for h in low if h.get("caught") is not None]
    return {
        "bf16_exercised": len(low_exercised),
        "caught_in_bf16": sum(bool(h["caught"]) for h in low_exercised),
        "bf16_missed": [
            r["name"] for r in real if r["harness"].get("bf16", {}).get("caught") is False
        ],
        "bf16_equivalent_flagged": sum(
            bool(r["harness"].get("bf16", {}).get("caught")) for r in neutral
        ),
        "mutants": len(rows),
        "non_equivalent": len(real),
        "killed_by_suite": sum(bool(r["suite"]["killed"]) for r in real),
        "harness_exercised": len(exercised),
        "caught_by_harness": sum(bool(r["harness"]["caught"]) for r in exercised),
        "named_by_harness": sum(bool(r["harness"].get("named")) for r in exercised),
        "equivalent": len(neutral),
        "equivalent_flagged": sum(
            bool(r["suite"]["killed"]) or bool(r["harness"]["caught"]) for r in neutral
        ),
        "survivors": [r["name"] for r in real if not r["ok"]],
        "suite_fails_clean": [r["name"] for r in rows if r["suite"].get("why")],
    }


def _short(text: str, limit: int = 140) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def figure(rows: list[dict[str, Any]], totals: dict[str, Any]) -> str:
    real = [r for r in rows if not r["equivalent"]]
    unverified = [r for r in real if r["suite"].get("why")]
    verifiable = len(real) - len(unverified)
    exercised = totals["harness_exercised"]

    def pct(n: int, d: int) -> str:
        return f"{100 * n / d:.0f}%" if d else "n/a"

    def missed(r: dict[str, Any]) -> str:
        parts = []
        if r["suite"]["killed"] is False:
            parts.append("its first-tier tests pass with it planted")
        if r["harness"]["caught"] is False:
            parts.append("assert_equivalent passes with it planted")
        return "; ".join(parts)

    survivors = [r for r in real if not r["ok"] and not r["suite"].get("why")]
    lines = [f"- `{r['name']}` ({r['kind']}): {missed(r)}" for r in survivors] or ["- none"]
    blind = [r for r in real if r["harness"]["caught"] is None]
    lines_blind = [f"- `{r['name']}`: {_short(r['harness']['why'])}" for r in blind] or ["- none"]
    lines_unverified = [f"- `{r['name']}`: {_short(r['suite']['why'])}" for r in unverified]
    return "\n".join(
        [
            BEGIN,
            f"Measured by `python benchmarks/mutation.py` ({totals['when']}): {totals['mutants']} "
            f"mutants, {len(real)} of them real bugs. The first-tier tests named in the catalogue "
            f"kill {totals['killed_by_suite']} of the {verifiable} whose tests pass without them "
            f"({pct(totals['killed_by_suite'], verifiable)}); `assert_equivalent` (2 steps) "
            f"catches {totals['caught_by_harness']} of the {exercised} it can exercise "
            f"({pct(totals['caught_by_harness'], exercised)}) and its report names the module or "
            f"parameter for {totals['named_by_harness']}; {totals['equivalent_flagged']} of "
            f"{totals['equivalent']} equivalent mutants flagged. The same cases in bf16 (the "
            f"low-precision contract): caught {totals['caught_in_bf16']} of the "
            f"{totals['bf16_exercised']} exercised "
            f"({pct(totals['caught_in_bf16'], totals['bf16_exercised'])}); "
            f"{totals['bf16_equivalent_flagged']} equivalent mutants flagged"
            + (
                f"; missed: {', '.join(f'`{n}`' for n in totals['bf16_missed'])}."
                if totals["bf16_missed"]
                else "."
            ),
            "",
            "Survivors (a gap in the suite or the harness):",
            *lines,
            "",
            "Not exercised by the harness:",
            *lines_blind,
            *(
                ["", "Not measured (their tests fail without the mutant):", *lines_unverified]
                if lines_unverified
                else []
            ),
            "",
            table(rows),
            END,
        ]
    )


def write_docs(text: str) -> None:
    doc = DOCS.read_text()
    if BEGIN in doc and END in doc:
        head, rest = doc.split(BEGIN, 1)
        doc = head + text + rest.split(END, 1)[1]
    else:
        doc = doc.rstrip("\n") + "\n\n### Mutation benchmark\n\n" + text + "\n"
    DOCS.write_text(doc)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/mutation.json")
    parser.add_argument("--only", nargs="*", help="mutant names (default: all)")
    parser.add_argument("--no-suite", action="store_true", help="skip the first-tier column")
    parser.add_argument("--no-docs", action="store_true", help="leave docs/testing.md alone")
    parser.add_argument(
        "--merge",
        action="store_true",
        help="with --only: update those rows of --out and the docs' figure",
    )
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    _prepare()
    from provenance import provenance

    from meshtrain.testing import runner
    from tests.mutants.catalogue import MUTANTS

    names = args.only or list(MUTANTS)
    rows = []
    close_pools = runner.close_pools
    runner.close_pools = lambda: None  # type: ignore[assignment]  # keep ranks warm across mutants
    try:
        for name in names:
            mutant = MUTANTS[name]
            suite = {"killed": None, "exit": None} if args.no_suite else run_suite(mutant)
            harness = run_harness(mutant)
            row = {
                "name": name,
                "kind": mutant.kind,
                "equivalent": mutant.equivalent,
                "tests": list(mutant.tests),
                "suite": suite,
                "harness": harness,
            }
            row["ok"] = verdict(mutant, suite, harness)
            rows.append(row)
            low = harness["bf16"]
            print(
                f"{name:40} suite {suite['killed']!s:5} harness {harness['caught']!s:5} "
                f"named {harness.get('named')!s:5} bf16 {low.get('caught')!s:5} "
                f"{harness.get('first', '')[:60]} | bf16: {low.get('first', low.get('why', ''))[:60]}",
                flush=True,
            )
    finally:
        runner.close_pools = close_pools
        close_pools()
    if args.merge and args.out.exists():  # replace these mutants' rows in the stored run
        ran = {row["name"] for row in rows}
        stored = json.loads(args.out.read_text())["mutants"]
        rows = [
            row if row["name"] not in ran else next(r for r in rows if r["name"] == row["name"])
            for row in stored
            if row["name"] in MUTANTS
        ] + [row for row in rows if row["name"] not in {r["name"] for r in stored}]
    totals = summary(rows) | {"when": time.strftime("%Y-%m-%d", time.gmtime())}
    print()
    print(table(rows))
    print(json.dumps({k: v for k, v in totals.items() if k != "when"}))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"provenance": provenance(), "summary": totals, "mutants": rows}, indent=2)
        + "\n"
    )
    if not args.no_docs and (args.merge or not args.only):
        write_docs(figure(rows, totals))


if __name__ == "__main__":
    main()
