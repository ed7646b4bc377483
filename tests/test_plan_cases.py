"""Fast tier (in-process, no ranks): every drawn plan either plans, with a contract, an
explanation and a JSON round trip, or raises a ``MeshtrainError`` — never anything else."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

import meshtrain as mt
from meshtrain.plan.ir import Plan
from meshtrain.testing.contract import contract_for
from meshtrain.testing.strategies import PlanCase, plan_cases

WORLDS = st.sampled_from([1, 2, 4, 8])


@given(WORLDS.flatmap(lambda world: plan_cases(world, compile_backends=("aot_eager", "inductor"))))
def test_a_drawn_plan_is_valid_or_a_meshtrain_error(case: PlanCase) -> None:
    world = math.prod(size for _, size in case.mesh_shape)
    mesh = mt.make_mesh(dict(case.mesh_shape), world_size=world, abstract=True)
    model = case.model_fn()
    try:
        plan = mt.plan(model, mesh, **case.plan_options())  # type: ignore[arg-type]
    except mt.MeshtrainError as error:
        assert str(error), case  # a message that says what to change
        return
    contract = contract_for(plan)
    assert contract.level in ("bitwise", "reduction-order", "approximate")
    assert (contract.tolerance == 0.0) == (contract.level == "bitwise")
    assert plan.explain()
    assert Plan.from_json(plan.to_json()) == plan


@given(plan_cases(4))
def test_drawn_batches_split_evenly(case: PlanCase) -> None:
    (_, mesh_shape, options), kwargs = case.harness_args()
    data = dict(mesh_shape).get("dp", 1)
    pipeline = options.get("pipeline")
    micro = pipeline.microbatches if pipeline is not None else options.get("microbatches", 1)  # type: ignore[attr-defined]
    inputs, targets = kwargs["batches"](0)  # type: ignore[operator]
    assert inputs.shape == targets.shape and inputs.shape[0] % (data * micro) == 0
