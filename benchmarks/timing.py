"""Interleaved A/B step timing across ranks, shared by the side-by-side benchmarks.

Two (or more) training steps run alternately (A B, then B A, ...), each timed between barriers so
drift and noise hit all alike. Two clocks per step: wall time, where a step ends when its slowest
rank does, and CPU time summed over the ranks — the work a step costs. With more ranks than cores
the wall clock also measures the scheduler and other tenants (a rank blocked in a gloo collective
sleeps: its CPU clock stands still), so the CPU ratio is the steadier measure of what one step
does more than the other. Ratios come from the medians and round by round (the median with a 95%
confidence interval, and quartiles), whose spread is the machine's noise.

Example::

    times = interleaved({"meshtrain": step_a, "hand": step_b}, rounds=20)  # on every rank
    summary = summarise(per_rank_times, "meshtrain", "hand")               # on the driver
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist

Step = Callable[[int], Any]


def timed(step: Step, index: int) -> float:
    """Wall seconds of one step on this rank, between barriers."""
    return _clocked(step, index)[0]


def _clocked(step: Step, index: int) -> tuple[float, float]:
    """Wall seconds of one step between barriers, and this process's CPU seconds (all its
    threads) for the step itself — the closing barrier's wait is not the step's work."""
    dist.barrier()
    wall, cpu = time.perf_counter(), time.process_time()
    step(index)
    cpu = time.process_time() - cpu
    dist.barrier()
    return time.perf_counter() - wall, cpu


def interleaved(
    steps: dict[str, Step], rounds: int, *, warmup: int = 2
) -> dict[str, dict[str, list[float]]]:
    """Runs on every rank: ``warmup`` untimed steps of each, then ``rounds`` rounds in which every
    step runs once, the order rotating each round. Step indices continue across the warm-up.
    Returns this rank's ``{"wall": {name: seconds per round}, "cpu": {...}}``."""
    for step in steps.values():  # lazy initialisation and first-step allocations
        for index in range(warmup):
            step(index)
    names = list(steps)
    clocks: dict[str, dict[str, list[float]]] = {
        "wall": {name: [] for name in names},
        "cpu": {name: [] for name in names},
    }
    for index in range(rounds):
        shift = index % len(names)
        for name in names[shift:] + names[:shift]:
            wall, cpu = _clocked(steps[name], warmup + index)
            clocks["wall"][name].append(wall)
            clocks["cpu"][name].append(cpu)
    return clocks


def summarise(
    per_rank: Sequence[dict[str, dict[str, list[float]]]], name: str, baseline: str
) -> dict[str, Any]:
    """Per clock: the median step of each (wall: the slowest rank's per round; CPU: the ranks'
    sum per round), their ratio ``name / baseline``, and the round-by-round ratios' median with
    its 95% confidence interval and quartiles. The wall clock's figures sit at the top level."""
    wall = _ratios([rank["wall"] for rank in per_rank], name, baseline, max)
    return {**wall, "cpu": _ratios([rank["cpu"] for rank in per_rank], name, baseline, sum)}


def _ratios(
    per_rank: Sequence[dict[str, list[float]]],
    name: str,
    baseline: str,
    across_ranks: Callable[[list[float]], float],
) -> dict[str, Any]:
    rounds = len(per_rank[0][name])
    steps = {
        key: [across_ranks([rank[key][i] for rank in per_rank]) for i in range(rounds)]
        for key in per_rank[0]
    }
    medians = {key: statistics.median(values) for key, values in steps.items()}
    paired = sorted(a / b for a, b in zip(steps[name], steps[baseline]))
    quartiles = statistics.quantiles(paired, n=4)
    low, high = median_interval(paired)
    return {
        "median_step_s": medians,
        "ratio": medians[name] / medians[baseline],
        "paired_ratio": {
            "median": statistics.median(paired),
            "q1": quartiles[0],
            "q3": quartiles[2],
            "ci95": [low, high],
        },
    }


def median_interval(values: Sequence[float], confidence: float = 0.95) -> tuple[float, float]:
    """A distribution-free confidence interval for the median: the order statistics ``k`` and
    ``n + 1 - k`` with the largest ``k`` for which ``P(Binomial(n, 1/2) < k) ≤ (1 - confidence)
    / 2`` (each value falls on either side of the median with probability 1/2). With too few
    values for that, the whole range.

    Example:
        >>> median_interval([float(v) for v in range(1, 41)])
        (14.0, 27.0)
    """
    ordered = sorted(values)
    n = len(ordered)
    tail = (1 - confidence) / 2
    below, k = 0.0, 0  # below = P(Binomial(n, 1/2) < k + 1) as k grows
    while k < n // 2:
        below += math.comb(n, k) / 2**n
        if below > tail:
            break
        k += 1
    k = max(k, 1)
    return ordered[k - 1], ordered[n - k]


def round_by_round(paired: dict[str, Any]) -> str:
    """The round-by-round ratios as the tables print them.

    Example:
        >>> round_by_round({"median": 1.0, "ci95": [0.98, 1.01], "q1": 0.95, "q3": 1.04})
        'round by round: median 1.000 (95% CI 0.980–1.010), quartiles 0.950–1.040'
    """
    low, high = paired["ci95"]
    return (
        f"round by round: median {paired['median']:.3f} (95% CI {low:.3f}–{high:.3f}), "
        f"quartiles {paired['q1']:.3f}–{paired['q3']:.3f}"
    )


def cpu_line(summary: dict[str, Any], labels: dict[str, str]) -> str:
    """The CPU clock's figures as the tables print them; ``labels`` names each timed step, the
    ratio's numerator first.

    Example:
        >>> cpu = {"median_step_s": {"a": 2.0, "b": 1.0}, "ratio": 2.0,
        ...        "paired_ratio": {"median": 2.0, "ci95": [1.9, 2.1], "q1": 1.95, "q3": 2.05}}
        >>> cpu_line({"cpu": cpu}, {"a": "A", "b": "B"})[:58]
        'CPU per step, all ranks: A 2000.0 ms, B 1000.0 ms, ratio 2'
    """
    cpu = summary["cpu"]
    steps = ", ".join(
        f"{label} {cpu['median_step_s'][key] * 1e3:.1f} ms" for key, label in labels.items()
    )
    return (
        f"CPU per step, all ranks: {steps}, ratio {cpu['ratio']:.3f} "
        f"({round_by_round(cpu['paired_ratio'])})"
    )
