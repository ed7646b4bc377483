"""meshtrain plans on GPUs: NCCL, bf16, CUDA memory, tokens/s and MFU against the device's peak.

Skips (exit 0, a JSON record saying why) when no CUDA device is present. On one GPU run it with
``python``; on several, under ``torchrun --nproc_per_node <gpus>``. Every rank builds the same
Llama (full tensors, seed 0) on its GPU, ``mt.apply(mt.plan(...), model)`` distributes it, and it
trains with AdamW in bf16 (FSDP2's mixed-precision policy: bf16 compute, fp32 master weights and
reduction) on random tokens. Rows: FSDP (ZeRO-3) over every rank, eager and compiled (inductor, per
block), and FSDP × TP (tp 2) on 4 or more ranks (an even count).

Reported per row: median step time after the warm-up, global tokens/s, MFU (tokens/s × training
FLOPs per token, ``6·N + 12·layers·dim·seq``, over the GPUs' peak dense bf16 FLOP/s from the
vendor's data sheet by device name), the peak CUDA memory allocated on the busiest rank against
the plan's predicted peak, and the losses (both plans start from the same weights and data).

``--cpu-smoke`` runs the same code on 2 CPU gloo ranks with a tiny model, to check the script
where no GPU is at hand; its figures are not GPU figures (no MFU, resident memory instead).

Usage::

    python benchmarks/gpu.py --out benchmarks/results/gpu.json
    torchrun --nproc_per_node 8 benchmarks/gpu.py --out benchmarks/results/gpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from provenance import provenance

import meshtrain as mt
from meshtrain.models import LlamaConfig, build_llama, default_rules, llama_flops_per_token
from meshtrain.train.throughput import (
    model_flops_utilization,
    peak_bf16_flops,
    peak_rss_gib,
)

GPU_MODEL = {"dim": 2048, "n_layers": 16, "n_heads": 16, "n_kv_heads": 8, "vocab_size": 32768}
SMOKE_MODEL = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 256}
_GIB = 2**30


def _rows(world: int) -> list[dict[str, Any]]:
    rows = [
        {"name": "fsdp", "mesh": {"dp": world, "tp": 1}, "compile": False},
        {"name": "fsdp_compiled", "mesh": {"dp": world, "tp": 1}, "compile": True},
    ]
    if world % 2 == 0 and world >= 4:  # bf16 is lowered through FSDP2: dp ≥ 2 beside tp 2
        rows.append({"name": "fsdp_tp", "mesh": {"dp": world // 2, "tp": 2}, "compile": False})
    return rows


def measure(row: dict[str, Any], shapes: dict[str, int], options: dict[str, int]) -> dict[str, Any]:
    """Runs on every rank (process group up): one plan, warm-up, timed steps, memory, losses."""
    cuda = torch.cuda.is_available() and dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    batch, seq = options["batch"], options["seq"]
    config = LlamaConfig.preset("debug", **shapes, max_seq_len=seq)
    mesh = mt.make_mesh(row["mesh"], device_type=device.type)
    model = build_llama(config, seed=0).to(device)
    compile_options = {"backend": "inductor"} if row["compile"] else False
    dp = mesh.size("dp")
    plan = mt.plan(
        model,
        mesh,
        default_rules(),
        zero=3,
        precision="bf16",
        compile=compile_options,
        global_batch=batch * dp,
        seq_len=seq,
    )
    mt.apply(plan, model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    dp_rank = mesh.coordinates(dist.get_rank())["dp"]
    global_tokens = batch * seq * dp
    generator = torch.Generator().manual_seed(dp_rank)
    tokens = torch.randint(0, config.vocab_size, (batch, seq + 1), generator=generator).to(device)

    def step() -> float:
        with mt.micro_batch(plan, model, last=True), mt.loss_parallel(plan):
            logits = model(tokens[:, :-1])
            loss = (
                F.cross_entropy(
                    logits.flatten(0, 1).float(), tokens[:, 1:].flatten(), reduction="sum"
                )
                / global_tokens
            )
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        value = loss.detach()
        value = value.full_tensor() if hasattr(value, "full_tensor") else value
        return float(value)

    if cuda:
        torch.cuda.reset_peak_memory_stats()
    losses, times = [], []
    for index in range(options["warmup"] + options["steps"]):
        dist.barrier()
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        losses.append(step())
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()
        if index >= options["warmup"]:
            times.append(time.perf_counter() - start)
    memory = torch.cuda.max_memory_allocated() / _GIB if cuda else peak_rss_gib()
    return {
        "times": times,
        "losses": losses,  # this rank's share of each step's loss
        "memory_gib": memory,
        "planned_peak_gib": plan.memory.total / _GIB,
        "flops_per_token": llama_flops_per_token(config, seq),
        "params": config.num_params(),
        "device": torch.cuda.get_device_name() if cuda else "cpu",
    }


def summarise(row: dict[str, Any], per_rank: list[dict[str, Any]], world: int) -> dict[str, Any]:
    rounds = len(per_rank[0]["times"])
    step_s = statistics.median(max(r["times"][i] for r in per_rank) for i in range(rounds))
    tokens = per_rank[0]["global_tokens"]
    tokens_per_s = tokens / step_s
    device = per_rank[0]["device"]
    peak = peak_bf16_flops(device) if device != "cpu" else None
    mfu = (
        model_flops_utilization(tokens_per_s, per_rank[0]["flops_per_token"], peak, world)
        if peak
        else None
    )
    busiest = max(per_rank, key=lambda r: r["memory_gib"] or 0.0)
    return {
        "mesh": row["mesh"],
        "compile": row["compile"],
        "median_step_s": step_s,
        "tokens_per_s": tokens_per_s,
        "mfu": mfu,
        "peak_memory_gib": busiest["memory_gib"],
        "planned_peak_gib": busiest["planned_peak_gib"],
        "losses": per_rank[0]["global_losses"],
    }


def run_all(shapes: dict[str, int], options: dict[str, int]) -> list[dict[str, Any]]:
    """Runs on every rank: every row; returns this rank's measurements with global losses."""
    results = []
    for row in _rows(dist.get_world_size()):
        result = measure(row, shapes, options)
        dp = row["mesh"]["dp"]
        shares = torch.tensor(result["losses"], dtype=torch.float64)
        if dist.get_backend() == "nccl":
            shares = shares.cuda()
        dist.all_reduce(shares)  # every rank holds its dp shard's loss: tp ranks repeat it
        result["global_losses"] = (shares / (dist.get_world_size() // dp)).tolist()
        result["global_tokens"] = options["batch"] * options["seq"] * dp
        results.append(result)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4, help="sequences per data-parallel rank")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--cpu-smoke", action="store_true")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    options = {"batch": args.batch, "seq": args.seq, "warmup": args.warmup, "steps": args.steps}
    if args.cpu_smoke:
        from meshtrain.testing.runner import get_pool

        options.update(batch=2, seq=32, warmup=1, steps=2)
        per_rank = get_pool(2).run(run_all, SMOKE_MODEL, options, _timeout_s=900)
        _report(per_rank, 2, SMOKE_MODEL, options, args.out, smoke=True)
        return
    if not torch.cuda.is_available():
        reason = "no CUDA device: the GPU benchmark needs one (skipped)"
        print(reason)
        _write(args.out, {**provenance(), "skipped": reason})
        return
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    mt.init_distributed()  # joins torchrun's group (NCCL), or a one-rank group without it
    world = dist.get_world_size()
    per_rank_rows = run_all(GPU_MODEL, options)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, per_rank_rows)
    if dist.get_rank() == 0:
        _report(gathered, world, GPU_MODEL, options, args.out, smoke=False)
    dist.destroy_process_group()


def _report(
    per_rank: list[list[dict[str, Any]]],
    world: int,
    shapes: dict[str, int],
    options: dict[str, int],
    out: Path | None,
    *,
    smoke: bool,
) -> None:
    results = {}
    for index, row in enumerate(_rows(world)):
        results[row["name"]] = summarise(row, [ranks[index] for ranks in per_rank], world)
    first = per_rank[0][0]
    record = {
        **provenance(),
        "device": first["device"],
        "ranks": world,
        "backend": "gloo (CPU smoke run: not GPU figures)" if smoke else "nccl",
        "model": {**shapes, "params": first["params"], "flops_per_token": first["flops_per_token"]},
        **options,
        "results": results,
    }
    print(_table(record), flush=True)
    _write(out, record)


def _table(record: dict[str, Any]) -> str:
    lines = [
        f"{record['device']} × {record['ranks']} ({record['backend']}), Llama of "
        f"{record['model']['params']:,} parameters, {record['batch']} × {record['seq']} tokens per "
        "data-parallel rank, bf16",
        f"  {'plan':<15} {'step':>10} {'tokens/s':>12} {'MFU':>7} {'peak memory':>13} "
        f"{'planned':>9}  losses",
    ]
    for name, r in record["results"].items():
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "-"
        memory = f"{r['peak_memory_gib']:.2f} GiB" if r["peak_memory_gib"] is not None else "-"
        losses = " ".join(f"{v:.4f}" for v in r["losses"][:3])
        lines.append(
            f"  {name:<15} {r['median_step_s'] * 1e3:>7.1f} ms {r['tokens_per_s']:>12,.0f} "
            f"{mfu:>7} {memory:>13} {r['planned_peak_gib']:>5.2f} GiB  {losses}"
        )
    return "\n".join(lines)


def _write(out: Path | None, record: dict[str, Any]) -> None:
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
