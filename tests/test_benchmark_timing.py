"""The statistics the benchmarks report (``benchmarks/timing.py``): ratios of interleaved step
times and a distribution-free confidence interval for the median round-by-round ratio."""

from __future__ import annotations

import doctest
import math
import statistics
import sys
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import timing


def _below(n: int, k: int) -> float:
    """P(Binomial(n, 1/2) < k)."""
    return sum(math.comb(n, i) for i in range(k)) / 2**n


@given(st.integers(1, 200))
def test_median_interval_is_the_narrowest_order_statistic_pair_with_95_percent_coverage(
    n: int,
) -> None:
    low, high = timing.median_interval([float(v) for v in range(1, n + 1)])
    k = int(low)
    assert high == n + 1 - k  # symmetric order statistics
    if _below(n, 1) > 0.025:  # too few rounds for 95%: the whole range
        assert (low, high) == (1, n)
    else:
        assert _below(n, k) <= 0.025 < _below(n, k + 1)  # coverage ≥ 95%, and no narrower pair
        assert 1 - 2 * _below(n, k) >= 0.95


@given(st.lists(st.floats(0.5, 2.0), min_size=1, max_size=60))
def test_median_interval_holds_the_sample_median(values: list[float]) -> None:
    low, high = timing.median_interval(values)
    assert min(values) <= low <= statistics.median(values) <= high <= max(values)


def test_summarise_takes_the_slowest_rank_in_wall_time_and_the_sum_of_ranks_in_cpu_time() -> None:
    ranks = [
        {"a": [1.0, 2.0, 3.0], "b": [1.0, 1.0, 1.0]},
        {"a": [1.5, 1.0, 3.0], "b": [2.0, 1.0, 1.0]},
    ]
    summary = timing.summarise([{"wall": r, "cpu": r} for r in ranks], "a", "b")
    assert summary["median_step_s"] == {"a": 2.0, "b": 1.0}  # rounds: a 1.5 2 3, b 2 1 1
    assert summary["ratio"] == 2.0
    assert summary["paired_ratio"]["median"] == 2.0  # 0.75, 2, 3
    cpu = summary["cpu"]  # rounds: a 2.5 3 6, b 3 2 2
    assert cpu["median_step_s"] == {"a": 3.0, "b": 2.0}
    assert cpu["ratio"] == 1.5
    assert cpu["paired_ratio"]["median"] == 1.5  # 2.5/3, 3/2, 6/2


def test_docstring_examples() -> None:
    assert doctest.testmod(timing).failed == 0
