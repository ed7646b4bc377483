"""What the ZeRO stage decides is decided once (``fsdp_decisions``) and carried on the plan's FSDP
units; tensor-parallel styles are a closed type with one cost and one lowering per style."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import meshtrain as mt
from meshtrain import PlanError
from meshtrain.lower.tensor.parallel import LOWERINGS
from meshtrain.models import LlamaConfig, build_llama, default_rules
from meshtrain.plan import FSDPDecisions, FSDPUnit, ModuleStyle, Plan, TPStyle, fsdp_decisions
from meshtrain.plan.tensor.cost import TP_COSTS

PACKAGE = Path(__file__).resolve().parents[1] / "meshtrain"


def _plan(zero: int = 3, **options: object) -> Plan:
    model = build_llama(LlamaConfig.debug(), device="meta")
    mesh = mt.make_mesh(dp=2, tp=2, world_size=4, abstract=True)
    return mt.plan(model, mesh, default_rules(), zero=zero, **options)


@pytest.mark.parametrize(
    ("zero", "wrapper", "sharded", "reshards", "sync", "every", "kept"),
    [
        (0, "replicate", False, False, "all_reduce", False, False),
        (1, "fully_shard", True, False, "reduce_scatter", False, True),
        (2, "fully_shard", True, False, "reduce_scatter", True, False),
        (3, "fully_shard", True, True, "reduce_scatter", True, False),
    ],
)
def test_each_zero_stage_decides_its_table_row(
    zero: int, wrapper: str, sharded: bool, reshards: bool, sync: str, every: bool, kept: bool
) -> None:
    block = fsdp_decisions(zero)
    assert (block.wrapper, block.grad_sync, block.sync_every_microbatch) == (wrapper, sync, every)
    assert block.shard_params == block.shard_grads == block.shard_optimizer_states == sharded
    assert block.reshard_after_forward == reshards
    assert block.gathered_across_microbatches == kept
    assert fsdp_decisions(zero, root=True).reshard_after_forward is False  # backward needs it


def test_offload_without_a_sharded_stage_and_a_stage_out_of_range_are_refused() -> None:
    assert fsdp_decisions(3, offload=True).offload
    with pytest.raises(PlanError, match="offload=True needs sharded data parallelism"):
        fsdp_decisions(0, offload=True)
    with pytest.raises(PlanError, match="out of range"):
        fsdp_decisions(4)


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_the_plan_records_the_decisions_on_its_units(zero: int) -> None:
    plan = _plan(zero, offload=zero > 0)
    *blocks, root = plan.units
    assert root.fqn == "" and root.decisions == fsdp_decisions(zero, root=True, offload=zero > 0)
    assert all(u.decisions == fsdp_decisions(zero, offload=zero > 0) for u in blocks)
    assert Plan.from_json(plan.to_json()) == plan
    units = json.loads(plan.to_json())["units"]
    assert units[0]["decisions"]["reshard_after_forward"] == (zero == 3)
    text = plan.explain()
    assert f"decided for <root>: {root.decisions.describe()}" in text or (
        zero != 3 and f"decided for every unit: {root.decisions.describe()}" in text
    )


def test_a_plan_json_written_before_units_carried_decisions_still_loads() -> None:
    plan = _plan(1)
    data = json.loads(plan.to_json())
    for unit in data["units"]:
        del unit["decisions"]
    assert Plan.from_json(json.dumps(data)) == plan  # decided again from its options


def test_a_plan_json_with_unknown_decisions_or_styles_fails_clearly() -> None:
    data = json.loads(_plan().to_json())
    data["units"][0]["decisions"]["reshard_sometimes"] = True
    with pytest.raises(PlanError, match="plan the model again"):
        Plan.from_json(json.dumps(data))
    data = json.loads(_plan().to_json())
    data["styles"][0]["style"] = "diagonal"
    with pytest.raises(PlanError, match="'diagonal', which is not one of"):
        Plan.from_json(json.dumps(data))


def test_styles_are_a_closed_type_that_reads_and_prints_as_before() -> None:
    style = ModuleStyle("up", "Linear", "colwise", "tp")  # type: ignore[arg-type]
    assert style.style is TPStyle.COLWISE and style.style == "colwise"
    assert f"{style.style}" == str(style.style) == "colwise" and repr(style.style) == "'colwise'"
    assert json.dumps({"style": style.style}) == '{"style": "colwise"}'
    assert FSDPUnit("layers.0", ()).decisions == fsdp_decisions(3)  # the default stage's


def test_every_style_has_one_cost_and_one_lowering() -> None:
    assert set(TP_COSTS) == set(TPStyle)
    assert set(LOWERINGS) == set(TPStyle)


def test_the_zero_stage_is_compared_only_where_it_is_decided() -> None:
    """Comparisons of ``zero`` (``==``, ``>=``, …) appear in ``fsdp_decisions`` only (and in the textbook ZeRO
    formula of the sizing report, which is the paper's, not the plan's)."""
    allowed = {PACKAGE / "plan" / "decisions.py"}
    pattern = re.compile(r"\bzero\s*(==|!=|>=|<=|>|<)")
    found = []
    for path in PACKAGE.rglob("*.py"):
        if path in allowed:
            continue
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            code = line.split("#")[0]
            if pattern.search(code) and not _textbook(path, number):
                found.append(f"{path.relative_to(PACKAGE)}:{number}: {line.strip()}")
    assert not found, "\n".join(found)


def _textbook(path: Path, number: int) -> bool:
    """The line lies in ``footprint.textbook_bytes`` (the ZeRO paper's formula)."""
    if path.name != "footprint.py":
        return False
    lines = path.read_text().splitlines()[:number]
    last_def = next(line for line in reversed(lines) if line.startswith("def "))
    return last_def.startswith("def textbook_bytes(")


def test_decisions_round_trip_through_their_json() -> None:
    for zero in (0, 1, 2, 3):
        decisions = fsdp_decisions(zero, root=zero == 2)
        assert FSDPDecisions.from_json(decisions.to_json()) == decisions
