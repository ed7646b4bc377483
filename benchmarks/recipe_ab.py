"""The debug recipe's step time against an earlier commit's, paired in one run.

``meshtrain train debug --nproc 4`` (FSDP over dp 2 × tensor parallel over tp 2, the debug
Llama) runs alternately from this checkout (A) and from a ``git worktree`` of ``--base`` (B,
default 21a9e5e), in pairs whose order alternates (A B, then B A, ...) so drift hits both alike;
each run gets a fresh working directory, synthetic data (the same batches for both: the step, not
the tokenizer, is measured), no checkpoints and no wandb. Per run: the median ``step_time_s`` of
steps 20 to the last (from ``metrics.jsonl``; rank 0's wall clock between steps) and the CPU
seconds of the whole run (every process it started, from ``RUSAGE_CHILDREN``). Reported: each
side's median over runs, the median of the pairs' ratios (A / B) with their spread, and the same
for CPU. 4 ranks share this machine's cores, so the wall clock is noisy; the CPU ratio is the
steadier measure of what a step does more. ``--nproc 2`` (tp 2 alone) gives each rank a core.

Usage::

    python benchmarks/recipe_ab.py --pairs 5 --steps 120 --out benchmarks/results/recipe_ab.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from provenance import provenance

ROOT = Path(__file__).resolve().parents[1]
FIRST_STEP = 20  # steps before it warm up (allocations, the first collectives' set-up)


def worktree(base: str, where: Path) -> Path:
    """A detached worktree of ``base`` (made once, reused)."""
    if not (where / "meshtrain").is_dir():
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(where), base],
            check=True,
            capture_output=True,
        )
    return where


def run(source: Path, steps: int, nproc: int = 4) -> dict[str, Any]:
    """One training run of the debug recipe from ``source`` (its meshtrain and recipes)."""
    work = Path(tempfile.mkdtemp(prefix="meshtrain-ab-"))
    env = {**os.environ, "PYTHONPATH": str(source), "WANDB_MODE": "disabled"}
    settings = [
        f"train.steps={steps}",
        "data.source=synthetic",
        "checkpoint.interval=100000",
        "checkpoint.resume=false",
        "logging.wandb=disabled",
        "logging.log_every=1",
    ]
    command = [sys.executable, "-m", "meshtrain", "train", "debug", "--nproc", str(nproc)]
    for setting in settings:
        command += ["--set", setting]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    began = time.perf_counter()
    done = subprocess.run(command, cwd=work, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - began
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if done.returncode != 0:
        raise SystemExit(
            f"the run from {source} failed ({done.returncode}):\n{done.stderr[-3000:]}"
        )
    times = _step_times(work)
    shutil.rmtree(work, ignore_errors=True)
    return {"step_s": statistics.median(times), "steps": len(times), "cpu_s": cpu, "wall_s": wall}


def _step_times(work: Path) -> list[float]:
    files = list(work.rglob("metrics.jsonl"))
    if not files:
        raise SystemExit(f"no metrics.jsonl under {work}")
    times = []
    for line in files[0].read_text().splitlines():
        record = json.loads(line)
        if record.get("step", 0) >= FIRST_STEP and "step_time_s" in record:
            times.append(float(record["step_time_s"]))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="21a9e5e")
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--nproc", type=int, default=4, help="ranks (4: dp 2 × tp 2; 2: tp 2)")
    parser.add_argument(
        "--worktree", type=Path, default=Path(tempfile.gettempdir()) / "meshtrain-ab-base"
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    sides = {"A": ROOT, "B": worktree(args.base, args.worktree)}
    results: dict[str, list[dict[str, Any]]] = {"A": [], "B": []}
    for pair in range(args.pairs):
        order = ("A", "B") if pair % 2 == 0 else ("B", "A")
        for side in order:
            results[side].append(run(sides[side], args.steps, args.nproc))
            last = results[side][-1]
            print(
                f"pair {pair + 1} {side}: {last['step_s'] * 1e3:.1f} ms/step, "
                f"{last['cpu_s']:.1f} CPU s",
                flush=True,
            )
    summary = _summary(results)
    print(
        f"debug recipe, A = this checkout, B = {args.base}: step {summary['A_step_s'] * 1e3:.1f} "
        f"vs {summary['B_step_s'] * 1e3:.1f} ms, paired ratio {summary['step_ratio']:.3f} "
        f"[{summary['step_ratio_min']:.3f}, {summary['step_ratio_max']:.3f}]; CPU per run "
        f"ratio {summary['cpu_ratio']:.3f} [{summary['cpu_ratio_min']:.3f}, "
        f"{summary['cpu_ratio_max']:.3f}]"
    )
    if args.out is not None:
        record = {
            **provenance(),
            "base": args.base,
            "steps": args.steps,
            "pairs": args.pairs,
            "ranks": f"{args.nproc} CPU gloo ranks (torchrun)",
            "summary": summary,
            "runs": results,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=1) + "\n")


def _summary(results: dict[str, list[dict[str, Any]]]) -> dict[str, float]:
    steps = [a["step_s"] / b["step_s"] for a, b in zip(results["A"], results["B"])]
    cpus = [a["cpu_s"] / b["cpu_s"] for a, b in zip(results["A"], results["B"])]
    return {
        "A_step_s": statistics.median(r["step_s"] for r in results["A"]),
        "B_step_s": statistics.median(r["step_s"] for r in results["B"]),
        "step_ratio": statistics.median(steps),
        "step_ratio_min": min(steps),
        "step_ratio_max": max(steps),
        "cpu_ratio": statistics.median(cpus),
        "cpu_ratio_min": min(cpus),
        "cpu_ratio_max": max(cpus),
    }


if __name__ == "__main__":
    main()
