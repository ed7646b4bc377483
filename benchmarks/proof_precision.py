"""Precision of the plan-time proof: how often it refuses a plan that would train right, and
how often it accepts one that trains wrong.

Cases are (model × plan × options) on 4 gloo ranks: the zoo (Hugging Face families built tiny
from local configs, torchtitan-like and other plain modules of tests/proof_models.py, each
under its own rules on dp 2 × tp 2, with sequence parallelism, on tp 2 alone and on dp 4) and
plain modules drawn with Hypothesis (tests/drawn_models.py: heads viewed four ways, per-head
operations, tied heads, in-place residuals, running means, feature reductions, each with a
drawn plan). Each case is planned as a user would (``mt.plan`` with the first batch as
``example_inputs``): accepted or refused. Then it is trained against one device
(``assert_equivalent``, 1 AdamW step) with every refusal of the proof kept as a note
(``meshtrain.plan.proof.run.refusals_as_notes``), and counted:

- *refused, wrong*: refused, and as a note it crashes or differs from one device;
- *refused, right* (a false refusal): refused, and as a note it trains like one device;
- *accepted, right*; *accepted, wrong* (a crash or a difference after acceptance);
- *refused by structure*: refused before the proof (no lowering exists: a rule, a sequence
  parallel structure), so nothing can train; listed apart;
- *at the bound*: trained, and different from one device by at most 1.5 times the fp32
  contract's bound (rounding; the contract's precision is its own subject), listed apart.

Prints the table and writes JSON (``--out``). Usage::

    python benchmarks/proof_precision.py --drawn 240 --out benchmarks/results/proof_precision.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from provenance import provenance  # noqa: E402

import meshtrain as mt  # noqa: E402

DP_TP = {"dp": 2, "tp": 2}
TP = {"dp": 1, "tp": 2}
DP4 = {"dp": 4}


@dataclass(frozen=True)
class Case:
    """One model under one plan; ``options`` are ``mt.plan``'s keyword arguments."""

    name: str
    model: Callable[[], Any]
    axes: dict[str, int]
    options: dict[str, Any]
    batches: Callable[[int], Any]


def zoo_cases() -> list[Case]:
    """Every zoo model under its own rules: dp 2 × tp 2, + sequence parallelism, tp 2, dp 4."""
    import families
    import moe_models
    import proof_models as pm
    import zoo

    from meshtrain import Rules

    def sp(rules: Rules) -> Rules:
        return Rules(
            rules.patterns,
            logical=[("seq", "tp")],
            fsdp=rules.fsdp,
            allow_unused=rules.allow_unused,
            gathered=rules.gathered,
            generated=rules.generated,
        )

    hf = {
        "llama": zoo.llama,
        "qwen2": zoo.qwen2,
        "qwen3": zoo.qwen3,
        "olmo2": zoo.olmo2,
        "phi3": zoo.phi3,
        "gemma2": zoo.gemma2,
        "gpt-neox": zoo.gpt_neox,
        "mistral": families.mistral,
        "qwen2-moe": moe_models.qwen2_moe,
        "mixtral": moe_models.mixtral,
        "qwen3-moe": moe_models.qwen3_moe_4,
    }
    own = {
        "gpt2": (zoo.gpt2, zoo.GPT2_RULES),
        "bert": (zoo.bert, zoo.BERT_RULES),
        "opt": (zoo.opt, zoo.OPT_RULES),
        "bart": (zoo.bart, zoo.BART_RULES),
        "t5": (zoo.t5, zoo.T5_RULES),
        "rotary-lm": (pm.rotary_lm, pm.ROTARY_RULES),
        "tied-mlp": (pm.tied_mlp, pm.MLP_RULES),
        "inplace-mlp": (pm.inplace_mlp, pm.MLP_RULES),
        "conv-reader": (pm.conv_reader, pm.MLP_RULES),
        "running-mean": (pm.running_mean_mlp, pm.MLP_RULES),
    }
    cases = []
    for name, factory in hf.items():
        rules = Rules.from_hf(factory(), fsdp="dp")
        batches = {"moe_models": moe_models.token_batches, "families": families.token_batches}
        cases += _variants(
            name, factory, rules, sp(rules), batches.get(factory.__module__, zoo.token_batches)
        )
    for name, (factory, rules) in own.items():
        batches = pm.token_batches if factory.__module__ == "proof_models" else zoo.token_batches
        cases += _variants(name, factory, rules, sp(rules), batches)
    images = {
        "vit": (zoo.vit, zoo.VIT_RULES, zoo.image_batches),
        "cnn-groupnorm": (pm.group_norm_cnn, pm.CNN_RULES, pm.image_batches),
    }
    for name, (factory, rules, batches) in images.items():
        cases += _variants(name, factory, rules, None, batches)
    classifier = pm.ROBERTA_RULES
    cases += _variants(
        "roberta-classifier", pm.roberta_classifier, classifier, sp(classifier), pm.label_batches
    )
    return cases


def _variants(
    name: str, factory: Callable[[], Any], rules: Any, sp_rules: Any, batches: Callable[[int], Any]
) -> list[Case]:
    from meshtrain import P, Rules

    found = [
        Case(f"{name} dp2×tp2", factory, DP_TP, {"rules": rules}, batches),
        Case(f"{name} tp2", factory, TP, {"rules": rules}, batches),
        Case(f"{name} dp4", factory, DP4, {"rules": Rules({".*": P()}, fsdp="dp")}, batches),
    ]
    if sp_rules is not None:
        found.append(Case(f"{name} dp2×tp2+SP", factory, DP_TP, {"rules": sp_rules}, batches))
    return found


def drawn_cases(count: int, seed: int) -> list[Case]:
    """``count`` plain modules and plans drawn by Hypothesis (derandomised by ``seed``)."""
    import drawn_models
    from hypothesis import HealthCheck, given, settings

    drawn: list[Any] = []

    @settings(
        max_examples=count * 3,
        database=None,
        derandomize=True,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(drawn_models.drawn_plans())
    def collect(plan: Any) -> None:
        if plan not in drawn and len(drawn) < count:
            drawn.append(plan)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        collect()
    del seed  # the draw is derandomised: the same cases every run
    return [
        Case(
            plan.describe(),
            plan.model_fn(),
            dict(plan.axes),
            {"rules": plan.rules(), **dict(plan.options)},
            drawn_models.token_batches,
        )
        for plan in drawn
    ]


@contextlib.contextmanager
def _notes_on_ranks() -> Iterator[None]:
    """On every rank: refusals kept as notes (entered by the harness around the run)."""
    from meshtrain.plan.proof.run import refusals_as_notes

    with refusals_as_notes():
        yield


def classify(case: Case) -> dict[str, Any]:
    """Planned as a user would, then trained with refusals as notes (see module doc)."""
    from meshtrain.plan.proof.run import refusals_as_notes

    world = math.prod(case.axes.values())
    mesh = mt.make_mesh(dict(case.axes), world_size=world, abstract=True)
    example = case.batches(0)[0]
    began = time.perf_counter()
    refusal = None
    try:
        mt.plan(case.model(), mesh, example_inputs=example, **case.options)
    except mt.MeshtrainError as error:
        refusal = f"{type(error).__name__}: {str(error).splitlines()[0][:240]}"
    outcome, detail = "right", ""
    with refusals_as_notes():
        try:
            mt.plan(case.model(), mesh, example_inputs=example, **case.options)
        except mt.MeshtrainError as error:  # refused before the proof: nothing to train
            outcome, detail = "structure", f"{type(error).__name__}: {str(error)[:240]}"
        if outcome != "structure":
            outcome, detail = _train(case)
    if refusal is not None and outcome == "structure":
        verdict = "refused by structure"
    elif outcome == "rounding":  # refused and within rounding of one device: a false refusal
        verdict = "refused, right" if refusal is not None else "accepted, at the bound"
    elif refusal is not None:
        verdict = "refused, wrong" if outcome == "wrong" else "refused, right"
    else:
        verdict = "accepted, right" if outcome == "right" else "accepted, wrong"
    return {
        "case": case.name,
        "verdict": verdict,
        "refusal": refusal,
        "detail": detail,
        "seconds": round(time.perf_counter() - began, 1),
    }


def _train(case: Case) -> tuple[str, str]:
    """``right`` when the plan (refusals as notes) trains like one device; else ``wrong`` and
    why (a difference, or a crash on the ranks)."""
    from meshtrain.testing import assert_equivalent

    try:
        assert_equivalent(
            case.model,
            case.axes,
            dict(case.options),
            batches=case.batches,
            steps=1,
            optimizer="adamw",
            rank_context=_notes_on_ranks,
            timeout_s=300,
        )
    except mt.EquivalenceError as error:
        report = getattr(error, "report", None)
        worst = max((c.ratio for c in report.failures), default=math.inf) if report else math.inf
        first = report.first_divergence if report else None
        where = f"{first.quantity} '{first.fqn}' at step {first.step}" if first else "?"
        if worst <= AT_THE_BOUND:
            return "rounding", f"worst {worst:.2f}× the fp32 bound ({where})"
        return "wrong", f"{worst:.3g}× the bound ({where})"
    except Exception as error:  # a crash on the ranks, or a refusal raised at the first forward
        return "wrong", f"crashed: {type(error).__name__}: {str(error)[:240]}"
    return "right", ""


VERDICTS = (
    "refused, wrong",
    "refused, right",
    "accepted, right",
    "accepted, wrong",
    "accepted, at the bound",
    "refused by structure",
)
#: a difference from one device at most this many times the fp32 contract's bound, with every
#: relative error at rounding level, is rounding, not a wrong plan: listed apart (wrong plans
#: differ by 10² to 10⁶ times the bound)
AT_THE_BOUND = 1.5


def table(rows: list[dict[str, Any]]) -> str:
    counts = Counter(row["verdict"] for row in rows)
    zoo = Counter(row["verdict"] for row in rows if not row["case"].startswith("drawn"))
    drawn = Counter(row["verdict"] for row in rows if row["case"].startswith("drawn"))
    lines = ["| outcome | zoo | drawn | all |", "|---|---:|---:|---:|"]
    lines += [f"| {v} | {zoo[v]} | {drawn[v]} | {counts[v]} |" for v in VERDICTS]
    lines.append(f"| cases | {sum(zoo.values())} | {sum(drawn.values())} | {len(rows)} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drawn", type=int, default=240)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only-zoo", action="store_true")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    cases = zoo_cases() + ([] if args.only_zoo else drawn_cases(args.drawn, args.seed))
    rows = []
    began = time.perf_counter()
    for index, case in enumerate(cases):
        row = classify(case)
        rows.append(row)
        print(
            f"[{index + 1}/{len(cases)}] {row['verdict']:<20} {row['case']}"
            f"{'  — ' + (row['refusal'] or row['detail'])[:160] if row['verdict'] != 'accepted, right' else ''}",
            flush=True,
        )
    print(table(rows))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        record = {
            **provenance(),
            "ranks": "4 CPU gloo ranks",
            "steps": 1,
            "wall_s": round(time.perf_counter() - began),
            "table": table(rows),
            "counts": dict(Counter(r["verdict"] for r in rows)),
            "cases": rows,
        }
        args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
