"""Pipelines with context parallelism on transformers' Qwen2 and Mistral (a sliding window of 12
over 32-token sequences, so the window masks keys on the other context rank's chunks) train like
one device on gloo ranks: pp 2 x cp 2 under 1F1B, fp32, AdamW, within the reduction-order
contract with the context reordering; and Mistral, 4 layers deep, under Interleaved1F1B with two
stages per pipeline rank. Tiny models built locally (``context_models``), the 4-rank pool."""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import pytest
from context_models import MODELS, SEQ, batches, rules
from torch import nn
from transformers import MistralForCausalLM

import meshtrain as mt
from meshtrain.testing import assert_equivalent
from meshtrain.testing.harness import EquivalenceReport

pytestmark = pytest.mark.spmd

PP2_CP2 = {"pp": 2, "cp": 2}


def deep_mistral() -> MistralForCausalLM:
    """The tiny Mistral of ``context_models`` with 4 layers: one per stage of a 2-rank pipeline
    with two stages per rank."""
    config = MODELS["mistral"]().config
    config.num_hidden_layers = 4
    return MistralForCausalLM(config)


def worst_ratio(report: EquivalenceReport) -> float:
    """The largest error over its bound of every comparison the run made (1 would fail)."""
    return max(comparison.ratio for comparison in report.comparisons)


def _pipelined(model_fn: Callable[[], nn.Module], pipeline: mt.Pipeline) -> None:
    """``model_fn`` on pp 2 x cp 2 under ``pipeline``, 2 AdamW steps against one device; the
    plan the ranks ran is the pipeline asked for (every stage on its own pipeline rank) with the
    sequence over ``cp``."""
    start = time.perf_counter()
    report = assert_equivalent(
        model_fn,
        PP2_CP2,
        {"rules": rules(()), "seq_len": SEQ, "pipeline": pipeline},
        batches=batches,
        steps=2,
        optimizer="adamw",
    )
    print(
        f"{pipeline.schedule} x{pipeline.stages_per_rank}: {time.perf_counter() - start:.1f} s, "
        f"worst {worst_ratio(report):.3f} of the bound"
    )
    assert report.passed and report.contract.level == "reduction-order"
    assert "context" in report.contract.describe()
    plan = json.loads(report.plan_json)
    stages = plan["pipeline"]["stages"]
    assert plan["context_axis"] == "cp" and plan["pipeline"]["schedule"] == pipeline.schedule
    assert [stage["rank"] for stage in stages] == [0, 1] * pipeline.stages_per_rank


@pytest.mark.parametrize("name", ["qwen2", "mistral"])
def test_transformers_families_train_like_one_device_on_pp2_cp2_1f1b(name: str) -> None:
    _pipelined(MODELS[name], mt.Pipeline(axis="pp", schedule="1F1B", microbatches=2))


def test_interleaved_1f1b_with_two_stages_per_rank_on_pp2_cp2() -> None:
    """Four stages over two pipeline ranks, each running the ring over cp for its two stages."""
    pipeline = mt.Pipeline(axis="pp", schedule="Interleaved1F1B", microbatches=2, stages_per_rank=2)
    _pipelined(deep_mistral, pipeline)
