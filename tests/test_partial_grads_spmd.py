"""Replicated parameters that compute on tensor-parallel shards train like one device (tier 2):
Qwen3's per-head ``q_norm``/``k_norm`` under ``Rules.from_hf`` — the abstract run records their
partial gradients and the lowering all-reduces them — and the same plan with that reduction
dropped is caught by the harness (a planted fault)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from unittest import mock

import pytest
import zoo
from transformers import Qwen3Config, Qwen3ForCausalLM

import meshtrain as mt
from meshtrain.spec.rules import Rules
from meshtrain.testing import assert_equivalent
from meshtrain.testing.runner import get_pool

pytestmark = pytest.mark.spmd


def qwen3() -> Qwen3ForCausalLM:
    """Per-head q/k norms between the column- and row-wise projections."""
    config = Qwen3Config(
        vocab_size=zoo.VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
        use_cache=False,
    )
    return Qwen3ForCausalLM(config)


@pytest.mark.parametrize(
    ("mesh", "fsdp", "zero"), [({"dp": 2, "tp": 2}, ("dp",), 3), ({"tp": 2}, (), 0)]
)
def test_qwen3_from_hf_trains_like_one_device(
    mesh: dict[str, int], fsdp: tuple[str, ...], zero: int
) -> None:
    rules = Rules.from_hf(qwen3(), fsdp=fsdp, tp="tp")
    report = assert_equivalent(
        qwen3,
        mesh,
        {"rules": rules, "zero": zero},
        batches=zoo.token_batches,
        steps=2,
        optimizer="adamw",
    )
    assert report.passed


@contextlib.contextmanager
def partial_gradients_not_reduced() -> Iterator[None]:
    """The lowering leaves the plan's partial gradients as each rank computed them."""
    with mock.patch("meshtrain.lower.tensor.parallel._replicate_on_shards"):
        yield


def test_a_dropped_partial_gradient_reduction_is_caught() -> None:
    rules = Rules.from_hf(qwen3(), fsdp="dp", tp="tp")
    with pytest.raises(mt.EquivalenceError) as failure:
        assert_equivalent(
            qwen3,
            {"dp": 2, "tp": 2},
            {"rules": rules, "zero": 3},
            batches=zoo.token_batches,
            steps=1,
            optimizer="adamw",
            rank_context=partial_gradients_not_reduced,
        )
    assert "norm.weight" in str(failure.value)


def _counted(mesh: dict[str, int], zero: int) -> tuple[dict, dict, dict, dict]:
    model = qwen3()
    rules = Rules.from_hf(model, fsdp=tuple(a for a in mesh if a == "dp"), tp="tp")
    return zoo.counted_step(model, rules, mesh, zero=zero)


@pytest.mark.parametrize(("mesh", "zero"), [({"dp": 2, "tp": 2}, 3), ({"tp": 2}, 0)])
def test_the_partial_gradient_all_reduces_are_the_predicted_ones(
    mesh: dict[str, int], zero: int
) -> None:
    world = 1
    for size in mesh.values():
        world *= size
    for counts, predicted, payload, predicted_payload in get_pool(world).run(_counted, mesh, zero):
        assert counts == predicted
        assert payload == predicted_payload
