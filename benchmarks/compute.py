"""Measured effects of torch.compile and activation checkpointing on the debug Llama (CPU ranks).

Prints a table and writes JSON (``--out``). Ratios are taken in one run on one machine:

- step time, eager vs compiled (inductor), on 2 gloo ranks under FSDP2 (dp 2): median of the
  steps after the first; compile time = first compiled step − a steady compiled step;
- activation memory per checkpointing mode in one process, measured with torch's ``MemTracker``
  (peak of the ACT category over forward and backward) next to the plan's traced estimate.

Usage::

    python benchmarks/compute.py --out benchmarks/results/compute.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import provenance
import torch
import torch.nn.functional as F

import meshtrain as mt
from meshtrain.models import LlamaConfig, build_llama, default_rules

CONFIG = {"n_layers": 8, "max_seq_len": 256}
BATCH, SEQ = 4, 256


def _model() -> torch.nn.Module:
    return build_llama(LlamaConfig.preset("debug", **CONFIG), seed=0)


def step_times(compile_backend: str | None, steps: int) -> dict[str, float]:
    """On every rank of a dp-2 FSDP2 plan: seconds per step (first, then the rest)."""
    import torch.distributed as dist

    model = _model()
    options = {"compile": {"backend": compile_backend}} if compile_backend else {}
    mesh = mt.make_mesh(dp=2, tp=1)
    plan = mt.plan(model, mesh, mt.Rules(logical=default_rules().logical, fsdp="dp"), **options)
    plan.apply(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, 256, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))
    times = []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        with plan.loss_parallel():
            loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        dist.barrier()
        times.append(time.perf_counter() - start)
    return {"first": times[0], "steady": statistics.median(times[1:]), "loss": loss.item()}


def activation_memory() -> list[dict[str, object]]:
    """Peak activation bytes per checkpointing mode: measured vs the plan's estimate."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from meshtrain.plan.lower_compute import apply_checkpointing

    rows = []
    for mode in ("none", "selective", "full"):
        model = _model()
        mesh = mt.make_mesh(dp=1, tp=1, world_size=1, abstract=True)
        plan = mt.plan(
            model,
            mesh,
            mt.Rules(logical=default_rules().logical, fsdp="dp"),
            activation_checkpointing=mode,
            batch_size=BATCH,
            seq_len=SEQ,
        )
        apply_checkpointing(plan, model)  # the lowering's own step; no process group needed
        tokens = torch.randint(0, 256, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))
        tracker = MemTracker()
        tracker.track_external(model)
        with tracker:
            F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
        peak = next(iter(tracker.get_tracker_snapshot("peak").values()))
        measured = next(v for k, v in peak.items() if str(k).endswith("ACT"))
        estimate = plan.memory.activations
        rows.append(
            {"mode": mode, "measured": measured, "estimate": estimate, "ratio": estimate / measured}
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/compute.json"))
    args = parser.parse_args()

    from meshtrain.testing.runner import get_pool

    pool = get_pool(2)
    eager = pool.run(step_times, None, args.steps, _timeout_s=600.0)[0]
    compiled = pool.run(step_times, "inductor", args.steps, _timeout_s=600.0)[0]
    pool.close()
    memory = activation_memory()
    commit = provenance.commit()
    result = {
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, "
        f"torch {torch.__version__}",
        "date": time.strftime("%Y-%m-%d"),
        "commit": commit,
        "model": f"debug Llama {CONFIG}, batch {BATCH} × seq {SEQ}, dp 2 FSDP2, AdamW",
        "eager": eager,
        "compiled_inductor": compiled,
        "speedup": eager["steady"] / compiled["steady"],
        "compile_seconds": compiled["first"] - compiled["steady"],
        "activation_memory": memory,
    }
    print(f"{'':24}{'first step s':>14}{'steady step s':>15}")
    for name in ("eager", "compiled_inductor"):
        row = result[name]
        print(f"{name:24}{row['first']:>14.3f}{row['steady']:>15.3f}")
    print(
        f"speedup (eager/compiled, steady): {result['speedup']:.2f}×; compile time "
        f"{result['compile_seconds']:.1f} s"
    )
    print(f"\n{'checkpointing':14}{'measured B':>14}{'estimate B':>14}{'est/meas':>10}")
    for row in memory:
        print(f"{row['mode']:14}{row['measured']:>14,}{row['estimate']:>14,}{row['ratio']:>10.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
