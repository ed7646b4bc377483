"""Context parallelism on 4 gloo ranks: step time and memory per rank against sequence length,
cp 1 vs 2 vs 4 (CPU).

For each sequence length, three plans of the debug Llama (fp32, FSDP zero 3 over every rank) on
the same 4 ranks, one sequence per data-parallel rank:

- ``cp 1``: dp 4, each rank a whole sequence (SDPA), the baseline;
- ``cp 2``: dp 2 × cp 2, each rank half of a sequence (head-tail chunks, the ring);
- ``cp 4``: cp 4, each rank a quarter of one sequence.

Measured on every rank, in one run of one pool (so the ratios share the machine's state):

- **step time**: forward and backward of one step (no optimizer), between barriers, the median
  of ``--steps`` after one warm-up, and tokens per second per rank;
- **memory** by counting saved tensors: the bytes autograd keeps for backward over the model's
  forward (each storage once; parameters, FSDP2's gathered weights and buffers excluded:
  ``torch.autograd.graph.saved_tensors_hooks`` entered by forward hooks), in all and inside the
  attention modules alone (what falls as 1/cp), beside the plan's prediction of the same bytes
  (its traced activations with checkpointing off, less the ring's in-flight buffers, which are
  not saved tensors);
- the process's peak resident memory (``ru_maxrss``), which only grows: a coarse upper figure.

Usage::

    python benchmarks/long_context.py --out benchmarks/results/long_context.json
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from provenance import provenance

import meshtrain as mt
from meshtrain.models import LlamaConfig, build_llama, default_rules
from meshtrain.plan.context.cost import ring_in_flight
from meshtrain.testing.runner import SPMDPool
from meshtrain.train import Batch, forward_backward

LENGTHS = (512, 1024, 2048, 4096)
DEGREES = (1, 2, 4)
WORLD = 4


class _SavedBytes:
    """Bytes of the tensors autograd saves while active (each storage once), parameters aside:
    a leaf that requires a gradient (or a view of one) is a weight — FSDP2's gathered parameter,
    which the planner counts as gathered parameters, not activations — and buffers are buffers."""

    def __init__(self, buffers: set[int]) -> None:
        self.seen, self.total = set(buffers), 0

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        key = tensor.untyped_storage().data_ptr()
        base = tensor._base if tensor._base is not None else tensor
        if not (base.is_leaf and base.requires_grad) and key not in self.seen:
            self.seen.add(key)
            self.total += tensor.untyped_storage().nbytes()
        return tensor


def _count(modules: list[torch.nn.Module], pack: Any) -> list[Any]:
    """Hooks that pass what each of ``modules``' forward saves to ``pack`` (innermost wins)."""
    handles, active = [], []

    def enter(module: torch.nn.Module, args: Any, kwargs: Any) -> None:
        hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        hooks.__enter__()
        active.append(hooks)

    def leave(module: torch.nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        active.pop().__exit__(None, None, None)

    for module in modules:
        handles += [
            module.register_forward_pre_hook(enter, with_kwargs=True),
            module.register_forward_hook(leave, with_kwargs=True),
        ]
    return handles


def _plan(model: torch.nn.Module, seq_len: int, cp: int, abstract: bool = False) -> mt.Plan:
    mesh = mt.make_mesh(
        dp=WORLD // cp, cp=cp, world_size=WORLD if abstract else None, abstract=abstract
    )
    logical = (
        (("seq", "cp"), *default_rules(tp=None).logical)
        if cp > 1
        else default_rules(tp=None).logical
    )
    return mt.plan(
        model, mesh, mt.Rules(logical=logical, fsdp="dp"), batch_size=1, seq_len=seq_len, zero=3
    )


def predicted_saved(seq_len: int, cp: int) -> int:
    """The plan's saved bytes per rank: its activations without checkpointing, less the ring's
    in-flight buffers (not saved tensors)."""
    config = LlamaConfig.preset("debug", max_seq_len=seq_len)
    plan = _plan(build_llama(config, device="meta"), seq_len, cp, abstract=True)
    return dict(plan.activation_estimates)["none"] - _in_flight(config, seq_len, cp)


def measure(seq_len: int, cp: int, steps: int) -> dict[str, Any]:
    """Runs on every rank: the plan for ``cp``, its step time and saved bytes."""
    config = LlamaConfig.preset("debug", max_seq_len=seq_len)
    model = build_llama(config, seed=0)
    plan = _plan(model, seq_len, cp)
    mesh = plan.mesh
    model = mt.apply(plan, model)
    dp_rank = mesh.coordinates(dist.get_rank())["dp"]
    tokens = torch.randint(
        0, config.vocab_size, (1, seq_len + 1), generator=torch.Generator().manual_seed(dp_rank)
    )
    batch = Batch(tokens[:, :-1], tokens[:, 1:])
    loss = lambda logits, targets: F.cross_entropy(  # noqa: E731
        logits.flatten(0, 1), targets.flatten(), reduction="sum"
    )
    forward_backward(plan, model, batch, loss)  # warm-up (lazy initialisation)
    times = []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        forward_backward(plan, model, batch, loss)
        dist.barrier()
        times.append(time.perf_counter() - start)
    buffers = {b.untyped_storage().data_ptr() for b in model.buffers()}
    whole, attention = _SavedBytes(buffers), _SavedBytes(buffers)
    attentions = [
        m
        for fqn, m in model.named_modules()
        if fqn.endswith("attention") and type(m).__name__ == "Attention"
    ]
    handles = _count([model], whole.pack)  # the model's forward: the loss's own tensors aside
    handles += _count(attentions, lambda t: whole.pack(attention.pack(t)))
    forward_backward(plan, model, batch, loss)
    for handle in handles:
        handle.remove()
    return {
        "step_s": statistics.median(times),
        "tokens_per_s_per_rank": seq_len / cp / statistics.median(times),
        "saved_bytes": whole.total,
        "attention_saved_bytes": attention.total,
        "predicted_saved_bytes": predicted_saved(seq_len, cp),
        "maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def _in_flight(config: LlamaConfig, seq_len: int, cp: int) -> int:
    """The ring's in-flight buffers the plan adds to its activations (not saved tensors)."""
    from meshtrain.plan.memory.activations import trace_activations

    if cp == 1:
        return 0
    model = build_llama(config, device="meta")
    blocks = tuple(f"layers.{i}" for i in range(config.n_layers))
    profile = trace_activations(model, blocks, batch_size=1, seq_len=seq_len // cp)
    return ring_in_flight(profile, cp, "ring")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--replan",
        type=Path,
        default=None,
        help="recompute the predictions of a stored run (no ranks) and print it",
    )
    args = parser.parse_args()
    if args.replan is not None:
        record = json.loads(args.replan.read_text())
        for key, row in record["results"].items():
            seq_len, cp = map(int, key.split("@"))
            row["predicted_saved_bytes"] = predicted_saved(seq_len, cp)
        args.replan.write_text(json.dumps(record, indent=1) + "\n")
        print(table(record["results"], sorted({int(k.split("@")[0]) for k in record["results"]})))
        return
    results: dict[str, Any] = {}
    with SPMDPool(WORLD, timeout_s=1800.0) as pool:
        for seq_len in args.lengths:
            for cp in DEGREES:
                per_rank = pool.run(measure, seq_len, cp, args.steps)
                results[f"{seq_len}@{cp}"] = {
                    "step_s": max(r["step_s"] for r in per_rank),
                    "tokens_per_s_per_rank": min(r["tokens_per_s_per_rank"] for r in per_rank),
                    **{
                        key: max(r[key] for r in per_rank)
                        for key in (
                            "saved_bytes",
                            "attention_saved_bytes",
                            "predicted_saved_bytes",
                            "maxrss_mib",
                        )
                    },
                }
    print(table(results, args.lengths))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        record = {**provenance(), "world": WORLD, "results": results}
        args.out.write_text(json.dumps(record, indent=1) + "\n")


def table(results: dict[str, Any], lengths: list[int]) -> str:
    rows = [
        "| tokens | cp | step (s) | vs cp 1 | saved / rank (MiB) | predicted (MiB) | "
        "attention saved (MiB) | vs cp 1 | max RSS (MiB) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for seq_len in lengths:
        base = results[f"{seq_len}@1"]
        for cp in DEGREES:
            r = results[f"{seq_len}@{cp}"]
            rows.append(
                f"| {seq_len} | {cp} | {r['step_s']:.3f} | {r['step_s'] / base['step_s']:.2f} | "
                f"{r['saved_bytes'] / 2**20:.2f} | {r['predicted_saved_bytes'] / 2**20:.2f} | "
                f"{r['attention_saved_bytes'] / 2**20:.3f} | "
                f"{r['attention_saved_bytes'] / base['attention_saved_bytes']:.2f} | "
                f"{r['maxrss_mib']:.0f} |"
            )
    return "\n".join(rows)


if __name__ == "__main__":
    main()
