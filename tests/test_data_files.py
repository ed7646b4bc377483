"""The user's own data in recipes: JSON Lines, text, Parquet and saved datasets read into packed
token files whose loss never crosses a document boundary (and skips instruction prompts), with a
stable validation split, a cache, and one-line errors naming file and line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from meshtrain.errors import DataError
from meshtrain.train.data import TokenFile, prepare_tokens
from meshtrain.train.data.documents import DocumentSource, read_documents
from meshtrain.train.data.packed import PackedWindows, prepare_documents
from meshtrain.train.data.tokenizer import ByteTokenizer, load_tokenizer
from meshtrain.train.loss import summed_cross_entropy

DOCS = ["the cat sat", "on the mat", "a dog", "ran far away", "it rained", "sun again"]


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def test_prepare_tokens_takes_a_tokenizer_name(tmp_path: Path) -> None:
    token_file = prepare_tokens(["ab", "c"], "byte", tmp_path)
    assert token_file.tokens.tolist() == [97, 98, 0, 99, 0]


@pytest.mark.parametrize("kind", ["jsonl", "text", "parquet", "hf-dataset"])
def test_every_file_source_reads_the_same_documents(tmp_path: Path, kind: str) -> None:
    if kind == "jsonl":
        path = _jsonl(tmp_path / "d.jsonl", [{"text": doc, "id": i} for i, doc in enumerate(DOCS)])
    elif kind == "text":
        path = tmp_path / "texts"
        path.mkdir()
        for index, doc in enumerate(DOCS):
            (path / f"{index:02d}.txt").write_text(doc, encoding="utf-8")
    elif kind == "parquet":
        pyarrow = pytest.importorskip("pyarrow")
        parquet = pytest.importorskip("pyarrow.parquet")
        path = tmp_path / "d.parquet"
        parquet.write_table(pyarrow.table({"text": DOCS}), path)
    else:
        datasets = pytest.importorskip("datasets")
        path = tmp_path / "saved"
        datasets.Dataset.from_dict({"text": DOCS}).save_to_disk(str(path))
    documents = list(read_documents(DocumentSource(kind, str(path))))
    assert [document.text for document in documents] == DOCS


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ('{"text": "ok"}\n{"text": "broken"\n', r"d\.jsonl:2: not a JSON object"),
        ('{"text": "ok"}\n{"body": "x"}\n', r"d\.jsonl:2: no field 'text' \(fields: body\)"),
        ('{"text": 3}\n', r"d\.jsonl:1: field 'text' is int, not text"),
        ("", r"d\.jsonl: holds no documents"),
    ],
    ids=["malformed", "missing-field", "not-text", "empty"],
)
def test_bad_files_are_one_line_naming_file_and_line(
    tmp_path: Path, content: str, expected: str
) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(DataError, match=expected) as raised:
        prepare_documents(DocumentSource("jsonl", str(path)), ByteTokenizer(), tmp_path / "out")
    assert "\n" not in str(raised.value)
    assert not (tmp_path / "out" / "train" / "tokens.json").exists()


def test_a_missing_parquet_column_is_named(tmp_path: Path) -> None:
    pyarrow = pytest.importorskip("pyarrow")
    parquet = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "d.parquet"
    parquet.write_table(pyarrow.table({"content": DOCS}), path)
    with pytest.raises(DataError, match=r"no column 'text' \(columns: content\).*data.text_field"):
        list(read_documents(DocumentSource("parquet", str(path))))


class _Unigram(nn.Module):
    """Each position's logits depend on its own token only, so a packed window's loss is a sum
    over its documents exactly when no target crosses a boundary."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab, 16)
        self.out = nn.Linear(16, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.embed(ids))


def _reference_loss(model: nn.Module, prompts: list[str], responses: list[str]) -> torch.Tensor:
    """One document at a time, as a plain PyTorch fine-tuning script would: predict the response
    and the end-of-document id, never the prompt."""
    total = torch.zeros(())
    for prompt, response in zip(prompts, responses, strict=True):
        ids = torch.tensor([*prompt.encode(), *response.encode(), 0])
        targets = ids[1:].clone()
        targets[: max(len(prompt.encode()), 1) - 1] = -100
        total = total + F.cross_entropy(model(ids[:-1]), targets, reduction="sum")
    return total


@pytest.mark.parametrize("instruction", [False, True], ids=["text", "instruction"])
def test_packed_loss_equals_the_loss_of_each_document_alone(
    tmp_path: Path, instruction: bool
) -> None:
    prompts = [f"Q{i}: " if instruction else "" for i in range(len(DOCS))]
    rows = [
        {"prompt": prompt, "response": doc} if instruction else {"text": doc}
        for prompt, doc in zip(prompts, DOCS, strict=True)
    ]
    path = _jsonl(tmp_path / "d.jsonl", rows)
    source = DocumentSource("jsonl", str(path), format="instruction" if instruction else "text")
    prepared = prepare_documents(source, ByteTokenizer(), tmp_path / "out")
    total_tokens = len(TokenFile(prepared.train))
    windows = PackedWindows(prepared.train, seq_len=total_tokens - 1)  # one window: everything
    inputs, targets = windows[0]
    model = _Unigram(256)
    packed = summed_cross_entropy(model(inputs[None]), targets[None])
    reference = _reference_loss(model, prompts, DOCS)
    # the first document's first token has no input before it in either computation
    assert torch.allclose(packed, reference, rtol=1e-6), (float(packed), float(reference))
    # every response token and end-of-document id is a target; document starts are not
    expected = sum(len(doc) + 1 for doc in DOCS) - (0 if instruction else len(DOCS))
    assert int((targets != -100).sum()) == expected


def test_boundary_and_prompt_masks_are_exact(tmp_path: Path) -> None:
    rows = [{"prompt": "PQ", "response": "ab"}, {"prompt": "R", "response": "c"}]
    path = _jsonl(tmp_path / "d.jsonl", rows)
    source = DocumentSource("jsonl", str(path), format="instruction")
    prepared = prepare_documents(source, ByteTokenizer(), tmp_path / "out")
    inputs, targets = PackedWindows(prepared.train, seq_len=7)[0]
    assert bytes(inputs.tolist()) == b"PQab\x00Rc"
    # P→Q is a prompt target, \0→R starts another document: neither carries loss
    assert targets.tolist() == [-100, ord("a"), ord("b"), 0, -100, ord("c"), 0]


def test_validation_split_is_disjoint_stable_and_cached(tmp_path: Path) -> None:
    rows = [{"text": f"document number {i}"} for i in range(200)]
    path = _jsonl(tmp_path / "d.jsonl", rows)
    source = DocumentSource("jsonl", str(path))
    first = prepare_documents(source, ByteTokenizer(), tmp_path / "out", validation=0.1, seed=3)
    assert first.validation is not None and not first.reused
    train, held_out = TokenFile(first.train), TokenFile(first.validation)
    assert train.info.num_documents + held_out.info.num_documents == 200
    assert 8 <= held_out.info.num_documents <= 35

    def texts(token_file: TokenFile) -> set[str]:
        return set(bytes(token_file.tokens.tolist()).decode().split("\0")) - {""}

    assert not texts(train) & texts(held_out)
    again = prepare_documents(source, ByteTokenizer(), tmp_path / "out", validation=0.1, seed=3)
    assert again.reused and again.validation is not None
    assert texts(TokenFile(again.validation)) == texts(held_out)
    _jsonl(path, [*rows, {"text": "one more"}])  # the file changed: tokenised again
    changed = prepare_documents(source, ByteTokenizer(), tmp_path / "out", validation=0.1, seed=3)
    assert not changed.reused


def test_hugging_face_tokenizer_encodes_in_batches(tmp_path: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[UNK]": 0, "</s>": 1, "the": 2, "cat": 3, "sat": 4}
    model = tokenizers.models.WordLevel(vocab, unk_token="[UNK]")
    tokenizer = tokenizers.Tokenizer(model)
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    loaded = load_tokenizer(tmp_path)
    path = _jsonl(tmp_path / "d.jsonl", [{"text": "the cat sat"}, {"text": "cat dog"}])
    prepared = prepare_documents(DocumentSource("jsonl", str(path)), loaded, tmp_path / "out")
    assert TokenFile(prepared.train).tokens.tolist() == [2, 3, 4, 1, 3, 0, 1]


def test_a_tokenizer_larger_than_the_models_vocabulary_is_refused_before_tokenising(
    tmp_path: Path,
) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    from meshtrain.errors import RecipeError
    from meshtrain.recipes import load_recipe
    from meshtrain.recipes.data import prepare_recipe_data

    vocab = {f"w{i}": i for i in range(300)} | {"</s>": 300}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0"))
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    path = _jsonl(tmp_path / "d.jsonl", [{"text": "w1 w2"}])
    recipe = load_recipe(
        "debug",
        [
            f"data.tokenizer={tmp_path / 'tokenizer.json'}",
            "data.source=jsonl",
            f"data.path={path}",
            f"logging.run_dir={tmp_path / 'run'}",
        ],
    )
    with pytest.raises(RecipeError, match="has 301 ids, more than the model's vocabulary of 256"):
        prepare_recipe_data(recipe)
    assert not (tmp_path / "run" / "data").exists()


def test_tokenising_on_a_process_pool_writes_the_same_files(tmp_path: Path) -> None:
    """Byte tokenising on 2 worker processes (chunks of 512 documents, in flight out of order)
    writes token, mask and metadata files byte for byte equal to one process's, with the same
    validation split; a bad id found in a worker is still one error naming the document."""
    from meshtrain.train.data.pack_pool import MAX_WORKERS, default_workers, packed_chunks

    # the byte tokenizer's array path stays in this process; a Python encode() gets a pool
    assert default_workers(ByteTokenizer(), 1 << 30) == default_workers(ListBytes(), 1 << 10) == 1
    assert 1 <= default_workers(ListBytes(), 1 << 30) <= MAX_WORKERS

    rows = [{"prompt": f"Q{i}é ", "response": "x" * (i % 37) + f"ü{i}\x00"} for i in range(1500)]
    source = DocumentSource("jsonl", str(_jsonl(tmp_path / "d.jsonl", rows)), format="instruction")
    seen: dict[int, list[tuple[int, int]]] = {0: [], 1: [], 2: []}
    for workers in (0, 1, 2):  # 0: the generic path, ids as Python ints from encode()
        tokenizer = ListBytes() if workers == 0 else ByteTokenizer()
        prepare_documents(
            source,
            tokenizer,
            tmp_path / f"out{workers}",
            validation=0.1,
            seed=5,
            workers=max(workers, 1),
            progress=lambda d, t, w=workers: seen[w].append((d, t)),
        )
    for split in ("train", "validation"):
        for name in ("tokens.bin", "loss_mask.bin", "tokens.json"):
            zero, one, two = (tmp_path / f"out{w}" / split / name for w in (0, 1, 2))
            assert zero.read_bytes() == one.read_bytes() == two.read_bytes(), (split, name)
    assert seen[0] == seen[1]
    assert seen[1] == seen[2] and seen[2][-1][0] == 1500  # the bar reaches every document
    assert TokenFile(tmp_path / "out2" / "train").info.num_documents > 1000
    with pytest.raises(DataError, match=r"d\.jsonl:1: the tokenizer produced id 195"):
        list(packed_chunks(NarrowBytes(), [list(read_documents(source))[:3]], workers=2))


class ListBytes(ByteTokenizer):
    """The byte tokenizer through its ``encode`` (a list of ints), not the array fast path."""

    def encode(self, text: str) -> list[int]:
        return super().encode(text)


class NarrowBytes(ByteTokenizer):
    """Bytes with a vocabulary of 100: "é" (195, 169) falls outside (module level: it pickles)."""

    @property
    def vocab_size(self) -> int:
        return 100


def test_a_planted_out_of_order_pool_is_caught(tmp_path: Path) -> None:
    """A fault planted in the pool (chunks taken newest first) changes the token file: the
    equality with one process is what catches it."""
    from collections import deque
    from unittest import mock

    class NewestFirst(deque):
        def popleft(self):  # type: ignore[no-untyped-def]
            return self.pop()

    rows = [{"text": f"document {i} " + "y" * (i % 11)} for i in range(2000)]
    source = DocumentSource("jsonl", str(_jsonl(tmp_path / "d.jsonl", rows)))
    prepare_documents(source, ListBytes(), tmp_path / "one", workers=1)
    with mock.patch("meshtrain.train.data.pack_pool.deque", NewestFirst):
        prepare_documents(source, ListBytes(), tmp_path / "pool", workers=2)
    one, pool = ((tmp_path / d / "train" / "tokens.bin").read_bytes() for d in ("one", "pool"))
    assert len(one) == len(pool) and one != pool


@pytest.mark.parametrize("kind", ["jsonl", "text"])
def test_a_byte_that_is_not_utf8_is_named_by_line_and_file_offset(
    tmp_path: Path, kind: str
) -> None:
    """A bad byte used to read ``not UTF-8 text ('utf-8' codec can't decode byte 0xff in
    position 6901…)``: no line, and 6901 counted from the start of a read buffer, not the file."""
    good = json.dumps({"text": "ok " * 3000}) + "\n"  # longer than one read buffer
    lines = [good.encode()] * 40
    bad = (
        json.dumps({"text": "caf\u00e9"}, ensure_ascii=False).encode().replace(b"\xc3\xa9", b"\xff")
    )
    lines[37] = bad + b"\n"
    path = tmp_path / f"data.{kind}"
    path.write_bytes(b"".join(lines))
    offset = sum(len(line) for line in lines[:37]) + bad.index(b"\xff")
    with pytest.raises(DataError) as refusal:
        list(read_documents(DocumentSource(kind, str(path))))
    text = str(refusal.value)
    assert text.startswith(
        f"{path}:38: not UTF-8 text (byte 0xff at offset {offset:,} of the file)"
    )
    assert "\n" not in text
