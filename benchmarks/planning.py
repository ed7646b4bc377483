"""Planning time at cluster scale: the Llama 3 recipes on 8 to 16,384 abstract ranks (no processes).

For each recipe and world size, ``meshtrain.recipes.sizing.size_recipe`` (meta-device model, abstract
mesh, the footprint report, pipelines re-planned per checkpointing mode) is run ``--repeats``
times in this process; each run builds the model afresh, so every time includes the activation
trace. The table shows the first and the median time and the busiest rank's peak memory, or why
the recipe has no plan at that size.

Usage::

    python benchmarks/planning.py --out benchmarks/results/planning.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from provenance import provenance

from meshtrain.errors import MeshtrainError
from meshtrain.recipes import load_recipe
from meshtrain.recipes.sizing import size_recipe

RECIPES = ("llama3_8b", "llama3_70b", "llama3_405b")
WORLDS = (8, 64, 1024, 16384)


def measure(recipe_name: str, world: int, repeats: int) -> dict[str, Any]:
    recipe = load_recipe(recipe_name)
    times: list[float] = []
    peak = None
    for _ in range(repeats):
        start = time.perf_counter()
        try:
            sizing = size_recipe(recipe, world=world, device_memory="80GiB")
        except MeshtrainError as error:
            return {"error": error.message.split(". ")[0], "seconds": time.perf_counter() - start}
        times.append(time.perf_counter() - start)
        peak = sizing.footprint.memory.total
    return {
        "first_s": times[0],
        "median_s": statistics.median(times[1:] or times),
        "peak_gib": (peak or 0) / 2**30,
        "fits_80gib": (peak or 0) <= 80 * 2**30,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    results: dict[str, dict[str, Any]] = {}
    print(f"{'recipe':<12} {'world':>6}  {'first':>8}  {'median':>8}  {'peak/rank':>10}")
    for name in RECIPES:
        for world in WORLDS:
            row = measure(name, world, args.repeats)
            results[f"{name}@{world}"] = row
            if "error" in row:
                print(f"{name:<12} {world:>6}  no plan: {row['error'][:90]}")
            else:
                print(
                    f"{name:<12} {world:>6}  {row['first_s']:>7.2f}s  {row['median_s']:>7.2f}s  "
                    f"{row['peak_gib']:>7.1f} GiB{'' if row['fits_80gib'] else ' (>80)'}"
                )
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        record = {**provenance(), "results": results}
        args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
