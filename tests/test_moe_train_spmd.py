"""``moe_debug`` trains on 4 gloo ranks with expert parallelism, and its checkpoint resumes under
another mesh (ep 4 → dp 2 × ep 2) where the same training continues (second tier)."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshtrain.recipes import load_recipe
from meshtrain.recipes.run import train
from meshtrain.testing.runner import get_pool
from meshtrain.train.data import prepare_corpus
from meshtrain.train.metrics import read_jsonl

pytestmark = [pytest.mark.spmd, pytest.mark.extended]

CORPUS_BYTES = 300_000


def run(overrides: list[str], stop_after: int | None) -> tuple[dict[int, float], int | None]:
    """On every pool rank: the recipe trained (``stop_after`` steps at most); its losses and the
    step it resumed from."""
    result = train(load_recipe("moe_debug", overrides), stop_after=stop_after)
    return result.losses, result.resumed_from


def _overrides(run_dir: Path, corpus: Path, *extra: str) -> list[str]:
    return [
        "train.steps=6",
        "train.warmup_steps=1",
        "train.seq_len=16",
        f"data.path={corpus}",
        f"data.corpus_bytes={CORPUS_BYTES}",
        f"logging.run_dir={run_dir}",
        "logging.log_every=1",
        "logging.console=false",
        "checkpoint.interval=100",
        *extra,
    ]


def test_moe_debug_trains_and_resumes_under_another_mesh(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    prepare_corpus(corpus, limit_bytes=CORPUS_BYTES)
    pool = get_pool(4)
    whole, _ = pool.run(run, _overrides(tmp_path / "whole", corpus), None)[0]
    assert sorted(whole) == list(range(1, 7)) and whole[6] < whole[1]
    parted = tmp_path / "parted"
    first, _ = pool.run(run, _overrides(parted, corpus), 4)[0]
    assert first == {step: whole[step] for step in range(1, 5)}  # the same run, bit for bit
    resumed, since = pool.run(run, _overrides(parted, corpus, "mesh.dp=2", "mesh.ep=2"), None)[0]
    assert since == 4 and sorted(resumed) == [5, 6]
    # the same parameters (DCP reshards them exactly) and data: the losses differ only in the
    # order the loss and gradients are reduced over 4 batch ranks laid out 2 × 2 instead of 1 × 4
    for step in (5, 6):
        assert abs(resumed[step] - whole[step]) <= 1e-5 * abs(whole[step])
    logged = [row for row in read_jsonl(parted / "metrics.jsonl") if row["step"] == 6]
    assert logged and logged[-1]["moe/load_ratio"] >= 1.0
    counts = logged[-1]["moe/tokens_per_expert/layers.1"].split()
    assert len(counts) == 8 and sum(map(int, counts)) == 8 * 16 * 2  # every token, top-2
