"""Hypothesis-generated rule sets, valid and invalid: planning either succeeds with a consistent
plan or raises a MeshtrainError that names the culprit — never another exception."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

import meshtrain as mt
from meshtrain import MeshtrainError
from meshtrain.models import LlamaConfig, build_llama
from meshtrain.plan import Plan
from meshtrain.testing.strategies import RuleSet, rule_sets

MODEL = build_llama(LlamaConfig.debug(), device="meta")
FQNS = [fqn for fqn, _ in MODEL.named_parameters()]


def plan_or_error(rule_set: RuleSet, dp: int, tp: int, zero: int) -> Plan | MeshtrainError:
    mesh = mt.make_mesh(dp=dp, tp=tp, world_size=dp * tp, abstract=True)
    try:
        return mt.plan(MODEL, mesh, rule_set.rules, zero=zero)
    except MeshtrainError as err:
        return err


@given(
    rule_sets(MODEL, invalid=True),
    st.sampled_from([(1, 2), (2, 2), (2, 1), (4, 2)]),
    st.sampled_from([0, 1, 2, 3]),
)
def test_any_rule_set_plans_or_names_the_culprit(
    rule_set: RuleSet, sizes: tuple[int, int], zero: int
) -> None:
    dp, tp = sizes
    result = plan_or_error(rule_set, dp, tp, zero)
    bad = [(fqn, choice) for fqn, choice in rule_set.choices if choice.startswith("bad_")]
    if isinstance(result, MeshtrainError):
        text = str(result)
        assert any(fqn in text for fqn in FQNS) or "axis '" in text, text
        return
    # A plan was made: no misconfiguration may slip through, except a norm "sharded" over a
    # size-1 axis (a no-op layout, valid).
    assert all(choice == "bad_norm_sharded" and tp == 1 for _, choice in bad), bad
    assert Plan.from_json(result.to_json()) == result
    specs = result.specs
    for fqn, choice in rule_set.choices:
        if choice == "colwise" and tp > 1:
            assert "tp" in specs[f"{fqn}.weight"].axes
    assert result.sequence_parallel == (rule_set.sequence_parallel and tp > 1)
    assert result.explain()


@given(rule_sets(MODEL), st.sampled_from([0, 3]))
def test_valid_rule_sets_fail_only_for_documented_reasons(rule_set: RuleSet, zero: int) -> None:
    result = plan_or_error(rule_set, 2, 2, zero)
    if isinstance(result, MeshtrainError):
        reasons = (
            "has no sequence-parallel form",  # SP needs every TP Linear paired
            "needs a column-wise output head",  # SP must gather the sequence before the loss
            "is neither a data axis",  # nothing is sharded over tp
            "is replicated: ranks would hold",  # a pair's Linear left replicated beside it
            "row-wise tensor-parallel partner",  # a row-wise Linear that cannot consume the output
            "which takes the local output of column-wise",  # abstract run: a row-wise input whole
            "mixes tensors sharded over tensor-parallel axis",  # abstract run: shard + whole
        )
        assert any(reason in str(result) for reason in reasons), str(result)
