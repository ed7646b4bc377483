"""Optimizer-state offload on real gloo ranks: a plan with ``offload_optimizer`` (states kept on
the host, one parameter's update at a time) trains like one device with an ordinary optimizer,
for a full model under FSDP and for LoRA under FSDP × TP; and an AdamW with β2 = 0.95 and its
own eps as a recipe builds it."""

from __future__ import annotations

import lora_models
import pytest

from meshtrain.models import LlamaConfig, build_llama, default_rules
from meshtrain.recipes.recipe import OptimizerBuilder
from meshtrain.testing import assert_equivalent

pytestmark = pytest.mark.spmd

ADAMW_095 = OptimizerBuilder("adamw", 1e-3, betas=(0.9, 0.95), eps=1e-6)


def debug_llama():  # type: ignore[no-untyped-def]
    return build_llama(LlamaConfig.debug())


def test_optimizer_state_offload_trains_like_one_device() -> None:
    report = assert_equivalent(
        debug_llama,
        {"dp": 2},
        {"rules": default_rules(tp=None), "zero": 3, "offload_optimizer": True},
        steps=2,
        optimizer=ADAMW_095,
    )
    assert report.passed
    assert {"param", "grad"} <= {c.quantity for c in report.comparisons}


def test_optimizer_state_offload_with_lora_under_fsdp_and_tp() -> None:
    report = assert_equivalent(
        lora_models.llama_lora,
        {"dp": 2, "tp": 2},
        {"rules": default_rules(), "zero": 3, "offload_optimizer": True},
        steps=2,
        optimizer=ADAMW_095,
    )
    assert report.passed
