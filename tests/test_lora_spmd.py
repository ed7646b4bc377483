"""LoRA on a sharded base, on real gloo ranks against one device (tier 2): meshtrain's Llama and
a Hugging Face Llama with adapters under data × tensor parallelism, FSDP × tensor parallelism and
a pipeline, through ``assert_equivalent``; and a plain PyTorch LoRA loop written the ordinary way
on one process against the same loop under a plan."""

from __future__ import annotations

import lora_models
import pytest
import zoo

import meshtrain as mt
from meshtrain.models import default_rules
from meshtrain.testing import assert_equivalent

pytestmark = pytest.mark.spmd

TP = {"dp": 2, "tp": 2}
PP = {"pp": 2, "dp": 2}

CASES = {
    "llama-dp-tp": (lora_models.llama_lora, TP, {"rules": default_rules(), "zero": 0}),
    "llama-fsdp-tp": (lora_models.llama_lora, TP, {"rules": default_rules(), "zero": 3}),
    "llama-pp-fsdp": (lora_models.llama_lora, PP, {"rules": default_rules(tp=None), "zero": 2,
                                                   "pipeline": mt.Pipeline(microbatches=2)}),
    "hf-llama-fsdp-tp": (lora_models.hf_llama_lora, TP,
                         {"rules": zoo.hf_rules(zoo.llama()), "zero": 3}),
    "hf-llama-pp-fsdp": (lora_models.hf_llama_lora, PP, {"rules": zoo.REPLICATED, "zero": 3,
                                                         "pipeline": mt.Pipeline(microbatches=2)}),
}  # fmt: skip


@pytest.mark.parametrize("name", list(CASES))
def test_lora_trains_like_one_device(name: str) -> None:
    factory, mesh, options = CASES[name]
    batches = zoo.token_batches if factory is lora_models.hf_llama_lora else None
    report = assert_equivalent(factory, mesh, options, batches=batches, steps=2, optimizer="adamw")
    assert report.passed
    held = {c.fqn for c in report.comparisons if c.quantity == "param"}
    assert held and all("lora_" in fqn for fqn in held), sorted(held)[:5]
