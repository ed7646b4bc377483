"""Interleaved A/B step timing across ranks, shared by the side-by-side benchmarks.

Two (or more) training steps run alternately (A B, then B A, ...), each timed between barriers so
drift and noise hit all alike; a step ends when its slowest rank does. Ratios are reported from
the medians and round by round (median and quartiles), whose spread is the machine's noise.

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
    """Seconds of one step on this rank, between barriers."""
    dist.barrier()
    start = time.perf_counter()
    step(index)
    dist.barrier()
    return time.perf_counter() - start


def interleaved(steps: dict[str, Step], rounds: int, *, warmup: int = 2) -> dict[str, list[float]]:
    """Runs on every rank: ``warmup`` untimed steps of each, then ``rounds`` rounds in which every
    step runs once, the order rotating each round. Step indices continue across the warm-up."""
    for step in steps.values():  # lazy initialisation and first-step allocations
        for index in range(warmup):
            step(index)
    names = list(steps)
    times: dict[str, list[float]] = {name: [] for name in names}
    for index in range(rounds):
        shift = index % len(names)
        for name in names[shift:] + names[:shift]:
            times[name].append(timed(steps[name], warmup + index))
    return times


def summarise(
    per_rank: Sequence[dict[str, list[float]]], name: str, baseline: str
) -> dict[str, Any]:
    """Median step time of each (slowest rank per round), their ratio ``name / baseline`` and the
    round-by-round ratios' median and quartiles."""
    rounds = len(per_rank[0][name])
    steps = {
        key: [max(rank[key][i] for rank in per_rank) for i in range(rounds)] for key in per_rank[0]
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
