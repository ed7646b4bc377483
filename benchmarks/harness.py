"""Throughput of the equivalence harness's two tiers, in examples per minute (this machine).

- *plan validity* (in process, no ranks): draw a plan case, plan it on an abstract mesh, derive
  its contract and round-trip its JSON — what ``tests/test_plan_cases.py`` checks;
- *gloo numerics* (the persistent pool of real ranks): draw a plan case and run
  ``assert_equivalent`` for 2 AdamW steps — what ``tests/test_harness_properties_spmd.py``
  checks. Plans refused while planning cost milliseconds and are counted apart.

Examples are drawn derandomised, so two runs time the same cases. Prints a table and writes JSON.

Two more rows (``--warm`` runs only them): one ``assert_equivalent`` check of a tiny model
(the debug Llama, 2 blocks, FSDP over 2 ranks and tp 1, 2 AdamW steps) timed cold (the pool's ranks
started by it) and warm (the pool reused), and the cost of ``[train] verify_every``'s replica
check (``verify_replicas``) on 2 ranks of the debug Llama under ZeRO 0, with the digest's
throughput in one process.

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

    @settings(
        max_examples=examples,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
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


def tiny_check() -> None:
    from meshtrain.models import default_rules
    from meshtrain.testing.strategies import DebugLlama

    report = assert_equivalent(
        DebugLlama(2), {"dp": 2, "tp": 1}, default_rules(), steps=2, optimizer="adamw"
    )
    assert report.passed


def warm_rows(repeats: int = 3) -> list[dict[str, object]]:
    """A tiny model's check cold and warm; the replica check's cost."""
    from meshtrain.testing.runner import close_pools

    close_pools()
    start = time.perf_counter()
    tiny_check()
    cold = time.perf_counter() - start
    warm = []
    for _ in range(repeats):
        start = time.perf_counter()
        tiny_check()
        warm.append(time.perf_counter() - start)
    rows: list[dict[str, object]] = [
        {"tier": "tiny check, cold (ranks started)", "world": 2, "seconds": round(cold, 2)},
        {
            "tier": "tiny check, warm (pool reused)",
            "world": 2,
            "seconds": round(min(warm), 2),
            "all_seconds": [round(w, 2) for w in warm],
        },
    ]
    per_call = get_pool(2).run(_time_replica_check)
    rows.append({"tier": "replica check (verify_replicas)", "world": 2, **per_call[0]})
    rows.append({"tier": "replica digest, one process", "world": 1, **_digest_throughput()})
    return rows


def _time_replica_check(repeats: int = 5) -> dict[str, object]:
    import torch

    from meshtrain.models import LlamaConfig, build_llama, default_rules
    from meshtrain.train.replicas import verify_replicas

    model = build_llama(LlamaConfig.preset("debug", n_layers=2), seed=0)
    plan = mt.plan(model, mt.make_mesh({"dp": 2, "tp": 1}), default_rules(), zero=0)
    applied = mt.apply(plan, model)
    optimizer = torch.optim.AdamW(applied.parameters(), lr=1e-3)
    for param in applied.parameters():
        param.grad = torch.zeros_like(param)
    optimizer.step()  # the states exist
    size = sum(p.to_local().numel() * p.element_size() for p in applied.parameters())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        checked = verify_replicas(plan, dict(applied.named_parameters()), optimizer)
        times.append(time.perf_counter() - start)
    return {"seconds": round(min(times), 4), "tensors": checked, "param_bytes": size}


def _digest_throughput() -> dict[str, object]:
    import torch

    from meshtrain.train.replicas import tensor_digest

    tensor = torch.randn(16 * 2**20)  # 64 MiB of fp32
    tensor_digest(tensor[:1024])
    start = time.perf_counter()
    tensor_digest(tensor)
    seconds = time.perf_counter() - start
    return {"seconds": round(seconds, 3), "mib_per_s": round(64 / seconds, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--plan-examples", type=int, default=200)
    parser.add_argument("--gloo-examples", type=int, default=12)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/harness.json"))
    parser.add_argument("--warm", action="store_true", help="only the tiny check and replica rows")
    args = parser.parse_args()
    warnings.simplefilter("ignore")  # FSDP2's view-tensor warning on drawn row-wise heads
    extra = warm_rows()
    for row in extra:
        print(json.dumps(row))
    if args.warm:
        out = args.out.with_name(args.out.stem + "_warm.json")
        out.write_text(json.dumps({**provenance(), "rows": extra}, indent=2) + "\n")
        print(f"wrote {out}")
        return
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
        print(
            f"{row['tier']:<31} {row['world']:>5} {row['examples']:>8} {row['trained']:>7} "
            f"{row['refused']:>7} {row['seconds']:>7} {row['examples_per_minute']:>8} "
            f"{row['trained_per_minute']:>11}"
        )
    result = {**provenance(), "python": platform.python_version(), "rows": rows, "warm": extra}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
