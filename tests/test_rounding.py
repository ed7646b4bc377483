"""The low-precision contract's measured part (tier 1, in-process): the bound's arithmetic, the
fp32 twin's measurement of a low-precision computation's own error, and the report that tells a
bug from rounding."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from meshtrain.testing.contract import ROUNDING_FACTOR, Contract, Reordering
from meshtrain.testing.harness import Comparison, EquivalenceReport
from meshtrain.testing.rounding import ExactTwin, rounding_bound

U_BF16 = 2.0**-8


@given(
    tolerance=st.floats(0, 1e-4),
    scale=st.floats(0, 1e3),
    own=st.floats(0, 1e2),
    unit=st.sampled_from([2.0**-8, 2.0**-11]),
)
def test_bound_is_the_reordering_part_plus_a_multiple_of_the_larger_rounding(
    tolerance: float, scale: float, own: float, unit: float
) -> None:
    bound = rounding_bound(tolerance, unit, scale, own)
    assert bound == pytest.approx(tolerance * scale + ROUNDING_FACTOR * max(own, unit * scale))
    # never below one rounding of the value itself, nor below the measured error's multiple
    assert bound >= ROUNDING_FACTOR * unit * scale and bound >= ROUNDING_FACTOR * own


def test_fp32_keeps_the_reduction_order_bound() -> None:
    assert rounding_bound(1e-6, 0.0, 3.0, 5.0) == pytest.approx(3e-6)


def _loss(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(output.float(), targets, reduction="sum")


def test_twin_measures_a_bf16_computations_own_error_per_tensor() -> None:
    torch.manual_seed(0)
    low = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    twin = ExactTwin(nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)))
    twin.take(dict(low.named_parameters()), {})
    x, y = torch.randn(64, 16), torch.randint(0, 4, (64,))
    with torch.autocast("cpu", torch.bfloat16):
        loss = _loss(low(x), y) / 64
    loss.backward()
    own = twin.measure(float(loss.detach()), dict(low.named_parameters()), x, y, _loss)
    exact = dict(twin.model.named_parameters())
    for fqn, param in low.named_parameters():
        # the measured error is the largest |bf16 − fp32| of the gradient, a few units of u
        assert param.grad is not None and exact[fqn].grad is not None
        difference = float((param.grad - exact[fqn].grad).abs().max())
        assert own.grads[fqn] == pytest.approx(difference)
        assert 0 < own.grads[fqn] < 16 * U_BF16 * float(exact[fqn].grad.abs().max())
    exact_loss = float(_loss(twin.model(x), y).detach()) / 64
    assert own.loss == pytest.approx(abs(float(loss.detach()) - exact_loss))


def test_twin_takes_parameters_and_buffers_by_name() -> None:
    source, twin = nn.BatchNorm1d(3), ExactTwin(nn.BatchNorm1d(3))
    with torch.no_grad():
        source.weight.fill_(2.0)
        source.running_mean.fill_(0.5)
    twin.take(dict(source.named_parameters()), dict(source.named_buffers()))
    assert torch.equal(twin.model.weight, source.weight)
    assert torch.equal(twin.model.running_mean, source.running_mean)
    assert twin.buffer_error("running_mean", torch.full((3,), 0.75)) == 0.25
    assert twin.buffer_error("num_batches_tracked", torch.tensor(1)) == 0.0


def _report(comparison: Comparison) -> EquivalenceReport:
    contract = Contract(
        "approximate",
        (Reordering("data-parallel gradient and loss sum", 4),),
        depth=4,
        precision="bf16",
        rounding_sites=(Reordering("each rank's gradient", 4),),
    )
    plan_json = '{"mesh": {"axes": [["dp", 4]]}}'
    return EquivalenceReport(contract, (comparison,), ((1.0, 1.0),), 0, plan_json, "replay")


def test_the_report_tells_a_bug_from_rounding() -> None:
    bug = Comparison(1, "grad", "head.weight", 0.5, 0.5, 120.0, own_error=1e-3)
    text = _report(bug).format()
    assert "one device's own bf16 error on it (against fp32): 1.00e-03" in text
    assert "500.00× that" in text and "a bug, not rounding" in text
    assert "own err" in text and "× own" in text  # the table's columns
    rounding = Comparison(1, "grad", "head.weight", 5e-3, 5e-3, 1.2, own_error=1e-3)
    assert "rounding heavier than the contract allows" in _report(rounding).format()


def test_own_ratio() -> None:
    assert Comparison(1, "grad", "w", 0.0, 0.0, 0.0, own_error=0.0).own_ratio == 0.0
    assert Comparison(1, "grad", "w", 1.0, 1.0, 2.0, own_error=0.0).own_ratio == math.inf
    assert Comparison(1, "grad", "w", 1.0, 1.0, 2.0).own_ratio is None


def test_recorded_choices_and_their_near_ties() -> None:
    from meshtrain.testing.rounding import RecordTopk, near_ties

    scores = torch.tensor([[0.30, 0.29, 0.41], [0.7, 0.2, 0.1]])
    with RecordTopk() as low:
        torch.topk(scores, 2, dim=-1)
        scores.topk(1)
        torch.topk(scores, 1, dim=0)  # not over the last dim: not a choice per row
    assert [(c.k, tuple(c.values.shape)) for c in low.calls] == [(2, (2, 3)), (1, (2, 3))]
    exact = [type(c)(c.values + 1e-3, c.k) for c in low.calls]  # fp32 values, 1e-3 apart
    # k-th and next 0.01 apart: beyond 4 × a rounding of 1e-3 (or of u × 0.30)
    assert near_ties(low.calls, exact, U_BF16) == {}
    close = [type(c)(c.values + 5e-3, c.k) for c in low.calls]
    assert near_ties(low.calls, close, U_BF16)[0].tolist() == [True, False]
    assert near_ties(low.calls, close[:1], U_BF16) == {}  # another sequence of calls: none


def test_flipped_choice_takes_the_next_candidate_and_keeps_gradients() -> None:
    from meshtrain.testing.rounding import FlipTopk

    scores = torch.tensor([[0.30, 0.29, 0.41], [0.7, 0.2, 0.1]], requires_grad=True)
    with FlipTopk({0: torch.tensor([True, False])}):
        values, indices = torch.topk(scores, 2, dim=-1)
        other = torch.topk(scores, 1, dim=-1)  # call 1: not flipped
    assert indices.tolist() == [[2, 1], [0, 1]]  # row 0: 0.29 (index 1) in place of 0.30
    assert values.detach().flatten().tolist() == pytest.approx([0.41, 0.29, 0.7, 0.2])
    assert other.indices.tolist() == [[2], [0]]
    values.sum().backward()
    assert scores.grad is not None
    assert scores.grad.tolist() == [[0.0, 1.0, 1.0], [1.0, 1.0, 0.0]]
