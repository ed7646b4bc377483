"""Byte-level tokenising of a JSON Lines file: one process against a pool of worker processes,
with the byte tokenizer's array fast path and through ``encode()`` (an int per byte, as any
tokenizer written in Python runs, and as byte tokenising ran before the fast path).

A JSONL file of ``--mb`` MiB is written from the stdlib corpus's documents (repeated, each row
numbered), then tokenised by ``prepare_documents`` into fresh directories in the four ways, in
alternating order over ``--rounds`` rounds (so machine drift hits all alike), every output
checked byte for byte against the first. Reported: the median wall time of each, MiB/s, the
pool's speed-up on each path, and the cores this process may use (a shared machine's load shows
in the spread: min and max are in the JSON).

Usage::

    python benchmarks/tokenise.py --mb 64 --rounds 3 --out benchmarks/results/tokenise.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from provenance import provenance

from meshtrain.train.data.corpus import stdlib_documents
from meshtrain.train.data.documents import DocumentSource
from meshtrain.train.data.packed import prepare_documents
from meshtrain.train.data.tokenizer import ByteTokenizer

FILES = ("tokens.bin", "loss_mask.bin", "tokens.json")


def write_jsonl(path: Path, mib: int) -> int:
    """``mib`` MiB of rows ``{"text": ...}`` from the stdlib corpus; the number of rows."""
    documents = list(stdlib_documents(limit_bytes=4 << 20))
    rows, size, limit = 0, 0, mib << 20
    with path.open("w", encoding="utf-8") as out:
        while size < limit:
            line = json.dumps({"text": f"{rows}: {documents[rows % len(documents)]}"}) + "\n"
            out.write(line)
            size += len(line.encode())
            rows += 1
    return rows


class ListBytes(ByteTokenizer):
    """The byte tokenizer through ``encode`` (a Python int per byte): how a tokenizer written
    in Python runs, and how byte tokenising ran before the array fast path."""

    def encode(self, text: str) -> list[int]:
        return super().encode(text)


def run(source: DocumentSource, out: Path, workers: int, generic: bool) -> float:
    started = time.perf_counter()
    tokenizer = ListBytes() if generic else ByteTokenizer()
    prepared = prepare_documents(source, tokenizer, out, workers=workers)
    assert not prepared.reused
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        rows = write_jsonl(root / "data.jsonl", args.mb)
        source = DocumentSource("jsonl", str(root / "data.jsonl"))
        configs = [(path, w) for path in ("bytes", "encode") for w in (1, args.workers)]
        times: dict[tuple[str, int], list[float]] = {config: [] for config in configs}
        for round_ in range(args.rounds):
            for path, workers in configs if round_ % 2 == 0 else configs[::-1]:
                out = root / f"out-{round_}-{path}-{workers}"
                times[path, workers].append(run(source, out, workers, path == "encode"))
                for name in FILES:
                    first = (root / "out-0-bytes-1" / "train" / name).read_bytes()
                    assert (out / "train" / name).read_bytes() == first, (name, path, workers)
    median = {config: statistics.median(t) for config, t in times.items()}
    result = {
        **provenance(),
        "cores": len(os.sched_getaffinity(0)),
        "mib": args.mb,
        "documents": rows,
        "workers": args.workers,
        "rounds": args.rounds,
        "seconds": {
            f"{path}/{w}": {"median": median[path, w], "min": min(t), "max": max(t)}
            for (path, w), t in times.items()
        },
        "speedup_pool_bytes": median["bytes", 1] / median["bytes", args.workers],
        "speedup_pool_encode": median["encode", 1] / median["encode", args.workers],
        "speedup_bytes_over_encode": median["encode", 1] / median["bytes", 1],
        "identical_outputs": True,
    }
    lines = ["| ids from | processes | median s | MiB/s |", "|---|---|---|---|"]
    for path, w in configs:
        what = "UTF-8 bytes as one array" if path == "bytes" else "encode(), an int per byte"
        lines.append(f"| {what} | {w} | {median[path, w]:.2f} | {args.mb / median[path, w]:.1f} |")
    print("\n".join(lines))
    print(
        f"pool speed-up: bytes {result['speedup_pool_bytes']:.2f}x, encode() "
        f"{result['speedup_pool_encode']:.2f}x on {result['cores']} cores; {rows:,} documents, "
        "outputs identical"
    )
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
