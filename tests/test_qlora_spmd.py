"""QLoRA on real gloo ranks: adapters over NF4 base weights (torchao), sharded by FSDP2, train
like the same NF4 model on one device. Skipped without torchao."""

from __future__ import annotations

import lora_models
import pytest

import meshtrain as mt
from meshtrain.models import default_rules
from meshtrain.testing import assert_equivalent

pytest.importorskip("torchao")
pytestmark = pytest.mark.spmd


def test_qlora_under_fsdp_trains_like_one_device() -> None:
    report = assert_equivalent(
        lora_models.qlora_llama,
        {"dp": 2},
        {"rules": default_rules(tp=None), "zero": 3},
        steps=2,
        optimizer="adamw",
    )
    assert report.passed
    held = {c.fqn for c in report.comparisons if c.quantity == "param"}
    assert held == {
        f"layers.{i}.attention.{w}.{a}"
        for i in range(2)
        for w in ("wq", "wo")
        for a in ("lora_A", "lora_B")
    }


def test_qlora_under_hsdp_trains_like_one_device() -> None:
    """NF4 shards over the inner data axis, replicated over the outer one (HSDP): the frozen base
    is gathered within a replica group and only the adapters' gradients cross replicas."""
    report = assert_equivalent(
        lora_models.qlora_llama,
        {"rep": 2, "dp": 2},
        {"rules": default_rules(tp=None, fsdp=("rep", "dp")), "zero": 3},
        steps=2,
        optimizer="adamw",
    )
    assert report.passed
    assert {c.fqn for c in report.comparisons if c.quantity == "param"} == {
        f"layers.{i}.attention.{w}.{a}"
        for i in range(2)
        for w in ("wq", "wo")
        for a in ("lora_A", "lora_B")
    }


def test_qlora_refuses_tensor_parallel_bases() -> None:
    model = lora_models.qlora_llama()
    mesh = mt.make_mesh(dp=1, tp=2, world_size=2, abstract=True)
    with pytest.raises(mt.PlanError, match=r"'layers\.0\.attention\.wq\.weight' is an NF4"):
        mt.plan(model, mesh, default_rules())
