"""Property: every drawn plan trains like one device within its contract, or is refused while
planning (tier 2: gloo ranks). And a failing property shrinks to the smallest readable plan.

CI runs a fixed, derandomised set of examples; ``HYPOTHESIS_PROFILE=long`` (``nox -s
tests_long``) draws ten times as many at random.
"""

from __future__ import annotations

import pytest
from hypothesis import find, given, settings
from test_planted_faults_spmd import gradients_averaged_twice

from meshtrain.errors import MeshError, PlanError, RuleError, SpecError
from meshtrain.testing import assert_equivalent
from meshtrain.testing.strategies import PlanCase, plan_cases

pytestmark = pytest.mark.spmd

LONG = not settings.default.derandomize
PLANNING_ERRORS = (PlanError, SpecError, RuleError, MeshError)  # raised before any rank starts


def _check(case: PlanCase, **kwargs: object) -> bool:
    """True when the plan was built and trained within its contract; False when refused."""
    (model_fn, mesh, options), harness_kwargs = case.harness_args()
    try:
        report = assert_equivalent(model_fn, mesh, options, steps=2, optimizer="adamw",
                                   **harness_kwargs, **kwargs)  # type: ignore[arg-type]  # fmt: skip
    except PLANNING_ERRORS:
        return False
    assert report.passed
    return True


# Drawn row-wise heads return local views from the FSDP root (see test_equivalence_spmd).
@pytest.mark.filterwarnings("ignore:.*FSDP2-wrapped module .* returned a view tensor")
@pytest.mark.parametrize("world", [2, 4])
def test_every_drawn_plan_trains_like_one_device_or_is_refused(world: int) -> None:
    @settings(max_examples=60 if LONG else 6)
    @given(plan_cases(world))
    def property_(case: PlanCase) -> None:
        _check(case)

    property_()


def test_a_failing_property_shrinks_to_the_smallest_plan() -> None:
    """With gradients averaged twice planted, the smallest failing plan is the plainest
    FSDP plan on two ranks: one layer, everything replicated, no options."""

    def fails(case: PlanCase) -> bool:
        try:
            _check(case, rank_context=gradients_averaged_twice)
        except AssertionError:
            return True
        except Exception as error:  # the harness raises EquivalenceError
            return type(error).__name__ == "EquivalenceError"
        return False

    smallest = find(
        plan_cases(2, precisions=("fp32",)),
        fails,
        settings=settings(max_examples=20, derandomize=True, database=None),
    )
    assert repr(smallest) == (
        "PlanCase(mesh={dp: 2, tp: 1}, DebugLlama(n_layers=1), RuleSet(sp=False, all replicated), "
        "batch=2×8)"
    ), smallest
