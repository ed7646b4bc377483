"""Measured effects of torch.compile and activation checkpointing on the debug Llama (CPU ranks).

Prints a table and writes JSON (``--out``). Ratios are taken in one run on one machine:

- step time, eager vs compiled (inductor, per block), on 2 gloo ranks under FSDP2 (dp 2): both
  models live on the same ranks and their steps are interleaved (A B, then B A, ...), each timed
  between barriers, so the ratio's quartiles show this machine's noise;
- compile time, cold and warm: the first compiled step less a steady compiled step, first in
  fresh processes with an empty inductor cache, then in fresh processes again over the cache the
  first run filled (what a second launch of the same job pays);
- activation memory per checkpointing mode in one process, measured with torch's ``MemTracker``
  (peak of the ACT category over forward and backward) next to the plan's traced estimate.

Usage::

    python benchmarks/compute.py --out benchmarks/results/compute.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from provenance import provenance
from timing import cpu_line, interleaved, round_by_round, summarise, timed

import meshtrain as mt
from meshtrain.models import LlamaConfig, build_llama, default_rules
from meshtrain.testing.runner import SPMDPool

CONFIG = {"n_layers": 8, "max_seq_len": 256}
BATCH, SEQ = 4, 256


def _model() -> torch.nn.Module:
    return build_llama(LlamaConfig.preset("debug", **CONFIG), seed=0)


def _trainer(compile_backend: str | None) -> Callable[[int], float]:
    """On every rank: the debug Llama under a dp-2 FSDP2 plan, and one AdamW step of it."""
    model = _model()
    options = {"compile": {"backend": compile_backend}} if compile_backend else {}
    mesh = mt.make_mesh(dp=2, tp=1)
    plan = mt.plan(model, mesh, mt.Rules(logical=default_rules().logical, fsdp="dp"), **options)
    mt.apply(plan, model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    dp_rank = mesh.coordinates(dist.get_rank())["dp"]

    def step(index: int) -> float:
        generator = torch.Generator().manual_seed(1000 * index + dp_rank)
        tokens = torch.randint(0, 256, (BATCH, SEQ + 1), generator=generator)
        with mt.loss_parallel(plan):
            loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.item()

    return step


def eager_vs_compiled(cache_dir: str, rounds: int) -> dict[str, Any]:
    """On every rank, in fresh processes over an empty inductor cache: the first step of each
    (the compiled one compiles), their first losses, then interleaved steady steps."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    steps = {"compiled": _trainer("inductor"), "eager": _trainer(None)}
    first, losses = {}, {}
    for name, step in steps.items():  # same weights, same batch: the first losses agree
        dist.barrier()
        start = time.perf_counter()
        losses[name] = step(0)
        dist.barrier()
        first[name] = time.perf_counter() - start
    times = interleaved(steps, rounds)  # two warm-up steps each (a recompile lands there)
    return {"first": first, "losses": losses, "times": times}


def compiled_again(cache_dir: str, steps: int) -> dict[str, float]:
    """On every rank, in fresh processes over the filled cache: first and steady compiled steps."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    step = _trainer("inductor")
    first = timed(step, 0)
    step(1)  # a recompile after the first step lands here, as in the cold run's warm-up
    steady = statistics.median(timed(step, index) for index in range(2, 2 + steps))
    return {"first": first, "steady": steady}


def activation_memory() -> list[dict[str, object]]:
    """Peak activation bytes per checkpointing mode: measured vs the plan's estimate."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from meshtrain.lower.compute import apply_checkpointing

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
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/compute.json"))
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="meshtrain-inductor-") as cache_dir:
        with SPMDPool(2, timeout_s=1800.0) as pool:
            cold = pool.run(eager_vs_compiled, cache_dir, args.rounds)
        with SPMDPool(2, timeout_s=1800.0) as pool:
            again = pool.run(compiled_again, cache_dir, 5)
    summary = summarise([r["times"] for r in cold], "compiled", "eager")
    steady = summary["median_step_s"]
    first = {name: max(r["first"][name] for r in cold) for name in ("compiled", "eager")}
    warm_steady = max(r["steady"] for r in again)
    warm = max(r["first"] for r in again)
    result = {
        **provenance(),
        "ranks": "2 CPU gloo ranks",
        "model": f"debug Llama {CONFIG}, batch {BATCH} × seq {SEQ} per rank, dp 2 FSDP2, AdamW",
        "rounds": args.rounds,
        "first_step_s": first,
        **summary,
        "speedup": 1 / summary["ratio"],
        "first_losses": cold[0]["losses"],
        "compile_s": {"cold": first["compiled"] - steady["compiled"], "warm": warm - warm_steady},
        "activation_memory": activation_memory(),
    }
    print(_table(result))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"\nwrote {args.out}")


def _table(result: dict[str, Any]) -> str:
    first, steady = result["first_step_s"], result["median_step_s"]
    paired = result["paired_ratio"]
    lines = [f"{'':24}{'first step s':>14}{'steady step s':>15}{'first loss':>12}"]
    for name in ("eager", "compiled"):
        lines.append(
            f"{name:24}{first[name]:>14.3f}{steady[name]:>15.3f}"
            f"{result['first_losses'][name]:>12.6f}"
        )
    lines.append(
        f"speedup (eager/compiled, median steps): {result['speedup']:.2f}×; compiled/eager "
        f"{round_by_round(paired)}"
    )
    lines.append(cpu_line(result, {"compiled": "compiled", "eager": "eager"}))
    lines.append(
        f"compile time: cold cache {result['compile_s']['cold']:.1f} s, "
        f"warm cache {result['compile_s']['warm']:.1f} s"
    )
    lines.append(f"\n{'checkpointing':14}{'measured B':>14}{'estimate B':>14}{'est/meas':>10}")
    for row in result["activation_memory"]:
        lines.append(
            f"{row['mode']:14}{row['measured']:>14,}{row['estimate']:>14,}{row['ratio']:>10.2f}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
