"""meshtrain's plans against the same parallelism written by hand, in one run on the same ranks.

For FSDP (ZeRO-3 over dp 4), FSDP + tensor parallel (dp 2 × tp 2), PP + FSDP (pp 2 × dp 2,
1F1B over 4 micro-batches) and FSDP with each block compiled (inductor, full graph, as
torchtitan's ``apply_compile`` does it: before ``fully_shard``), every rank builds the same Llama
twice: one copy goes through ``mt.apply(mt.plan(...), model)``, the other through the calls
torchtitan's parallelize functions make (``parallelize_module`` with column-/row-wise styles,
``fully_shard`` per block then the root with FSDP's gradient division off, ``PipelineStage`` +
``Schedule1F1B``) and trains the way torchtitan's trainer does (loss summed over tokens and
divided by the step's global token count, all-reduced before a pipeline's schedule). Both train
with AdamW on the same batches; their first two global losses must agree (else the script exits
with an error: the two would not be doing the same work); then their steps are interleaved (A B,
then B A, ...) and each is timed between barriers, so drift hits both alike.

Reported per configuration: median step time of each and their ratio (meshtrain / hand-written;
target ≤ 1.02) with the round-by-round ratios' median, its 95% confidence interval and their
quartiles (their spread is this machine's noise: 4 ranks share 2 cores), and the collectives one
step issues — count and payload bytes per kind and mesh axis, meshtrain's and the hand-written
code's as counted on the ranks, against the plan's prediction (target: equal).

Usage::

    python benchmarks/overhead.py --rounds 40 --out benchmarks/results/overhead.json
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from provenance import provenance
from timing import cpu_line, interleaved, round_by_round, summarise
from torch import nn

import meshtrain as mt
from meshtrain import P, Rules
from meshtrain.lower import device_mesh
from meshtrain.models import LlamaConfig, build_llama, default_rules
from meshtrain.testing.comms import CollectiveCounter
from meshtrain.testing.runner import get_pool
from meshtrain.train import Batch, forward_backward

CONFIG = LlamaConfig.preset(
    "debug", dim=256, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=2048, max_seq_len=128
)
BATCH, SEQ, MICRO = 8, 128, 4  # sequences per data-parallel rank per step, tokens, pp micro-batches
LOSS_STEPS = 2  # first steps whose global losses both must agree on (untimed: the warm-up)
LOSS_AGREEMENT = 1e-6  # relative: fp32 reduction order, 2 steps of AdamW from the same weights
SETUPS = {
    "fsdp": (("dp", 4),),
    "fsdp_tp": (("dp", 2), ("tp", 2)),
    "pp_fsdp": (("pp", 2), ("dp", 2)),
    "fsdp_compiled": (("dp", 4),),
}
COMPILED = {"fsdp_compiled"}  # each block compiled (inductor, full graph) before FSDP2 wraps it


def _batch(step: int, dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + dp_rank)
    tokens = torch.randint(0, CONFIG.vocab_size, (BATCH, SEQ + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


# What a setup's step returns: this rank's share of the step's global loss, and the group whose
# sum makes it global (None: the step returned the global loss itself).
Built = tuple[Callable[[int], torch.Tensor], Any]


def _meshtrain(setup: str, mesh: mt.Mesh) -> Built:
    model = build_llama(CONFIG, seed=0)
    tp = "tp" in mesh.axis_names
    rules = default_rules() if tp else Rules({r".*": P()}, fsdp="dp")
    pipeline = mt.Pipeline(schedule="1F1B", microbatches=MICRO) if setup == "pp_fsdp" else None
    compile_options = {"backend": "inductor", "fullgraph": True} if setup in COMPILED else False
    plan = mt.plan(
        model,
        mesh,
        rules,
        zero=3,
        pipeline=pipeline,
        global_batch=BATCH * mesh.size("dp"),
        seq_len=SEQ,
        compile=compile_options,
    )
    applied = mt.apply(plan, model)
    optimizer = torch.optim.AdamW(applied.parameters(), lr=1e-4)
    dp_rank = mesh.coordinates(dist.get_rank())["dp"]
    global_tokens = BATCH * SEQ * mesh.size("dp")

    def step(index: int) -> torch.Tensor:
        inputs, targets = _batch(index, dp_rank)
        if pipeline is not None:
            # the train step's own accounting: the step's tokens and its global loss
            loss = torch.tensor(forward_backward(plan, applied, Batch(inputs, targets))[0])
        else:
            with mt.micro_batch(plan, applied, last=True), mt.loss_parallel(plan):
                logits = applied(inputs)
                loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
                (loss := loss / global_tokens).backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    return step, None if pipeline is not None else device_mesh(mesh).get_group("dp")


def _fsdp_by_hand(module: nn.Module, mesh: Any, *, reshard_after_forward: bool) -> None:
    """``fully_shard`` as torchtitan applies it: its gradients summed, not averaged (its trainer
    divides the loss by the global token count), with a plain sum on the wire (gloo has no
    ``PREMUL_SUM``)."""
    from torch.distributed.fsdp import fully_shard

    fully_shard(module, mesh=mesh, reshard_after_forward=reshard_after_forward)
    module.set_gradient_divide_factor(1.0)  # type: ignore[operator]
    module.set_force_sum_reduction_for_comms(True)  # type: ignore[operator]


def _by_hand(setup: str, mesh: mt.Mesh) -> Built:
    """The same parallelism with PyTorch's calls, the way torchtitan's parallelize_llama makes
    them, trained the way its trainer does (loss summed over tokens, divided by the global count)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        loss_parallel,
        parallelize_module,
    )

    model = build_llama(CONFIG, seed=0)
    bound = device_mesh(mesh)
    dp_mesh = bound["dp"]
    dp_rank = mesh.coordinates(dist.get_rank())["dp"]
    if setup == "fsdp_tp":
        tp_mesh = bound["tp"]
        parallelize_module(
            model,
            tp_mesh,
            {
                "tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
                "output": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
            },
        )
        for block in model.layers.values():
            parallelize_module(
                block,
                tp_mesh,
                {
                    "attention.wq": ColwiseParallel(),
                    "attention.wk": ColwiseParallel(),
                    "attention.wv": ColwiseParallel(),
                    "attention.wo": RowwiseParallel(),
                    "feed_forward.w1": ColwiseParallel(),
                    "feed_forward.w2": RowwiseParallel(),
                    "feed_forward.w3": ColwiseParallel(),
                },
            )
    if setup == "pp_fsdp":
        return _pipeline_by_hand(model, mesh, dp_rank)
    for block in model.layers.values():
        if setup in COMPILED:  # as torchtitan's apply_compile: per block, before fully_shard
            block.compile(backend="inductor", fullgraph=True)
        _fsdp_by_hand(block, dp_mesh, reshard_after_forward=True)
    _fsdp_by_hand(model, dp_mesh, reshard_after_forward=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    context = loss_parallel if setup == "fsdp_tp" else contextlib.nullcontext
    global_tokens = BATCH * SEQ * mesh.size("dp")

    def step(index: int) -> torch.Tensor:
        inputs, targets = _batch(index, dp_rank)
        with context():
            logits = model(inputs)
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
            (loss := loss / global_tokens).backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    return step, dp_mesh.get_group()


def _pipeline_by_hand(model: nn.Module, mesh: mt.Mesh, dp_rank: int) -> Built:
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    bound = device_mesh(mesh)
    pp_rank = mesh.coordinates(dist.get_rank())["pp"]
    stage = copy.deepcopy(model)
    keep = {"0", "1"} if pp_rank == 0 else {"2", "3"}  # meshtrain's balanced split of 4 blocks
    for name in list(stage.layers.keys()):
        if name not in keep:
            del stage.layers[name]
    if pp_rank == 0:
        stage.norm, stage.output = None, None
    else:
        stage.tok_embeddings = None
    for block in stage.layers.values():
        _fsdp_by_hand(block, bound["dp"], reshard_after_forward=True)
    _fsdp_by_hand(stage, bound["dp"], reshard_after_forward=False)
    global_tokens = torch.ones(())

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        summed = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
        return summed / global_tokens

    pipeline_stage = PipelineStage(
        stage, pp_rank, 2, torch.device("cpu"), group=bound.get_group("pp")
    )
    schedule = Schedule1F1B(pipeline_stage, MICRO, loss_fn=loss_fn, scale_grads=False)
    optimizer = torch.optim.AdamW(stage.parameters(), lr=1e-4)

    def step(index: int) -> torch.Tensor:
        nonlocal global_tokens
        inputs, targets = _batch(index, dp_rank)
        # as torchtitan's trainer: the step's tokens summed over the data-parallel ranks first
        local = torch.tensor(float(targets.numel()))
        global_tokens = funcol.wait_tensor(funcol.all_reduce(local, "sum", bound.get_group("dp")))
        losses: list[torch.Tensor] = []
        if pp_rank == 0:
            schedule.step(inputs)
        else:
            schedule.step(target=targets, losses=losses)
        optimizer.step()
        optimizer.zero_grad()
        return torch.stack(losses).sum() if losses else torch.zeros(())

    return step, dist.group.WORLD  # the last stages' shares, over pp and dp


def _global(loss: torch.Tensor, group: Any) -> float:
    """The step's global loss from this rank's share (``group`` None: it is global already)."""
    value = loss.detach()
    value = value.full_tensor() if hasattr(value, "full_tensor") else value
    if group is not None:
        value = value.clone()
        dist.all_reduce(value, group=group)
    return float(value)


def _counted(
    step: Callable[[int], None], mesh: mt.Mesh, index: int, *, eager: bool
) -> dict[str, list[int]]:
    """One step's collectives. A dispatch mode cannot run inside compiled code, so a compiled
    step is counted with its compiled blocks run eagerly (``force_eager``): FSDP2's collectives
    are issued by its hooks around the blocks, outside the compiled regions, either way."""
    counter = CollectiveCounter(mesh)
    stance = torch.compiler.set_stance("force_eager") if eager else contextlib.nullcontext()
    with stance, counter:
        step(index)
    return {
        f"{kind}@{axis}": [n, counter.bytes[(kind, axis)]]
        for (kind, axis), n in sorted(counter.counts.items())
    }


def measure(setup: str, rounds: int) -> dict[str, Any]:
    """Runs on every rank: build both, compare their first steps' global losses (untimed: the
    warm-up), time interleaved steps, count one step each."""
    mesh = mt.make_mesh(dict(SETUPS[setup]))
    built = {"meshtrain": _meshtrain(setup, mesh), "hand": _by_hand(setup, mesh)}
    losses = {
        name: [_global(step(index), group) for index in range(LOSS_STEPS)]
        for name, (step, group) in built.items()
    }
    steps = {name: step for name, (step, _) in built.items()}
    times = interleaved(steps, rounds, warmup=0)
    counts = {
        name: _counted(step, mesh, LOSS_STEPS + rounds, eager=setup in COMPILED)
        for name, step in steps.items()
    }
    return {
        "times": times,
        "counts": counts,
        "losses": losses,
        "coordinates": mesh.coordinates(dist.get_rank()),
    }


def predicted(setup: str) -> tuple[dict[str, list[int]], int]:
    """The plan's collectives per step on the busiest rank (abstract mesh: no processes), and
    that rank's pipeline coordinate (0 without a pipeline)."""
    axes = dict(SETUPS[setup])
    mesh = mt.make_mesh(axes, world_size=4, abstract=True)
    model = build_llama(CONFIG, device="meta")
    rules = default_rules() if "tp" in axes else Rules({r".*": P()}, fsdp="dp")
    pipeline = mt.Pipeline(schedule="1F1B", microbatches=MICRO) if setup == "pp_fsdp" else None
    plan = mt.plan(
        model, mesh, rules, zero=3, pipeline=pipeline, global_batch=BATCH * axes["dp"], seq_len=SEQ
    )
    rows = {f"{kind}@{axis}": list(row) for (kind, axis), row in plan.collective_totals().items()}
    busiest = next(
        (
            int(m.group(1))
            for note in plan.notes
            if (m := re.search(r"busiest pipeline rank's \(pp rank (\d+)\)", note))
        ),
        0,
    )
    return dict(sorted(rows.items())), busiest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--setups", nargs="*", default=list(SETUPS))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    results: dict[str, Any] = {}
    for setup in args.setups:
        per_rank = get_pool(4).run(measure, setup, args.rounds, _timeout_s=1800)
        plan_rows, pp_rank = predicted(setup)
        busiest = next(r for r in per_rank if r["coordinates"].get("pp", 0) == pp_rank)["counts"]
        losses = per_rank[0]["losses"]
        results[setup] = {
            "mesh": dict(SETUPS[setup]),
            "losses": losses,
            "worst_loss_rel_diff": max(
                abs(a - b) / abs(b) for a, b in zip(losses["meshtrain"], losses["hand"])
            ),
            **summarise([r["times"] for r in per_rank], "meshtrain", "hand"),
            "collectives": {
                "meshtrain": busiest["meshtrain"],
                "hand": busiest["hand"],
                "plan": plan_rows,
            },
        }
        print(_table(setup, results[setup]), flush=True)
    record = {
        **provenance(),
        "ranks": "4 CPU gloo ranks",
        "model": {
            "dim": CONFIG.dim,
            "layers": CONFIG.n_layers,
            "vocab": CONFIG.vocab_size,
            "batch_per_dp_rank": BATCH,
            "seq_len": SEQ,
        },
        "rounds": args.rounds,
        "results": results,
    }
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=1) + "\n")
    apart = {
        name: r["worst_loss_rel_diff"]
        for name, r in results.items()
        if r["worst_loss_rel_diff"] > LOSS_AGREEMENT
    }
    if apart:  # then the two do not compute the same thing, and their times do not compare
        raise SystemExit(f"losses disagree beyond {LOSS_AGREEMENT:g} (relative): {apart}")


def _table(setup: str, result: dict[str, Any]) -> str:
    m = result["median_step_s"]
    lines = [
        f"{setup} {result['mesh']}: meshtrain {m['meshtrain'] * 1e3:.1f} ms, by hand "
        f"{m['hand'] * 1e3:.1f} ms, ratio {result['ratio']:.3f} "
        f"({round_by_round(result['paired_ratio'])})",
        "  " + cpu_line(result, {"meshtrain": "meshtrain", "hand": "by hand"}),
        f"  first losses: meshtrain {result['losses']['meshtrain']}, by hand "
        f"{result['losses']['hand']} (worst relative difference "
        f"{result['worst_loss_rel_diff']:.1e})",
        f"  {'collective@axis':<22} {'plan':>16} {'meshtrain':>16} {'by hand':>16}  (count/bytes)",
    ]
    c = result["collectives"]
    for key in sorted(set(c["plan"]) | set(c["meshtrain"]) | set(c["hand"])):
        cells = [c[name].get(key) for name in ("plan", "meshtrain", "hand")]
        shown = [f"{v[0]}/{v[1]:,}" if v else "-" for v in cells]
        lines.append(f"  {key:<22} {shown[0]:>16} {shown[1]:>16} {shown[2]:>16}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
