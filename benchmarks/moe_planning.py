"""DeepSeek-V3-671B sized on 64 to 2,048 abstract ranks: per-rank memory, whether it fits 80 GiB,
and the expert all-to-all bytes per step, for each expert-parallel degree (no processes).

Each row builds the ``deepseek_v3_671b`` preset on the meta device and plans it with
``mt.plan`` (ZeRO-3, bf16 compute, fp32 master weights, AdamW, full activation checkpointing,
one sequence of 4096 tokens per rank and micro-batch) on an abstract mesh ``{dp, ep}``; the
time is the planning call's (the model build is timed once apart). Memory is the plan's at rest
(master weights, gradients, optimizer states) and transient (gathered compute copies,
unsharded gradients), plus the plan's traced activations (the block inputs full checkpointing
keeps and one recomputed block, whose MoE layer's dispatch working set is counted for uniform
routing: :mod:`meshtrain.plan.experts.activations`): the *uniform* peak is the plan's total; the
*worst* adds the dropless worst case's working set over the uniform one
(:func:`~meshtrain.plan.experts.cost.moe_working_set`). With a pipeline (``pp`` 4, 1F1B over 8
micro-batches: 8 sequences per batch rank per step) the figures are the pipeline rank's with the
most MoE layers: its layers' all-to-alls and the block inputs of its micro-batches in flight.

Usage::

    python benchmarks/moe_planning.py --out benchmarks/results/moe_planning.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from provenance import provenance

import meshtrain as mt
from meshtrain.errors import MeshtrainError
from meshtrain.models.moe import build_moe, default_rules
from meshtrain.models.moe_presets import moe_preset
from meshtrain.plan.experts.cost import (
    estimate_expert_collectives,
    expert_layers,
    moe_working_set,
)
from meshtrain.plan.memory.footprint import ring_bytes

WORLDS = (64, 128, 256, 512, 1024, 2048)
EPS = (8, 16, 32, 64)
GiB = 2**30
DEVICE = 80 * GiB
SEQ_LEN = 4096


def row(model: Any, world: int, ep: int, pp: int) -> dict[str, Any]:
    """One configuration planned: its memory, fit and all-to-all bytes, or why it is refused."""
    start = time.perf_counter()
    try:
        axes = (
            {"pp": pp, "dp": world // (ep * pp), "ep": ep}
            if pp > 1
            else {"dp": world // ep, "ep": ep}
        )
        mesh = mt.make_mesh(axes, world_size=world, abstract=True, device_type="cuda")
        pipeline = mt.Pipeline(axis="pp", microbatches=2 * pp) if pp > 1 else None
        plan = mt.plan(
            model,
            mesh,
            default_rules(tp=None, fsdp="dp", ep="ep"),
            zero=3,
            precision="bf16",
            activation_checkpointing="full",
            batch_size=1,
            seq_len=SEQ_LEN,
            pipeline=pipeline,
        )
    except MeshtrainError as error:
        return {"refused": error.message.split(". ")[0], "seconds": time.perf_counter() - start}
    seconds = time.perf_counter() - start
    groups, _ = _busiest(plan, model.config.n_layers)
    layers = expert_layers(groups, plan.params)
    memory = plan.memory
    result: dict[str, Any] = {
        "dp": world // (ep * pp),
        "seconds": seconds,
        "at_rest_gib": memory.at_rest / GiB,
        "transient_params_gib": (memory.gathered_params + memory.unsharded_grads) / GiB,
        "activations_gib": memory.activations / GiB,
    }
    uniform = moe_working_set(layers[0], tokens=SEQ_LEN, ep=ep, activation_bytes=2)
    base = memory.total
    for routing in ("uniform", "worst"):
        working = (
            moe_working_set(layers[0], tokens=SEQ_LEN, ep=ep, activation_bytes=2, routing=routing)
            - uniform
        )
        collectives = estimate_expert_collectives(
            groups, plan.params, "ep", ep, plan.options, plan.checkpointed, routing=routing
        )
        payload = sum(c.bytes for c in collectives)
        result[f"{routing}_peak_gib"] = (base + working) / GiB
        result[f"{routing}_fits"] = base + working <= DEVICE
        result[f"{routing}_all_to_all_gib"] = payload / GiB
        result[f"{routing}_sent_gib"] = ring_bytes("all_to_all", payload, ep) / GiB
    return result


def _busiest(plan: Any, n_layers: int) -> tuple[tuple[Any, ...], int]:
    """The expert groups of the pipeline rank with the most MoE layers (all of them without a
    pipeline) and the block inputs it keeps: its blocks × the micro-batches in flight."""
    if plan.pipeline is None:
        return plan.experts, n_layers
    best: tuple[tuple[Any, ...], int] = ((), 0)
    for rank in range(plan.mesh.size(plan.pipeline.axis)):
        stages = plan.pipeline.local_stages(rank)
        kept = {fqn for stage in stages for fqn in stage.params}
        groups = tuple(g for g in plan.experts if set(g.params) & kept)
        blocks = sum(sum(m.startswith("layers.") for m in s.modules) * s.in_flight for s in stages)
        best = max(best, (groups, blocks), key=lambda pair: (len(pair[0]), pair[1]))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    start = time.perf_counter()
    model = build_moe(moe_preset("deepseek_v3_671b"), device="meta")
    build_s = time.perf_counter() - start
    print(
        f"deepseek_v3_671b: {model.config.num_params() / 1e9:.1f}B parameters, built on the "
        f"meta device in {build_s:.2f} s"
    )
    print(
        f"{'ranks':>6} {'ep':>4} {'dp':>5} {'pp':>3}  {'at rest':>8} {'peak unif':>9} "
        f"{'peak worst':>10} {'fits':>10}  {'a2a unif':>9} {'a2a worst':>9}  {'plan s':>6}"
    )
    results: dict[str, Any] = {}
    for world in WORLDS:
        for ep in EPS:
            for pp in (1, 4):
                if world % (ep * pp):
                    continue
                r = row(model, world, ep, pp)
                results[f"{world}/ep{ep}/pp{pp}"] = r
                if "refused" in r:
                    if pp == 1 or ep == EPS[0]:
                        print(f"{world:>6} {ep:>4} {'':>5} {pp:>3}  refused: {r['refused'][:80]}")
                    continue
                fits = (
                    f"{'yes' if r['uniform_fits'] else 'no'}/{'yes' if r['worst_fits'] else 'no'}"
                )
                print(
                    f"{world:>6} {ep:>4} {r['dp']:>5} {pp:>3}  {r['at_rest_gib']:>8.1f} "
                    f"{r['uniform_peak_gib']:>9.1f} {r['worst_peak_gib']:>10.1f} {fits:>10}  "
                    f"{r['uniform_all_to_all_gib']:>9.1f} {r['worst_all_to_all_gib']:>9.1f}  "
                    f"{r['seconds']:>6.2f}"
                )
    total = time.perf_counter() - start
    print(f"{len(results)} configurations in {total:.1f} s (model build included)")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        record = {**provenance(), "build_s": build_s, "total_s": total, "results": results}
        args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
