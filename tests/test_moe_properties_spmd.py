"""Property: every drawn mixture-of-experts plan on 4 gloo ranks — expert, tensor (with or
without sequence parallelism and the split inside the experts), context and data parallelism
mixed, any ZeRO stage, checkpointing mode and gradient reduction — trains like one device
within its contract, or is refused while planning.

As the Llama's plan property, CI draws new examples every day (the seed is the date, printed
with a failure; ``MESHTRAIN_PLAN_SEED`` replays it) and ``HYPOTHESIS_PROFILE=long`` draws more.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import event, given, seed, settings
from hypothesis import strategies as st
from moe_models import meshtrain_moe, token_batches

import meshtrain as mt
from meshtrain.errors import MeshError, PlanError, RuleError, SpecError
from meshtrain.models.moe import default_rules as moe_rules
from meshtrain.testing import assert_equivalent

pytestmark = pytest.mark.spmd

LONG = not settings.default.derandomize
SEED = int(os.environ.get("MESHTRAIN_PLAN_SEED", datetime.date.today().toordinal()))
PLANNING_ERRORS = (PlanError, SpecError, RuleError, MeshError)
MESHES = (
    {"ep": 4},
    {"dp": 2, "ep": 2},
    {"ep": 2, "tp": 2},
    {"dp": 2, "tp": 2},
    {"cp": 2, "ep": 2},
    {"cp": 2, "tp": 2},
    {"dp": 2, "cp": 2},
    {"tp": 4},
)


@dataclass(frozen=True)
class MoECase:
    """One drawn plan of meshtrain's tiny MoE."""

    mesh: tuple[tuple[str, int], ...]
    sequence_parallel: bool
    expert_tp: bool
    options: tuple[tuple[str, Any], ...]

    def rules(self) -> mt.Rules:
        axes = dict(self.mesh)
        tp = "tp" if "tp" in axes else None
        rules = moe_rules(
            tp=tp,
            fsdp="dp" if "dp" in axes else (),
            ep="ep" if "ep" in axes else None,
            sequence_parallel=self.sequence_parallel and tp is not None,
            expert_tp=self.expert_tp,
        )
        if "cp" not in axes:
            return rules
        return mt.Rules(rules.patterns, logical=(("seq", "cp"), *rules.logical), fsdp=rules.fsdp)


@st.composite
def moe_cases(draw: st.DrawFn) -> MoECase:
    mesh = draw(st.sampled_from(MESHES))
    options = {
        "zero": draw(st.sampled_from([1, 2, 3])),
        "activation_checkpointing": draw(st.sampled_from(["none", "full", "selective"])),
        "grad_reduction": draw(st.sampled_from(["mean", "sum"])),
    }
    return MoECase(
        tuple(mesh.items()), draw(st.booleans()), draw(st.booleans()), tuple(options.items())
    )


def _check(case: MoECase) -> bool:
    """True when the plan trained within its contract; False when it was refused."""
    try:
        report = assert_equivalent(
            meshtrain_moe,
            dict(case.mesh),
            {"rules": case.rules(), "seq_len": 8, **dict(case.options)},
            batches=token_batches,
            steps=2,
            optimizer="adamw",
        )
    except PLANNING_ERRORS:
        return False
    assert report.passed
    return True


def test_every_drawn_moe_plan_trains_like_one_device_or_is_refused() -> None:
    @seed(SEED)
    @settings(max_examples=60 if LONG else 8, derandomize=False, database=None, deadline=None)
    @given(moe_cases())
    def property_(case: MoECase) -> None:
        event("trained" if _check(case) else "refused while planning")

    try:
        property_()
    except Exception as error:
        raise AssertionError(f"drawn with MESHTRAIN_PLAN_SEED={SEED}: {error}") from error
