"""Context parallelism on packed documents trains like one device with document masking, on gloo
ranks: batches carry positions restarting at each document (cut inside chunks and on their
edges, a single-document row, a row whose first document began before the window); each rank
derives its tokens' document ids from the whole sequences' positions and its attention sees
keys only within each query's document. meshtrain's Llama and MoE and ``transformers``' Llama,
Qwen2 and Mistral (sliding window), under dp 2 x cp 2 (head-tail chunks), cp 4, the all-gather
method, contiguous chunks, checkpointing and cp x tp with sequence parallelism, and FSDP alone
(no context axis); the one-device side is the same model with the same positions (meshtrain's
document mask, ``transformers``' packed-sequence mask). Evaluation under dp 2 x cp 2 gives one
device's loss. A planted fault — the ranks' attention ignoring the document ids — fails the
comparison."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from context_models import MODELS, SEQ, rules, tp_rules
from packed_batches import packed_batches

import meshtrain as mt
from meshtrain.lower.context.parallel import ContextGroup, positions_keyword
from meshtrain.testing import assert_equivalent
from meshtrain.testing.contract import contract_for
from meshtrain.testing.runner import get_pool
from meshtrain.train.batch import Batch
from meshtrain.train.evaluate import evaluate
from meshtrain.train.loss import data_parallel_rank

pytestmark = pytest.mark.spmd

DP2_CP2 = {"dp": 2, "cp": 2}


def _equivalent(name: str, mesh: dict[str, int], steps: int = 2, **options: Any) -> None:
    fsdp = ("dp",) if "dp" in mesh else ()
    report = assert_equivalent(
        MODELS[name],
        mesh,
        {"rules": rules(fsdp), "seq_len": SEQ, **options},
        batches=packed_batches,
        steps=steps,
        optimizer="adamw",
    )
    assert report.passed


@pytest.mark.parametrize("name", ["llama", "hf_llama"])
def test_packed_documents_train_like_one_device_on_dp2_cp2(name: str) -> None:
    _equivalent(name, DP2_CP2)


@pytest.mark.parametrize("name", ["llama", "hf_llama"])
def test_packed_documents_train_like_one_device_on_cp4(name: str) -> None:
    """Chunks of 4 tokens: most documents span several ranks, some chunks hold several."""
    _equivalent(name, {"cp": 4})


@pytest.mark.parametrize("name", ["llama", "hf_llama"])
def test_packed_documents_train_like_one_device_without_cp(name: str) -> None:
    """No context axis (FSDP over dp 2): the positions reach the model as they are."""
    report = assert_equivalent(
        MODELS[name],
        {"dp": 2},
        mt.Rules({".*": mt.P()}, fsdp=("dp",)),
        batches=packed_batches,
        steps=2,
        optimizer="adamw",
    )
    assert report.passed


def _one_device_loss(name: str, positions: bool) -> float:
    torch.manual_seed(0)
    model = MODELS[name]()
    inputs, targets, token_positions = packed_batches(9)
    keywords = {positions_keyword(model): token_positions} if positions else {}
    with torch.no_grad():
        out = model(inputs, **keywords)
    logits = out if isinstance(out, torch.Tensor) else out.logits
    return float(F.cross_entropy(logits.flatten(0, 1), targets.flatten()))


def _evaluated(name: str) -> tuple[float, float]:
    """On each of 4 ranks (dp 2 x cp 2): ``evaluate`` of this rank's rows of a packed batch."""
    torch.manual_seed(0)
    model = MODELS[name]()
    plan = mt.plan(model, mt.make_mesh(DP2_CP2), rules(), seq_len=SEQ)
    applied = mt.apply(plan, model)
    inputs, targets, positions = packed_batches(9)
    index, ranks = data_parallel_rank(plan)
    rows = slice(index * len(inputs) // ranks, (index + 1) * len(inputs) // ranks)
    batch = Batch(inputs[rows], targets[rows], token_positions=positions[rows])
    return evaluate(plan, applied, [batch]).loss, contract_for(plan).tolerance


@pytest.mark.parametrize("name", ["llama", "hf_llama"])
def test_evaluation_on_packed_documents_matches_one_device(name: str) -> None:
    """``mt.train.evaluate`` under dp 2 x cp 2 gives one device's loss with document masking
    (relatively within the plan's contract), which attending across documents misses."""
    reference = _one_device_loss(name, positions=True)
    across = _one_device_loss(name, positions=False)
    for loss, tolerance in get_pool(4).run(_evaluated, name):
        assert abs(loss - reference) <= tolerance * abs(reference), (loss, reference)
        assert abs(across - reference) > tolerance * abs(reference)  # outside the contract


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
        assert_equivalent(
            MODELS["llama"],
            DP2_CP2,
            {"rules": rules(("dp",)), "seq_len": SEQ},
            batches=packed_batches,
            steps=1,
            optimizer="adamw",
            rank_context=documents_ignored,
        )
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
    report = assert_equivalent(
        MODELS[name],
        {"cp": 2, "tp": 2},
        {"rules": tp_rules(name), "seq_len": SEQ},
        batches=packed_batches,
        steps=2,
        optimizer="adamw",
    )
    assert report.passed
