"""False alarms of the low-precision contract: correct bf16/fp16 plans that ``assert_equivalent``
flags, counted over drawn cases, with the margins of those it passes.

Each case (``tests/precision_cases.py``) is a model meshtrain did not write — the zoo's and other
Hugging Face families, meshtrain's Llama and MoE, a CNN with BatchNorm, Hypothesis-drawn plain
modules — under a plan kind (FSDP over 4 ranks at ZeRO 2 or 3; dp 2 × tp 2 with the model's own
or Megatron rules, with and without sequence parallelism; pp 2 × dp 2; ep 2 × dp 2 for MoE;
cp 2 × dp 2 for decoders), bf16 or fp16, with or without full activation checkpointing, a seed,
1–3 steps and AdamW or SGD, drawn by Hypothesis from ``--seed``. Nothing is mutated, so every
``EquivalenceError`` is a false alarm. A plan refused while planning (``PlanError`` and kin) is
counted apart: it never runs.

Margins are each run's largest ratio to its bound ("fraction of the bound"), over the measured
quantities (loss, gradient norm, gradients, buffers) and apart over parameters and optimizer
states (bounded from the gradients' bound through the update rule: where Adam's first update of
a near-zero gradient may flip sign, a difference of 2·lr is legitimately at the bound); and the
largest gradient difference over the reference's own low-precision error (``× own``), which the
contract allows up to 4.

Usage::

    python benchmarks/false_alarms.py --cases 300 --seed 20261128 --out benchmarks/results/false_alarms.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests")]
# the ranks import the cases' factories (tests/precision_cases.py, tests/zoo.py, ...) by name
os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(ROOT / "tests"), *filter(None, [os.environ.get("PYTHONPATH")])]
)

from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import seed as hypothesis_seed  # noqa: E402
from precision_cases import Case, cases  # noqa: E402
from provenance import provenance  # noqa: E402

import meshtrain as mt  # noqa: E402
from meshtrain.testing import assert_equivalent  # noqa: E402
from meshtrain.testing.harness import EquivalenceReport  # noqa: E402

MEASURED = ("loss", "grad", "grad norm", "buffer")
DOCS = ROOT / "docs" / "testing.md"
BEGIN, END = "<!-- false-alarms:begin -->", "<!-- false-alarms:end -->"
REFUSED = (mt.PlanError, mt.SpecError, mt.RuleError, mt.MeshError)


def draw(count: int, seed: int) -> list[Case]:
    """``count`` distinct cases drawn by Hypothesis from ``seed``."""
    drawn: list[Case] = []

    @hypothesis_seed(seed)
    @settings(
        max_examples=count * 3,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(cases())
    def collect(case: Case) -> None:
        if case not in drawn and len(drawn) < count:
            drawn.append(case)

    collect()
    return drawn


def margins(report: EquivalenceReport) -> dict[str, float]:
    """A run's largest ratios: measured quantities, parameters and states, gradients over own."""
    measured = [c.ratio for c in report.comparisons if c.quantity in MEASURED]
    updated = [c.ratio for c in report.comparisons if c.quantity not in MEASURED]
    own = [
        c.own_ratio
        for c in report.comparisons
        if c.quantity == "grad" and c.own_ratio and not c.note
    ]  # not numerically zero
    return {
        "measured": max(measured, default=0.0),
        "updates": max(updated, default=0.0),
        "grad_over_own": max(own, default=0.0),
    }


def run(case: Case) -> dict[str, Any]:
    """One case: ``passed``, ``alarm`` (an EquivalenceError: false, nothing is mutated),
    ``refused`` while planning, or ``crashed``."""
    model_fn = case.model_fn()
    row: dict[str, Any] = {
        "case": case.describe(),
        "precision": case.precision,
        "plan": case.plan,
        "family": case.family,
    }
    start = time.perf_counter()
    try:
        options = case.options(model_fn())
        report = assert_equivalent(
            model_fn,
            case.mesh,
            options,
            batches=case.batches(),
            steps=case.steps,
            optimizer=case.optimizer,
            seed=case.seed,
        )
        row.update(outcome="passed", **margins(report))
    except mt.EquivalenceError as error:
        report = error.report  # type: ignore[attr-defined]
        first = report.first_divergence
        row.update(
            outcome="alarm",
            **margins(report),
            first=f"step {first.step} {first.quantity} {first.fqn} {first.ratio:.2f}×",
        )
    except REFUSED as error:
        row.update(outcome="refused", reason=str(error).splitlines()[0][:200])
    except Exception as error:  # a crash is reported, not hidden
        row.update(outcome="crashed", reason=f"{type(error).__name__}: {error}"[:400])
        traceback.print_exc()
    row["seconds"] = round(time.perf_counter() - start, 2)
    return row


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def summarise(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per precision: cases run, alarms, refusals, crashes, and the margins' median, p99, max."""
    table = []
    for precision in sorted({r["precision"] for r in rows}):
        mine = [r for r in rows if r["precision"] == precision]
        ran = [r for r in mine if r["outcome"] in ("passed", "alarm")]
        entry: dict[str, Any] = {
            "precision": precision,
            "cases": len(ran),
            "alarms": sum(r["outcome"] == "alarm" for r in ran),
            "refused": sum(r["outcome"] == "refused" for r in mine),
            "crashed": sum(r["outcome"] == "crashed" for r in mine),
        }
        for key in ("measured", "updates", "grad_over_own"):
            values = [r[key] for r in ran]
            entry[key] = {
                "median": round(statistics.median(values), 3) if values else 0.0,
                "p99": round(_quantile(values, 0.99), 3),
                "max": round(max(values, default=0.0), 3),
            }
        table.append(entry)
    return table


def print_table(table: list[dict[str, Any]]) -> None:
    print(
        f"{'precision':<9} {'cases':>5} {'alarms':>6} {'refused':>7} {'crashed':>7}  "
        f"{'measured: median / p99 / max':>30}  {'params+states: median / p99 / max':>34}  "
        f"{'grad × own: median / p99 / max':>31}"
    )
    for e in table:
        cells = [
            f"{e[k]['median']:.3f} / {e[k]['p99']:.3f} / {e[k]['max']:.3f}"
            for k in ("measured", "updates", "grad_over_own")
        ]
        print(
            f"{e['precision']:<9} {e['cases']:>5} {e['alarms']:>6} {e['refused']:>7} "
            f"{e['crashed']:>7}  {cells[0]:>30}  {cells[1]:>34}  {cells[2]:>31}"
        )


def figure(table: list[dict[str, Any]], rows: list[dict[str, Any]], seed: int) -> str:
    """The figure docs/testing.md carries between the false-alarms markers."""
    ran = [r for r in rows if r["outcome"] in ("passed", "alarm")]
    kinds = sorted({r["plan"] for r in ran})
    names = sorted({r["family"] for r in ran})
    lines = [
        BEGIN,
        f"Measured by `python benchmarks/false_alarms.py --seed {seed}` "
        f"({time.strftime('%Y-%m-%d', time.gmtime())}): {len(ran)} correct low-precision runs "
        f"drawn over {len(names)} families (plain modules drawn by Hypothesis counted as one) and "
        f"{len(kinds)} plan kinds ({', '.join(kinds)}), with and without full activation "
        "checkpointing, seeds 0–4, 1–3 steps, AdamW and SGD; "
        f"{sum(r['outcome'] == 'refused' for r in rows)} more drawn plans were refused while "
        "planning (not run). Margins are each run's largest difference over its bound.",
        "",
        "| precision | runs | false alarms | crashed | measured quantities: median / p99 / max "
        "| parameters and states: median / p99 / max | gradient ÷ one device's own error: "
        "median / p99 / max |",
        "|---|---|---|---|---|---|---|",
    ]
    for e in table:
        cells = [
            f"{e[k]['median']:.2f} / {e[k]['p99']:.2f} / {e[k]['max']:.2f}"
            for k in ("measured", "updates", "grad_over_own")
        ]
        lines.append(
            f"| {e['precision']} | {e['cases']} | {e['alarms']} | {e['crashed']} | "
            f"{cells[0]} | {cells[1]} | {cells[2]} |"
        )
    lines += [
        "",
        "Parameters and states sit at 1.00 of their bound where Adam's first update of a gradient "
        "within its bound of zero flips sign: a difference of 2·lr is then exactly what the "
        "update rule allows. The last column is the ratio the contract allows up to c = 4.",
        END,
    ]
    return "\n".join(lines)


def write_docs(text: str) -> None:
    doc = DOCS.read_text()
    head, rest = doc.split(BEGIN, 1)
    DOCS.write_text(head + text + rest.split(END, 1)[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument(
        "--cases", type=int, default=300, help="cases to run (refusals not counted)"
    )
    parser.add_argument("--seed", type=int, default=20261128)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/false_alarms.json")
    parser.add_argument("--no-docs", action="store_true", help="leave docs/testing.md alone")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    rows: list[dict[str, Any]] = []
    start = time.perf_counter()
    for case in draw(args.cases * 2, args.seed):
        if sum(r["outcome"] in ("passed", "alarm") for r in rows) >= args.cases:
            break
        row = run(case)
        rows.append(row)
        shown = {
            k: round(v, 3) if isinstance(v, float) else v for k, v in row.items() if k != "case"
        }
        print(f"[{len(rows)}] {row['case']}: {shown}", flush=True)
    table = summarise(rows)
    print_table(table)
    result = {
        **provenance(),
        "seed": args.seed,
        "seconds": round(time.perf_counter() - start, 1),
        "table": table,
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    if not args.no_docs:
        write_docs(figure(table, rows, args.seed))


if __name__ == "__main__":
    main()
