"""Throughput of the equivalence harness's two tiers, in examples per minute (this machine).

- *plan validity* (in process, no ranks): draw a plan case, plan it on an abstract mesh, derive
  its contract and round-trip its JSON — what ``tests/test_plan_cases.py`` checks;
- *gloo numerics* (the persistent pool of real ranks): draw a plan case and run
  ``assert_equivalent`` for 2 AdamW steps — what ``tests/test_harness_properties_spmd.py``
  checks. Plans refused while planning cost milliseconds and are counted apart.

Examples are drawn derandomised, so two runs time the same cases. Prints a table and writes JSON.

Usage::

    python benchmarks/harness.py --out benchmarks/results/harness.json
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
import warnings
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from provenance import provenance

import meshtrain as mt
from meshtrain.errors import MeshError, PlanError, RuleError, SpecError
from meshtrain.plan.ir import Plan
from meshtrain.testing import assert_equivalent, contract_for
from meshtrain.testing.runner import get_pool
from meshtrain.testing.strategies import PlanCase, plan_cases

REFUSED = (PlanError, SpecError, RuleError, MeshError)


def _run(world: int, examples: int, check: object) -> dict[str, float]:
    counts = {"trained": 0, "refused": 0}

    @settings(max_examples=examples, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(plan_cases(world))
    def run(case: PlanCase) -> None:
        counts["trained" if check(case) else "refused"] += 1  # type: ignore[operator]

    start = time.perf_counter()
    run()
    seconds = time.perf_counter() - start
    total = counts["trained"] + counts["refused"]
    return {
        "world": world,
        "examples": total,
        "trained": counts["trained"],
        "refused": counts["refused"],
        "seconds": round(seconds, 2),
        "examples_per_minute": round(60 * total / seconds, 1),
        "trained_per_minute": round(60 * counts["trained"] / seconds, 1),
    }


def plan_validity(case: PlanCase) -> bool:
    world = math.prod(size for _, size in case.mesh_shape)
    mesh = mt.make_mesh(dict(case.mesh_shape), world_size=world, abstract=True)
    try:
        plan = mt.plan(case.model_fn(), mesh, **case.plan_options())  # type: ignore[arg-type]
    except mt.MeshtrainError:
        return False
    contract_for(plan)
    assert Plan.from_json(plan.to_json()) == plan
    return True


def gloo_numerics(case: PlanCase) -> bool:
    (model_fn, mesh, options), kwargs = case.harness_args()
    try:
        report = assert_equivalent(model_fn, mesh, options, steps=2, optimizer="adamw", **kwargs)  # type: ignore[arg-type]
    except REFUSED:
        return False
    assert report.passed
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--plan-examples", type=int, default=200)
    parser.add_argument("--gloo-examples", type=int, default=12)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/harness.json"))
    args = parser.parse_args()
    warnings.simplefilter("ignore")  # FSDP2's view-tensor warning on drawn row-wise heads
    rows = []
    for world in (2, 4, 8):
        rows.append(
            {"tier": "plan validity (in process)", **_run(world, args.plan_examples, plan_validity)}
        )
    for world in (2, 4):
        get_pool(world).start()  # spawning the ranks once is not per-example cost
        rows.append(
            {
                "tier": "gloo numerics (2 AdamW steps)",
                **_run(world, args.gloo_examples, gloo_numerics),
            }
        )
    header = f"{'tier':<31} {'world':>5} {'examples':>8} {'trained':>7} {'refused':>7} {'s':>7} {'ex/min':>8} {'trained/min':>11}"
    print(header)
    for row in rows:
        print(f"{row['tier']:<31} {row['world']:>5} {row['examples']:>8} {row['trained']:>7} "
              f"{row['refused']:>7} {row['seconds']:>7} {row['examples_per_minute']:>8} "
              f"{row['trained_per_minute']:>11}")  # fmt: skip
    result = {**provenance(), "python": platform.python_version(), "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
