"""``assert_equivalent`` across every parallelism, on meshtrain's Llama and a user's own model
(tier 2: gloo ranks). Each case asserts the contract level the plan states and that every
comparison is within it; bitwise cases must be exactly equal."""

from __future__ import annotations

import functools

import pytest
import torch
from helpers import ResidualMLPClassifier, classifier_batches

import meshtrain as mt
from meshtrain import P, Rules
from meshtrain.models import default_rules
from meshtrain.testing import assert_equivalent
from meshtrain.testing.strategies import DebugLlama

pytestmark = pytest.mark.spmd

CLASSIFIER_RULES = Rules(
    {
        r"blocks\.\d+\.1\.(weight|bias)": P("tp"),  # column-wise
        r"blocks\.\d+\.3\.weight": P(None, "tp"),  # row-wise
        r".*": P(),
    },
    fsdp="dp",
)
GPIPE_ONE = mt.Pipeline(schedule="GPipe", microbatches=1)
ONE_F_ONE_B = mt.Pipeline(schedule="1F1B", microbatches=2)
CASES = {
    # name: (model, mesh, plan options, optimizer, contract level)
    "one-device-checkpointing-aot-eager": (
        DebugLlama(2),
        {"dp": 1, "tp": 1},
        {"activation_checkpointing": "full", "compile": {"backend": "aot_eager"}},
        "adamw",
        "bitwise",
    ),
    "pipeline-one-microbatch": (
        DebugLlama(4),
        {"pp": 2, "dp": 1, "tp": 1},
        {"pipeline": GPIPE_ONE},
        "sgd",
        "bitwise",
    ),
    "fsdp-tp-adamw": (DebugLlama(2), {"dp": 2, "tp": 2}, {}, "adamw", "reduction-order"),
    "tp-sp-adam": (
        DebugLlama(2),
        {"dp": 1, "tp": 2},
        {"rules": default_rules(sequence_parallel=True)},
        "adam",
        "reduction-order",
    ),
    "hsdp-zero2-microbatches": (
        DebugLlama(2),
        {"rep": 2, "dp": 2, "tp": 1},
        {"rules": default_rules(fsdp=("rep", "dp")), "zero": 2, "microbatches": 2},
        "sgd",
        "reduction-order",
    ),
    "pp-fsdp-1f1b": (
        DebugLlama(4),
        {"pp": 2, "dp": 2, "tp": 1},
        {"zero": 2, "pipeline": ONE_F_ONE_B},
        "adamw",
        "reduction-order",
    ),
    "fsdp-inductor-selective": (
        DebugLlama(2),
        {"dp": 2, "tp": 1},
        {"compile": True, "activation_checkpointing": "selective"},
        "adamw",
        "reduction-order",
    ),
    "bf16-fsdp": (DebugLlama(2), {"dp": 2, "tp": 1}, {"precision": "bf16"}, "adamw", "approximate"),
    "fp16-fsdp-tp": (
        DebugLlama(2),
        {"dp": 2, "tp": 2},
        {"precision": "fp16"},
        "sgd",
        "approximate",
    ),
}


# inductor's generated code still calls torch.jit.script_method
@pytest.mark.filterwarnings("ignore:.*torch.jit.script_method. is deprecated:DeprecationWarning")
@pytest.mark.parametrize("name", list(CASES))
def test_plan_matches_one_device_within_its_contract(name: str) -> None:
    model_fn, mesh, options, optimizer, level = CASES[name]
    options = {"rules": default_rules(), **options}
    report = assert_equivalent(model_fn, mesh, options, optimizer=optimizer, steps=3)
    assert report.contract.level == level, report.format()
    assert report.passed
    quantities = {c.quantity for c in report.comparisons}
    assert {"loss", "grad norm", "grad", "param"} <= quantities, quantities
    if optimizer != "sgd":
        assert {"exp_avg", "exp_avg_sq"} <= quantities, quantities
    if level == "bitwise":
        assert all(c.abs_error == 0.0 for c in report.comparisons), report.format()
    else:
        assert any(c.abs_error > 0.0 for c in report.comparisons), "nothing was reordered?"


@pytest.mark.filterwarnings("ignore:.*FSDP2-wrapped module .* returned a view tensor")
def test_a_users_own_model_with_its_own_batches() -> None:
    report = assert_equivalent(
        ResidualMLPClassifier,
        {"dp": 2, "tp": 2},
        {"rules": CLASSIFIER_RULES, "zero": 3},
        batches=classifier_batches,
        optimizer="adamw",
        max_norm=0.05,
    )
    assert report.contract.level == "reduction-order"
    assert report.clipped_steps == 3, report.format()
    assert report.worst("grad") > 0.0


def test_other_optimizers_are_checked_through_their_gradients() -> None:
    report = assert_equivalent(
        DebugLlama(2),
        {"dp": 2, "tp": 1},
        default_rules(),
        optimizer=functools.partial(torch.optim.Adagrad, lr=0.01),
    )
    assert "no update model for Adagrad" in report.format()
    # buffers (the rotary frequencies) are compared whatever the optimizer
    assert {c.quantity for c in report.comparisons} == {"loss", "grad", "grad norm", "buffer"}


def test_a_bad_plan_fails_in_this_process_before_any_rank_starts() -> None:
    with pytest.raises(mt.MeshtrainError, match="nope"):
        assert_equivalent(DebugLlama(2), {"dp": 2}, Rules({r".*": P("nope")}, fsdp="dp"))
    with pytest.raises(mt.PlanError, match="does not split into 2 data-parallel ranks"):
        assert_equivalent(
            DebugLlama(2),
            {"dp": 2, "tp": 1},
            default_rules(),
            batches=[(torch.zeros(3, 8, dtype=torch.long),) * 2],
        )
