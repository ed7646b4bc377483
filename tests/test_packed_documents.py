"""Packed documents attend only within themselves (one process, plain PyTorch as the reference).

A window of several documents with positions restarting at each one gives, token for token, the
logits of each document run alone — for meshtrain's Llama and MoE (the shared ``Decoder``) and
for tiny ``transformers`` Llama and Qwen2 with SDPA (their own packed-sequence masking). The
bound is fp32 rounding: masked keys add exact zeros, so only the order of fp32 sums differs (the
kernels block a longer key axis differently), a few units of roundoff ``u = 2**-24`` per
element; the test allows ``64 u`` of the logits' largest magnitude, and checks that attention
across documents (the same window without positions) misses it by far. Also: the document rule
equals ``transformers``', the data yields restarting positions on request only, and the recipe
key is refused where it cannot apply."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from context_models import MODELS
from transformers.masking_utils import find_packed_sequence_indices

from meshtrain.errors import RecipeError, TrainingError
from meshtrain.recipes import load_recipe
from meshtrain.recipes.data import check_file_keys
from meshtrain.spec.packing import document_ids
from meshtrain.train.batch import Batch
from meshtrain.train.data import DistributedBatches
from meshtrain.train.data.documents import DocumentSource
from meshtrain.train.data.packed import PackedWindows, prepare_documents, restarting_positions
from meshtrain.train.data.tokenizer import ByteTokenizer
from meshtrain.train.step import forward_backward

#: fp32 unit roundoff; the bound on |packed - alone| is 64 u x max |logits|
UNIT = 2.0**-24
BOUND_UNITS = 64
KEYWORD = {
    "llama": "positions",
    "moe": "positions",
    "hf_llama": "position_ids",
    "qwen2": "position_ids",
}


def _logits(model: Any, tokens: torch.Tensor, **keywords: torch.Tensor) -> torch.Tensor:
    out = model(tokens, **keywords)
    return out if isinstance(out, torch.Tensor) else out.logits


def _packed_row(lengths: list[int], first: int = 0) -> torch.Tensor:
    """Positions of documents of ``lengths`` packed in one row; the first starts at ``first``
    (a document cut by the window's start)."""
    return torch.cat([torch.arange(n) + (first if i == 0 else 0) for i, n in enumerate(lengths)])


@pytest.mark.parametrize("name", sorted(KEYWORD))
def test_a_packed_window_equals_each_document_alone(name: str) -> None:
    torch.manual_seed(0)
    model = MODELS[name]().eval()
    rows = [[5, 11, 7, 9], [32], [3, 1, 20, 8]]
    firsts = [0, 0, 6]  # the last row's first document began before the window
    positions = torch.stack([_packed_row(r, f) for r, f in zip(rows, firsts, strict=True)])
    tokens = torch.randint(0, 128, positions.shape, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        packed = _logits(model, tokens, **{KEYWORD[name]: positions})
        across = _logits(model, tokens)  # one causal sequence per row: attends across documents
        alone = torch.stack(
            [
                torch.cat(
                    [
                        _logits(model, part[None], **{KEYWORD[name]: pos[None]})
                        for part, pos in zip(
                            row.split(lengths), row_pos.split(lengths), strict=True
                        )
                    ],
                    1,
                )[0]
                for row, row_pos, lengths in zip(tokens, positions, rows, strict=True)
            ]
        )
    bound = BOUND_UNITS * UNIT * float(alone.abs().max())
    worst = float((packed - alone).abs().max())
    assert worst <= bound, f"{name}: |packed - alone| = {worst:.3g} > bound {bound:.3g}"
    assert float((across - alone).abs().max()) > 1000 * bound  # the masking is what matters


def test_document_ids_follow_transformers_rule() -> None:
    generator = torch.Generator().manual_seed(0)
    for _ in range(20):
        steps = torch.randint(0, 4, (3, 40), generator=generator)  # 1: the next position
        positions = torch.where(
            steps == 0, torch.randint(0, 9, (3, 40), generator=generator), steps.cumsum(-1)
        )
        theirs = find_packed_sequence_indices(positions)
        ours = document_ids(positions)
        expected = torch.zeros_like(ours) if theirs is None else theirs
        assert torch.equal(ours, expected)


def test_restarting_positions_start_after_each_end_of_document() -> None:
    tokens = torch.tensor([4, 0, 0, 5, 6, 0, 7])
    assert restarting_positions(tokens, eos_id=0).tolist() == [0, 1, 0, 0, 1, 2, 0]


def _prepared(tmp_path: Path) -> Path:
    rows = [{"text": "abc"}, {"text": "de"}, {"text": "fghij"}, {"text": "k"}]
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps(row) for row in rows))
    source = DocumentSource("jsonl", str(path))
    return prepare_documents(source, ByteTokenizer(), tmp_path / "out").train


def test_packed_windows_give_positions_to_batches_on_request_only(tmp_path: Path) -> None:
    train = _prepared(tmp_path)  # abc⏎ de⏎ fghij⏎ k⏎ (⏎: the end-of-document id 0)
    plain = PackedWindows(train, seq_len=5)
    documents = PackedWindows(train, seq_len=5, document_positions=True)
    assert documents.positions(0).tolist() == [0, 1, 2, 3, 0]  # abc⏎ d
    assert documents.positions(1).tolist() == [0, 1, 0, 1, 2]  # e⏎ fgh: "de" cut, from 0
    assert all(torch.equal(a, b) for a, b in zip(plain[0], documents[0], strict=True))
    assert next(iter(DistributedBatches(plain, 2, 0, 1, seed=0))).token_positions is None
    batch = next(iter(DistributedBatches(documents, 2, 0, 1, seed=0, shuffle=False)))
    assert batch.token_positions is not None
    assert batch.token_positions.tolist() == [
        documents.positions(0).tolist(),
        documents.positions(1).tolist(),
    ]
    assert "document_positions=True" in repr(documents)


def test_the_recipe_key_is_refused_without_document_files_or_with_a_pipeline() -> None:
    with pytest.raises(RecipeError, match=r"data\.document_mask"):
        check_file_keys(load_recipe("debug", ["data.document_mask=true"]))
    assert load_recipe("debug").data.document_mask is False
    with pytest.raises(RecipeError, match=r"pipeline stages do not pass positions"):
        pipelined = load_recipe("llama3_70b", ["data.source=jsonl", "data.document_mask=true"])
        check_file_keys(pipelined)


def test_the_train_step_refuses_positions_it_cannot_pass_on() -> None:
    """Before any forward: positions under a pipeline, and positions not shaped like the inputs."""
    tokens = torch.zeros(2, 4, dtype=torch.long)
    pipelined = SimpleNamespace(pipeline=object(), context_axis=None)
    with pytest.raises(TrainingError, match="pipeline stages do not pass"):
        forward_backward(pipelined, None, Batch(tokens, tokens, token_positions=tokens))  # type: ignore[arg-type]
    flat = SimpleNamespace(pipeline=None, context_axis=None)
    with pytest.raises(TrainingError, match="one position per token"):
        forward_backward(flat, None, Batch(tokens, tokens, token_positions=tokens[:, :3]))  # type: ignore[arg-type]
