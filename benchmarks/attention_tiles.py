"""The context-attention kernel's tile: peak memory and step time of one key/value block.

One block of ``S_local`` keys against ``S_local`` queries (``B = 1``, ``Hq = Hkv = 8``, ``D = 64``,
fp32), forward and the recomputing backward through ``blockwise_attention`` (the per-block kernel
the ring runs on every arriving block), for a causal diagonal block (half its tiles fully masked,
skipped) and a fully visible one (a ring block from an earlier rank). ``whole`` is the tile
``S_local x S_local``: the scores of the block computed at once, as the kernel did before tiling.

Memory: each cell runs in a fresh process; the figure is its peak resident set (``ru_maxrss``)
during one forward and backward less its resident set just before (inputs allocated): every
transient, the saved tensors and the gradients included. Time: the best of ``--repeat`` forward
and backward passes after that one.

Usage::

    python benchmarks/attention_tiles.py --out benchmarks/results/attention_tiles.json
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from provenance import provenance

from meshtrain.lower.context.attention_blocks import KVBlock, Tile, blockwise_attention

SEQ, HEADS, DIM = 4096, 8, 64
TILES = (128, 256, 512, 1024, SEQ)


def _rss() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


def one(tile: int, causal: bool, repeat: int) -> dict[str, Any]:
    """One cell, in this process (meant to be a fresh one)."""
    gen = torch.Generator().manual_seed(0)
    q, k, v, grad = (torch.randn(1, HEADS, SEQ, DIM, generator=gen) for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    pos = torch.arange(SEQ)

    def step() -> None:
        out = blockwise_attention(
            q, [KVBlock(k, v, pos)], positions_q=pos, causal=causal, tile=Tile(tile, tile)
        )
        torch.autograd.grad(out, (q, k, v), grad)

    before = _rss()
    step()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return {
        "tile": tile,
        "causal": causal,
        "peak_mib": peak / 2**20,
        "scores_tile_mib": HEADS * tile * tile * 4 / 2**20,
        "step_s": min(times),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--one", nargs=2, metavar=("TILE", "CAUSAL"), default=None)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--tiles", type=int, nargs="+", default=list(TILES))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.one is not None:
        print(json.dumps(one(int(args.one[0]), args.one[1] == "1", args.repeat)))
        return
    rows = []
    for causal in (True, False):
        for tile in args.tiles:
            command = [
                sys.executable,
                __file__,
                "--one",
                str(tile),
                str(int(causal)),
                "--repeat",
                str(args.repeat),
            ]
            rows.append(
                json.loads(
                    subprocess.run(command, capture_output=True, text=True, check=True).stdout
                )
            )
            row = rows[-1]
            name = "whole" if tile == SEQ else f"{tile} x {tile}"
            print(
                f"{'causal' if causal else 'visible'} {name:>11}: peak {row['peak_mib']:8.1f} "
                f"MiB, step {row['step_s']:.2f} s",
                flush=True,
            )
    if args.out is not None:
        record = {**provenance(), "seq_local": SEQ, "heads": HEADS, "dim": DIM, "results": rows}
        args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
