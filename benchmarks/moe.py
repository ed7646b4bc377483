"""Step time of the routed experts in one process: meshtrain's GroupedExperts with one
``torch._grouped_mm`` per projection, the same module's per-expert loop, and transformers'
own ``Qwen3MoeExperts`` (its eager loop over experts, and its ``grouped_mm`` implementation), on
the same weights and the same routed tokens.

A step is forward and backward of the experts alone (tokens 4096, dim 256, 16 experts of width
256, top-2 from a random softmax router, fp32): ``(out · probe).sum().backward()`` with gradients
for the tokens and both weights. Before timing, every implementation's output and gradients are
checked against meshtrain's grouped kernel (bitwise between meshtrain's two kernels; within
``1e-5 · max`` for transformers'). Steps are interleaved (A B C D, then B C D A, ...) so drift and
noise hit all alike; two clocks per step, wall time and the process's CPU time (the steadier
one on a shared machine); ratios come from the medians and round by round (median, 95%
confidence interval, quartiles), in one run on one machine.

Usage::

    python benchmarks/moe.py --out benchmarks/results/moe.json
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from provenance import provenance
from timing import median_interval, round_by_round
from transformers import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

from meshtrain.models import GroupedExperts

logging.getLogger("transformers").setLevel(logging.ERROR)

SHAPE = {"tokens": 4096, "dim": 256, "experts": 16, "top_k": 2, "inter": 256}
BASELINE = "hf_eager"
LABELS = {
    "grouped_mm": "meshtrain grouped_mm",
    "loop": "meshtrain loop",
    "hf_eager": "transformers eager loop",
    "hf_grouped_mm": "transformers grouped_mm",
}
Step = Callable[[], tuple[torch.Tensor, ...]]


def _inputs() -> dict[str, torch.Tensor]:
    """Tokens, a random softmax router's top-k choice and weights, expert weights, a probe."""
    gen = torch.Generator().manual_seed(0)
    tokens, dim, experts, top_k, inter = (
        SHAPE[k] for k in ("tokens", "dim", "experts", "top_k", "inter")
    )
    hidden = torch.randn(tokens, dim, generator=gen)
    scores = (hidden @ torch.randn(dim, experts, generator=gen) * 0.1).softmax(-1)
    weights, index = scores.topk(top_k, dim=-1)
    return {
        "hidden": hidden,
        "index": index,
        "weights": weights / weights.sum(-1, keepdim=True),
        "gate_up_proj": torch.randn(experts, 2 * inter, dim, generator=gen) * dim**-0.5,
        "down_proj": torch.randn(experts, dim, inter, generator=gen) * inter**-0.5,
        "probe": torch.randn(tokens, dim, generator=gen),
    }


def _modules(inputs: dict[str, torch.Tensor]) -> dict[str, torch.nn.Module]:
    experts, dim, inter = SHAPE["experts"], SHAPE["dim"], SHAPE["inter"]
    modules: dict[str, torch.nn.Module] = {
        kernel: GroupedExperts(experts, dim, inter, kernel=kernel)
        for kernel in ("grouped_mm", "loop")
    }
    for name, implementation in (("hf_eager", "eager"), ("hf_grouped_mm", "grouped_mm")):
        config = Qwen3MoeConfig(
            hidden_size=dim,
            moe_intermediate_size=inter,
            num_experts=experts,
            num_experts_per_tok=SHAPE["top_k"],
            experts_implementation=implementation,
        )
        modules[name] = Qwen3MoeExperts(config)
    with torch.no_grad():
        for module in modules.values():
            module.gate_up_proj.copy_(inputs["gate_up_proj"])
            module.down_proj.copy_(inputs["down_proj"])
    return modules


def _step(module: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> Step:
    def step() -> tuple[torch.Tensor, ...]:
        module.zero_grad(set_to_none=True)
        hidden = inputs["hidden"].clone().requires_grad_()
        out = module(hidden, inputs["index"], inputs["weights"])
        (out * inputs["probe"]).sum().backward()
        return out.detach(), hidden.grad, module.gate_up_proj.grad, module.down_proj.grad

    return step


def _check_same(results: dict[str, tuple[torch.Tensor, ...]]) -> dict[str, float]:
    """Each implementation's output and gradients against meshtrain's grouped kernel; returns
    the largest difference relative to the largest magnitude, per implementation."""
    reference = results["grouped_mm"]
    worst: dict[str, float] = {}
    for name, values in results.items():
        worst[name] = max(
            float((a - b).abs().max()) / float(b.abs().max()) for a, b in zip(values, reference)
        )
        bound = 0.0 if name == "loop" else 1e-5
        if worst[name] > bound:
            raise SystemExit(
                f"{LABELS[name]} differs from meshtrain grouped_mm by {worst[name]:.2e}"
            )
    return worst


def _interleaved(
    steps: dict[str, Step], rounds: int, warmup: int
) -> dict[str, dict[str, list[float]]]:
    """``{"wall": {name: seconds per round}, "cpu": {...}}``: wall time, and this process's CPU
    time (all threads), the steadier clock on a shared machine (a thread waiting for a core
    adds wall time, not CPU time)."""
    for step in steps.values():
        for _ in range(warmup):
            step()
    names = list(steps)
    clocks: dict[str, dict[str, list[float]]] = {
        "wall": {n: [] for n in names},
        "cpu": {n: [] for n in names},
    }
    for index in range(rounds):
        shift = index % len(names)
        for name in names[shift:] + names[:shift]:
            wall, cpu = time.perf_counter(), time.process_time()
            steps[name]()
            clocks["cpu"][name].append(time.process_time() - cpu)
            clocks["wall"][name].append(time.perf_counter() - wall)
    return clocks


def _ratio(times: dict[str, list[float]], name: str, baseline: str) -> dict[str, Any]:
    paired = sorted(a / b for a, b in zip(times[name], times[baseline]))
    quartiles = statistics.quantiles(paired, n=4)
    low, high = median_interval(paired)
    medians = {key: statistics.median(times[key]) for key in (name, baseline)}
    return {
        "ratio": medians[name] / medians[baseline],
        "paired_ratio": {
            "median": statistics.median(paired),
            "q1": quartiles[0],
            "q3": quartiles[2],
            "ci95": [low, high],
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/moe.json"))
    args = parser.parse_args()
    inputs = _inputs()
    steps = {name: _step(module, inputs) for name, module in _modules(inputs).items()}
    differences = _check_same({name: step() for name, step in steps.items()})
    clocks = _interleaved(steps, args.rounds, args.warmup)
    counts = torch.bincount(inputs["index"].flatten(), minlength=SHAPE["experts"])
    result: dict[str, Any] = {
        **provenance(),
        "shape": SHAPE,
        "tokens_per_expert": counts.tolist(),
        "rounds": args.rounds,
        "max_relative_difference": differences,
    }
    for clock, times in clocks.items():
        result[clock] = {
            "median_step_s": {name: statistics.median(values) for name, values in times.items()},
            "vs_" + BASELINE: {n: _ratio(times, n, BASELINE) for n in times if n != BASELINE},
            "grouped_mm_vs_loop": _ratio(times, "grouped_mm", "loop"),
        }
    print(_table(result))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"\nwrote {args.out}")


def _table(result: dict[str, Any]) -> str:
    shape, cpu, wall = result["shape"], result["cpu"], result["wall"]
    lines = [
        f"Routed experts, forward + backward, fp32, {result['machine']}, torch {result['torch']}:",
        f"tokens {shape['tokens']}, dim {shape['dim']}, {shape['experts']} experts of width "
        f"{shape['inter']}, top-{shape['top_k']}; {result['rounds']} interleaved rounds",
        "",
        f"| implementation | CPU ms/step | vs {LABELS[BASELINE]} (CPU) | wall ms/step "
        "| vs (wall) | max rel. difference |",
        "|---|---|---|---|---|---|",
    ]
    for name, label in LABELS.items():
        figures = [
            f"{clock['median_step_s'][name] * 1e3:.1f} | "
            f"{clock['vs_' + BASELINE].get(name, {'ratio': 1.0})['ratio']:.3f}"
            for clock in (cpu, wall)
        ]
        difference = result["max_relative_difference"][name]
        lines.append(f"| {label} | {figures[0]} | {figures[1]} | {difference:.1e} |")
    grouped = cpu["grouped_mm_vs_loop"]
    lines += [
        "",
        "CPU clock, round by round:",
        f"meshtrain grouped_mm / loop: {grouped['ratio']:.3f} "
        f"({round_by_round(grouped['paired_ratio'])})",
    ]
    for name, ratio in cpu["vs_" + BASELINE].items():
        lines.append(
            f"{LABELS[name]} / {LABELS[BASELINE]}: {round_by_round(ratio['paired_ratio'])}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
