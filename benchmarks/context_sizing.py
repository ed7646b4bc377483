"""Llama 3 8B's memory per rank under context parallelism: 8k to 1M tokens over cp 1 to 16.

Each cell is ``meshtrain plan llama3_8b_128k --world 16 --set mesh.cp=CP --set
train.seq_len=S --set model.max_seq_len=S --set train.batch_size=16/CP``
(``meshtrain.recipes.sizing.size_recipe``: a
meta-device model on 16 abstract ranks, dp = 16 / cp, one sequence per data-parallel rank, FSDP
zero 3 over dp × cp, bf16, full checkpointing, the ring): the busiest rank's planned peak, and
the planning time. Along a diagonal where cp grows with the sequence each rank holds the same
tokens, so its memory stays flat (torchtitan's table: 8 H100s, FSDP 8 × CP 1 at 32k to FSDP 1
× CP 8 at 262k, ~84 GiB each).

Two figures per cell with cp > 1: the plan's (meshtrain's ring as lowered, which computes each
key/value block 512 x 512 scores at a time: three fp32 ``[1, 32, 512, 512]`` tensors, 96 MiB,
at its peak) and the same plan with each block's scores computed whole (three fp32
``[1, 32, S/cp, S/cp]`` tensors, ``score_block_bytes``, in place of the tile's): the kernel
before it was tiled. A fused kernel that keeps no scores would hold at most 96 MiB less than
the first.

Usage::

    python benchmarks/context_sizing.py --out benchmarks/results/context_sizing.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from provenance import provenance

from meshtrain.errors import MeshtrainError
from meshtrain.plan.context.cost import score_block_bytes, score_tile_bytes
from meshtrain.plan.memory.activations import AttentionCall
from meshtrain.recipes import load_recipe
from meshtrain.recipes.sizing import size_recipe

RECIPE = "llama3_8b_128k"
WORLD = 16
LENGTHS = (8192, 32768, 131072, 1048576)
DEGREES = (1, 2, 4, 8, 16)
DEVICE = "80GiB"


def cell(seq_len: int, cp: int, mode: str) -> dict[str, Any]:
    """One recipe planned at ``seq_len`` tokens over ``cp`` context ranks."""
    overrides = [
        f"mesh.cp={cp}",
        f"train.seq_len={seq_len}",
        f"model.max_seq_len={seq_len}",
        f"train.batch_size={WORLD // cp}",
        f"parallel.activation_checkpointing={mode}",
    ]
    if cp == 1:
        overrides.append('parallel.context=""')
    start = time.perf_counter()
    try:
        sizing = size_recipe(load_recipe(RECIPE, overrides), world=WORLD, device_memory=DEVICE)
    except MeshtrainError as error:
        return {"error": error.message.split(". ")[0]}
    memory = sizing.footprint.memory
    config = sizing.plan.options
    heads, kv_heads, head_dim = 32, 8, 128  # Llama 3 8B
    local = seq_len // cp
    call = AttentionCall(
        (config.batch_size or 1, heads, local, head_dim),
        (1, kv_heads, local, head_dim),
        (1, kv_heads, local, head_dim),
        2,
    )
    whole = score_block_bytes(call) - score_tile_bytes(call) if cp > 1 else 0
    return {
        "peak_gib": memory.total / 2**30,
        "whole_block_peak_gib": (memory.total + whole) / 2**30,
        "whole_block_fits": memory.total + whole <= 80 * 2**30,
        "activations_gib": memory.activations / 2**30,
        "at_rest_gib": memory.at_rest / 2**30,
        "fits": bool(sizing.footprint.fits),
        "cp_sent_gib": sizing.footprint.sent_bytes("cp") / 2**30 if cp > 1 else 0.0,
        "seconds": time.perf_counter() - start,
    }


def table(results: dict[str, dict[str, Any]], mode: str, whole: bool = False) -> str:
    head = f"| tokens | {' | '.join(f'cp {cp} (dp {WORLD // cp})' for cp in DEGREES)} |"
    rows = [head, "|---:" * (len(DEGREES) + 1) + "|"]
    for seq_len in LENGTHS:
        cells = []
        for cp in DEGREES:
            row = results[f"{mode}@{seq_len}@{cp}"]
            if "error" in row:
                cells.append("no plan")
            else:
                peak, fits = (
                    (row["whole_block_peak_gib"], row["whole_block_fits"])
                    if whole
                    else (row["peak_gib"], row["fits"])
                )
                cells.append(f"{peak:,.1f}{'' if fits else ' ✗'}")
        rows.append(f"| {seq_len // 1024}k | {' | '.join(cells)} |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", nargs="+", default=["full", "selective"])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    results: dict[str, dict[str, Any]] = {}
    for mode in args.modes:
        for seq_len in LENGTHS:
            for cp in DEGREES:
                results[f"{mode}@{seq_len}@{cp}"] = cell(seq_len, cp, mode)
        for whole in (False, True):
            kernel = "scores computed whole per block" if whole else "the ring as lowered (tiled)"
            print(
                f"\npeak GiB per rank, {mode} checkpointing, {WORLD} ranks, {kernel} (✗: over "
                f"{DEVICE}):"
            )
            print(table(results, mode, whole))
    seconds = [r["seconds"] for r in results.values() if "seconds" in r]
    print(
        f"\nplanning time per cell: median {sorted(seconds)[len(seconds) // 2]:.2f} s, "
        f"max {max(seconds):.2f} s"
    )
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        record = {**provenance(), "world": WORLD, "device_memory": DEVICE, "results": results}
        args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
