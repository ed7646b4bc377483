"""Property: every drawn plan trains like one device within its contract, or is refused while
planning (tier 2: gloo ranks). And a failing property shrinks to the smallest readable plan.

CI draws a new set of examples every day (the seed is the date, printed with any failure, and
``MESHTRAIN_PLAN_SEED`` replays one), so runs over time reach plans a fixed set never would;
``HYPOTHESIS_PROFILE=long`` (``nox -s tests_long``) draws six times as many. Plans the long
profile found failing are kept as explicit cases below.
"""

from __future__ import annotations

import datetime
import os

import pytest
from hypothesis import find, given, seed, settings
from test_planted_faults_spmd import gradients_averaged_twice

from meshtrain import P, Pipeline, Rules
from meshtrain.errors import MeshError, PlanError, RuleError, SpecError
from meshtrain.models import default_rules
from meshtrain.testing import assert_equivalent
from meshtrain.testing.strategies import DebugLlama, PlanCase, RuleSet, plan_cases

pytestmark = pytest.mark.spmd

LONG = not settings.default.derandomize
#: today's draw (a failure prints it; set MESHTRAIN_PLAN_SEED to replay that day's examples)
SEED = int(os.environ.get("MESHTRAIN_PLAN_SEED", datetime.date.today().toordinal()))
PLANNING_ERRORS = (PlanError, SpecError, RuleError, MeshError)  # raised before any rank starts


def _check(case: PlanCase, **kwargs: object) -> bool:
    """True when the plan was built and trained within its contract; False when refused."""
    (model_fn, mesh, options), harness_kwargs = case.harness_args()
    try:
        report = assert_equivalent(
            model_fn, mesh, options, steps=2, optimizer="adamw", **harness_kwargs, **kwargs
        )  # type: ignore[arg-type]
    except PLANNING_ERRORS:
        return False
    assert report.passed
    return True


# Drawn row-wise heads return local views from the FSDP root (see test_equivalence_spmd).
@pytest.mark.filterwarnings("ignore:.*FSDP2-wrapped module .* returned a view tensor")
@pytest.mark.parametrize("world", [2, 4])
def test_every_drawn_plan_trains_like_one_device_or_is_refused(world: int) -> None:
    @seed(SEED + world)
    @settings(max_examples=60 if LONG else 10, derandomize=False, database=None)
    @given(plan_cases(world))
    def property_(case: PlanCase) -> None:
        _check(case)

    try:
        property_()
    except Exception as error:
        raise AssertionError(f"drawn with MESHTRAIN_PLAN_SEED={SEED}: {error}") from error


LLAMA_RULES = RuleSet(default_rules(), (), False, label="llama default rules")
Q_AND_O_ONLY = RuleSet(
    Rules(
        {
            r"layers\.0\.attention\.wq\.weight": P("tp"),
            r"layers\.0\.attention\.wo\.weight": P(None, "tp"),
            r".*": P(),
        },
        fsdp="dp",
    ),
    (("layers.0.attention.wq", "colwise"), ("layers.0.attention.wo", "rowwise")),
    False,
)
#: plans the long profile found failing, and what must happen to each now
FOUND = {
    "q-sharded-kv-whole": (
        PlanCase((("dp", 2), ("tp", 2)), DebugLlama(1), Q_AND_O_ONLY, (), 4, 8),
        "refused",
    ),
    "zero-bubble-selective-checkpointing": (
        PlanCase(
            (("pp", 2), ("dp", 2)),
            DebugLlama(4),
            LLAMA_RULES,
            (
                ("pipeline", Pipeline("pp", "InterleavedZeroBubble", 4, 2)),
                ("activation_checkpointing", "selective"),
            ),
            8,
            8,
        ),
        "refused",
    ),
    "compiled-vocab-parallel-batch-of-one": (
        PlanCase(
            (("dp", 1), ("tp", 2)),
            DebugLlama(4),
            LLAMA_RULES,
            (
                ("zero", 0),
                ("activation_checkpointing", "selective"),
                ("compile", {"backend": "aot_eager"}),
            ),
            1,
            8,
        ),
        "trains",
    ),
}


@pytest.mark.parametrize("name", list(FOUND))
def test_plans_the_long_profile_found(name: str) -> None:
    case, outcome = FOUND[name]
    assert _check(case) == (outcome == "trains"), case


def test_a_failing_property_shrinks_to_the_smallest_plan() -> None:
    """With gradients averaged twice planted (FSDP averaging although the loss is divided by
    the global token count), the smallest failing plan is the plainest FSDP plan on two ranks
    that sums gradients: one layer, everything replicated, no other option."""

    def fails(case: PlanCase) -> bool:
        try:
            _check(case, rank_context=gradients_averaged_twice)
        except AssertionError:
            return True
        except Exception as error:  # the harness raises EquivalenceError
            return type(error).__name__ == "EquivalenceError"
        return False

    smallest = find(
        plan_cases(2, precisions=("fp32",), grad_reductions=("sum",)),
        fails,
        settings=settings(max_examples=20, derandomize=True, database=None),
    )
    assert repr(smallest) == (
        "PlanCase(mesh={dp: 2, tp: 1}, DebugLlama(n_layers=1), RuleSet(sp=False, all replicated), "
        "grad_reduction='sum', batch=2×8)"
    ), smallest
