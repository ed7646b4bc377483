"""Context parallelism on packed documents trains like one device with document masking, on gloo
ranks: batches carry positions restarting at each document (cut inside chunks and on their
edges, a single-document row, a row whose first document began before the window); each rank
derives its tokens' document ids from the whole sequences' positions and its attention sees
keys only within each query's document. meshtrain's Llama and MoE and ``transformers``' Llama,
Qwen2 and Mistral (sliding window), under dp 2 x cp 2 (head-tail chunks), cp 4, the all-gather
method and contiguous chunks; the one-device side is the same model with the same positions
(meshtrain's document mask, ``transformers``' packed-sequence mask). A planted fault — the
ranks' attention ignoring the document ids — fails the comparison."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any
from unittest import mock

import pytest
from context_models import MODELS, SEQ, rules, tp_rules
from packed_batches import packed_batches

import meshtrain as mt
from meshtrain.lower.context_parallel import ContextGroup
from meshtrain.testing import assert_equivalent

pytestmark = pytest.mark.spmd

DP2_CP2 = {"dp": 2, "cp": 2}


def _equivalent(name: str, mesh: dict[str, int], steps: int = 2, **options: Any) -> None:
    fsdp = ("dp",) if "dp" in mesh else ()
    report = assert_equivalent(MODELS[name], mesh, {"rules": rules(fsdp), "seq_len": SEQ, **options},
                               batches=packed_batches, steps=steps, optimizer="adamw")  # fmt: skip
    assert report.passed


@pytest.mark.parametrize("name", ["llama", "hf_llama"])
def test_packed_documents_train_like_one_device_on_dp2_cp2(name: str) -> None:
    _equivalent(name, DP2_CP2)


@pytest.mark.parametrize("name", ["llama", "hf_llama"])
def test_packed_documents_train_like_one_device_on_cp4(name: str) -> None:
    """Chunks of 4 tokens: most documents span several ranks, some chunks hold several."""
    _equivalent(name, {"cp": 4})


# ----------------------------------------------------------------------------- a planted fault

_ATTEND = ContextGroup.attend


def _attend_ignoring_documents(self: ContextGroup, *args: Any, **kwargs: Any) -> Any:
    kwargs.pop("documents", None)
    return _ATTEND(self, *args, **kwargs)


@contextlib.contextmanager
def documents_ignored() -> Iterator[None]:
    """Every rank's context attention drops the document ids: causal over the whole window."""
    with mock.patch.object(ContextGroup, "attend", _attend_ignoring_documents):
        yield


def test_ignoring_the_documents_under_cp_is_caught() -> None:
    with pytest.raises(mt.EquivalenceError) as caught:
        assert_equivalent(MODELS["llama"], DP2_CP2, {"rules": rules(("dp",)), "seq_len": SEQ},
                          batches=packed_batches, steps=1, optimizer="adamw",
                          rank_context=documents_ignored)  # fmt: skip
    worst = max(c.ratio for c in caught.value.report.comparisons)
    assert worst > 100, f"ignoring documents moved the worst comparison only to {worst:.3g}"


# ----------------------------------------------------------------------------- second tier


@pytest.mark.extended
@pytest.mark.parametrize("name", ["qwen2", "mistral", "moe"])
def test_more_families_train_like_one_device_on_cp4(name: str) -> None:
    _equivalent(name, {"cp": 4})


@pytest.mark.extended
@pytest.mark.parametrize(
    ("name", "options"),
    [
        ("llama", {"context_method": "allgather"}),
        ("qwen2", {"context_balance": "contiguous"}),
        ("mistral", {"activation_checkpointing": "full"}),
        ("moe", {}),
    ],
)
def test_packed_documents_compose_on_dp2_cp2(name: str, options: dict[str, Any]) -> None:
    _equivalent(name, DP2_CP2, **options)


@pytest.mark.extended
@pytest.mark.parametrize("name", ["llama", "mistral"])
def test_packed_documents_compose_with_tensor_and_sequence_parallel(name: str) -> None:
    report = assert_equivalent(MODELS[name], {"cp": 2, "tp": 2},
                               {"rules": tp_rules(name), "seq_len": SEQ},
                               batches=packed_batches, steps=2, optimizer="adamw")  # fmt: skip
    assert report.passed
