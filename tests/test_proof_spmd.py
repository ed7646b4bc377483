"""Plans the proof used to refuse, or accepted and then crashed on, train like one device on 4
real gloo ranks (issue 43): a CNN with GroupNorm and a tensor-parallel head (its probe from the
batch), a tied head through ``F.linear`` and a functional conv on a child's weight (replicated
parameters read outside their module), an in-place residual into a row-wise output, a running
mean averaged over the data ranks, torchtitan's rotary reshape under tensor and sequence
parallelism, RoBERTa's classifier under sequence parallelism and Qwen3's per-head norms under
sequence parallelism. Each is ``assert_equivalent`` against one device, 2 AdamW steps."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import proof_models as pm
import pytest
import zoo

import meshtrain as mt
from meshtrain import P, Rules
from meshtrain.testing import assert_equivalent

pytestmark = pytest.mark.spmd

DP_TP = {"dp": 2, "tp": 2}
SP_ROTARY = Rules(pm.ROTARY_RULES.patterns, logical=[("seq", "tp")], fsdp="dp")
SP_ROBERTA = Rules(pm.ROBERTA_RULES.patterns, logical=[("seq", "tp")], fsdp="dp")

CASES: dict[str, tuple[Callable[[], Any], dict[str, int], dict[str, Any], Callable[[int], Any]]] = {
    "cnn-groupnorm-tp-head": (pm.group_norm_cnn, DP_TP, {"rules": pm.CNN_RULES}, pm.image_batches),
    "tied-head-f-linear": (pm.tied_mlp, DP_TP, {"rules": pm.MLP_RULES}, pm.token_batches),
    "functional-conv-on-a-child": (
        pm.conv_reader,
        DP_TP,
        {"rules": pm.MLP_RULES},
        pm.token_batches,
    ),
    "in-place-into-row-wise": (pm.inplace_mlp, DP_TP, {"rules": pm.MLP_RULES}, pm.token_batches),
    "running-mean-averaged": (
        pm.running_mean_mlp,
        DP_TP,
        {"rules": pm.MLP_RULES, "batch_buffers": "average"},
        pm.token_batches,
    ),
    "running-mean-averaged-dp4": (
        pm.running_mean_mlp,
        {"dp": 4},
        {"rules": Rules({".*": P()}, fsdp="dp"), "batch_buffers": "average"},
        pm.token_batches,
    ),
    "rotary-reshape-tp": (pm.rotary_lm, DP_TP, {"rules": pm.ROTARY_RULES}, pm.token_batches),
    "rotary-reshape-sp": (pm.rotary_lm, DP_TP, {"rules": SP_ROTARY}, pm.token_batches),
    "roberta-classifier-sp": (
        pm.roberta_classifier,
        DP_TP,
        {"rules": SP_ROBERTA},
        pm.label_batches,
    ),
    "qwen3-sp-per-head-norms": (
        zoo.qwen3,
        DP_TP,
        {"rules": Rules.from_hf(zoo.qwen3(), fsdp="dp", sequence_parallel=True)},
        zoo.token_batches,
    ),
}


@pytest.mark.filterwarnings("ignore:.*FSDP2-wrapped module .* returned a view tensor")
@pytest.mark.parametrize("name", list(CASES))
def test_trains_like_one_device(name: str) -> None:
    model_fn, axes, options, batches = CASES[name]
    report = assert_equivalent(model_fn, axes, options, batches=batches, steps=2, optimizer="adamw")
    assert report.passed
    if "running-mean" in name:
        assert any(c.quantity == "buffer" and c.fqn == "running_mean" for c in report.comparisons)


@pytest.mark.filterwarnings("ignore:.*FSDP2-wrapped module .* returned a view tensor")
def test_a_running_mean_planned_as_a_note_still_trains_differently() -> None:
    """Why the buffer is refused: with the refusal kept as a note, the plan runs and the
    harness reports the buffer alone (every gradient matches)."""
    from meshtrain.plan.proof.run import refusals_as_notes

    with refusals_as_notes(), pytest.raises(mt.EquivalenceError) as caught:
        assert_equivalent(
            pm.running_mean_mlp,
            {"dp": 2},
            Rules({".*": P()}, fsdp="dp"),
            batches=pm.token_batches,
            steps=1,
            rank_context=refusals_as_notes,
        )
    report = caught.value.report  # type: ignore[attr-defined]
    assert {(c.quantity, c.fqn) for c in report.failures} == {("buffer", "running_mean")}
