"""The data pipeline: stdlib corpus, tokenizers, token files, windows and distributed batches.

The distributed sampling properties run in process: ``DistributedBatches`` issues no collectives,
so every data-parallel rank can be simulated by constructing it with that rank's coordinates.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import string
import sys
from collections.abc import Iterator, Sequence
from itertools import islice
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import meshtrain.train.data.loader as data_module
from meshtrain.errors import MeshtrainError
from meshtrain.train.batch import Batch, DataPosition
from meshtrain.train.data import (
    TOKENS_BIN,
    TOKENS_JSON,
    DistributedBatches,
    SyntheticTokens,
    TokenFile,
    TokenWindows,
    prepare_corpus,
    prepare_tokens,
)
from meshtrain.train.data.corpus import DataError, corpus_text, stdlib_documents
from meshtrain.train.data.tokenizer import (
    ByteTokenizer,
    Tokenizer,
    TokenizerError,
    load_tokenizer,
)

BYTE = ByteTokenizer()

# ---------------------------------------------------------------- helpers


class _IndexDataset:
    """Sample ``i`` is ``([i] * seq_len, [i + 1000] * seq_len)``: batches show their indices."""

    def __init__(self, n_samples: int, seq_len: int = 3) -> None:
        self.n_samples = n_samples
        self.seq_len = seq_len

    def __len__(self) -> int:
        return self.n_samples

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < self.n_samples:
            raise IndexError(index)
        return (
            torch.full((self.seq_len,), index, dtype=torch.int64),
            torch.full((self.seq_len,), index + 1000, dtype=torch.int64),
        )

    def __repr__(self) -> str:
        return f"_IndexDataset({self.n_samples})"


def _indices(batch: Batch) -> list[int]:
    return batch.inputs[:, 0].tolist()


def _rank_loaders(
    n_samples: int, global_batch: int, dp_size: int, seed: int
) -> list[DistributedBatches]:
    dataset = _IndexDataset(n_samples)
    return [
        DistributedBatches(dataset, global_batch, rank, dp_size, seed=seed)
        for rank in range(dp_size)
    ]


def _global_steps(
    n_samples: int, global_batch: int, dp_size: int, seed: int, steps: int
) -> list[tuple[list[int], DataPosition]]:
    """Each global step's sample indices, re-interleaved from the dp ranks' batches."""
    streams = [loader.batches() for loader in _rank_loaders(n_samples, global_batch, dp_size, seed)]
    result = []
    for _ in range(steps):
        per_rank = [next(stream) for stream in streams]
        assert len({batch.position for batch in per_rank}) == 1
        merged = [0] * global_batch
        for rank, batch in enumerate(per_rank):
            merged[rank::dp_size] = _indices(batch)
        result.append((merged, per_rank[0].position))
    return result


class _FailingDocuments:
    """Yields two documents, then raises: an interrupted preparation."""

    def __iter__(self) -> Iterator[str]:
        yield "first document"
        yield "second document"
        raise RuntimeError("disk on fire")


class _WideTokenizer:
    """A tokenizer with a vocabulary above 65536 ids (token files switch to uint32)."""

    name = "wide"
    vocab_size = 70_000
    eos_id = 69_999

    def encode(self, text: str) -> list[int]:
        return [65_536 + ord(char) % 1000 for char in text]

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(chr(i - 65_536) for i in ids)


class _BrokenTokenizer(_WideTokenizer):
    name = "broken"
    vocab_size = 100
    eos_id = 0


# ---------------------------------------------------------------- tokenizer


@given(st.text(max_size=200))
@settings(max_examples=60)
def test_byte_tokenizer_round_trips_text_without_nul(text: str) -> None:
    ids = BYTE.encode(text)
    assert all(0 < token < 256 for token in ids)
    assert ids == list(text.replace("\x00", "").encode("utf-8"))
    assert BYTE.decode(ids) == text.replace("\x00", "")


def test_byte_tokenizer_reserves_nul_for_end_of_document() -> None:
    assert (BYTE.eos_id, BYTE.vocab_size, BYTE.name) == (0, 256, "byte")
    assert BYTE.encode("a\x00b\x00") == [97, 98]
    assert BYTE.decode([97, 0, 98]) == "a\x00b"
    assert isinstance(BYTE, Tokenizer)


def test_byte_tokenizer_decodes_cut_characters_and_rejects_foreign_ids() -> None:
    assert BYTE.encode("é") == [0xC3, 0xA9]
    assert BYTE.decode([0xC3]) == "\ufffd"
    assert BYTE.encode("\ud800x") == [ord("?"), ord("x")]
    with pytest.raises(TokenizerError, match=r"id 300 is not a byte id in \[0, 256\)"):
        BYTE.decode([65, 300])


def test_load_tokenizer_names_unknown_tokenizers(tmp_path: Path) -> None:
    assert load_tokenizer("byte") == ByteTokenizer()
    with pytest.raises(TokenizerError, match=r"unknown tokenizer 'gpt5'.*'byte'"):
        load_tokenizer("gpt5")
    with pytest.raises(TokenizerError, match=r"unknown tokenizer .*tokenizer.json"):
        load_tokenizer(tmp_path)  # a directory without tokenizer.json
    with pytest.raises(TokenizerError, match=r"always 0.*drop eos_token"):
        load_tokenizer("byte", eos_token="</s>")


def test_hugging_face_tokenizer_without_the_package_says_how_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "tokenizer.json"
    path.write_text("{}")
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # makes `import tokenizers` fail
    with pytest.raises(TokenizerError, match=r"pip install tokenizers") as caught:
        load_tokenizer(tmp_path)
    assert str(path) in str(caught.value)
    assert isinstance(caught.value, MeshtrainError)


def _save_word_level_tokenizer(path: Path, vocab: dict[str, int]) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    model = tokenizers.models.WordLevel(vocab, unk_token="<unk>")
    tokenizer = tokenizers.Tokenizer(model)
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer.save(str(path))


def test_hugging_face_tokenizer_wraps_tokenizer_json(tmp_path: Path) -> None:
    path = tmp_path / "tokenizer.json"
    vocab = {"<unk>": 0, "</s>": 1, "hello": 2, "world": 3}
    _save_word_level_tokenizer(path, vocab)
    tokenizer = load_tokenizer(path)
    assert isinstance(tokenizer, Tokenizer)
    assert (tokenizer.vocab_size, tokenizer.eos_id) == (4, 1)
    assert tokenizer.encode("hello world nope") == [2, 3, 0]
    assert tokenizer.decode([2, 3]) == "hello world"
    assert tokenizer.name.startswith("hf:tokenizer.json:")
    token_file = prepare_tokens(["hello world", "world"], tokenizer, tmp_path / "tokens")
    assert token_file.tokens.tolist() == [2, 3, 1, 3, 1]
    assert token_file.info.tokenizer == tokenizer.name

    _save_word_level_tokenizer(path, {**vocab, "more": 4})
    assert load_tokenizer(path).name != tokenizer.name  # token files built before are stale
    assert load_tokenizer(path, eos_token="more").eos_id == 4
    with pytest.raises(TokenizerError, match=r"no end-of-document token.*'<bos>'.*eos_token="):
        load_tokenizer(path, eos_token="<bos>")


# ---------------------------------------------------------------- corpus


@pytest.fixture(scope="module")
def stdlib_corpus() -> list[str]:
    return list(stdlib_documents())


def test_corpus_is_megabytes_of_real_english(stdlib_corpus: list[str]) -> None:
    text = "\n\n".join(stdlib_corpus)
    assert len(text.encode()) > 1_000_000
    assert len(stdlib_corpus) > 2_000
    assert all(len(document) >= 40 and "\x00" not in document for document in stdlib_corpus)
    printable = set(string.printable)
    assert sum(char in printable for char in text) / len(text) > 0.99
    words = text.lower().split()
    for common in ("the", "is", "of", "and", "return", "if"):
        assert words.count(common) > 1_000, common
    assert sum(word.isalpha() for word in words) / len(words) > 0.6


def test_corpus_is_deterministic_and_limits_are_prefixes(stdlib_corpus: list[str]) -> None:
    limited = list(stdlib_documents(limit_bytes=100_000))
    size = sum(len(document.encode()) for document in limited)
    assert 90_000 < size <= 100_000
    assert limited == stdlib_corpus[: len(limited)]
    assert corpus_text(limit_bytes=100_000, separator="\x1e") == "\x1e".join(limited)
    assert list(stdlib_documents(limit_bytes=0)) == []
    with pytest.raises(DataError, match=r"limit_bytes=-1.*>= 0"):
        next(stdlib_documents(limit_bytes=-1))


def test_corpus_imports_none_of_the_modules_it_reads(stdlib_corpus: list[str]) -> None:
    # antigravity opens a web browser when imported; the corpus reads its docstring from source.
    assert any("xkcd" in document or "geohash" in document.lower() for document in stdlib_corpus)
    assert not {"antigravity", "this", "turtle", "idlelib"} & set(sys.modules)


# ---------------------------------------------------------------- token files


def test_prepare_tokens_round_trip(tmp_path: Path) -> None:
    token_file = prepare_tokens(["ab", "", "c\x00d"], BYTE, tmp_path, source="three documents")
    assert token_file.tokens.tolist() == [97, 98, 0, 99, 100, 0]
    assert isinstance(token_file.tokens, np.memmap) and not token_file.tokens.flags.writeable
    metadata = json.loads((tmp_path / TOKENS_JSON).read_text())
    assert metadata["num_tokens"] == 6 and metadata["dtype"] == "uint16"
    assert (metadata["tokenizer"], metadata["vocab_size"], metadata["eos_id"]) == ("byte", 256, 0)
    assert (metadata["num_documents"], metadata["source"]) == (2, "three documents")
    assert (tmp_path / TOKENS_BIN).stat().st_size == 12
    TokenFile(tmp_path / TOKENS_BIN, verify=True).verify()
    assert sorted(path.name for path in tmp_path.iterdir()) == [TOKENS_BIN, TOKENS_JSON]
    reopened = pickle.loads(pickle.dumps(token_file))
    assert reopened.tokens.tolist() == token_file.tokens.tolist()
    assert len(pickle.dumps(token_file)) < 500  # the path travels, not the tokens


def test_prepare_tokens_uses_uint32_above_65536_ids(tmp_path: Path) -> None:
    token_file = prepare_tokens(["ab"], _WideTokenizer(), tmp_path)
    assert token_file.info.dtype == "uint32"
    assert token_file.tokens.tolist() == [65_536 + 97, 65_536 + 98, 69_999]
    assert (tmp_path / TOKENS_BIN).stat().st_size == 12


def test_prepare_tokens_rejects_ids_outside_the_vocabulary(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"'broken' produced id 65633, outside .*\[0, 100\)"):
        prepare_tokens(["abc"], _BrokenTokenizer(), tmp_path)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(DataError, match=r"gave no text"):
        prepare_tokens(["", ""], BYTE, tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_interrupted_preparation_keeps_the_previous_valid_file(tmp_path: Path) -> None:
    prepare_tokens(["old"], BYTE, tmp_path)
    with pytest.raises(RuntimeError, match=r"disk on fire"):
        prepare_tokens(_FailingDocuments(), BYTE, tmp_path)
    assert TokenFile(tmp_path, verify=True).tokens.tolist() == [*b"old", 0]
    assert sorted(path.name for path in tmp_path.iterdir()) == [TOKENS_BIN, TOKENS_JSON]

    fresh = tmp_path / "fresh"
    with pytest.raises(RuntimeError, match=r"disk on fire"):
        prepare_tokens(_FailingDocuments(), BYTE, fresh)
    assert list(fresh.iterdir()) == []


def test_crash_between_binary_and_metadata_leaves_no_valid_looking_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    prepare_tokens(["old"], BYTE, tmp_path)

    def crash(path: Path, text: str) -> None:
        raise KeyboardInterrupt  # the process dies after renaming the new binary into place

    monkeypatch.setattr(data_module, "write_text_atomically", crash)
    with pytest.raises(KeyboardInterrupt):
        prepare_tokens(["new and longer"], BYTE, tmp_path)
    with pytest.raises(
        DataError, match=r"no prepared token file .*tokens.json' is missing.*Rebuild"
    ):
        TokenFile(tmp_path)


def test_damaged_token_files_are_named_with_the_fix(tmp_path: Path) -> None:
    prepare_tokens(["some text"], BYTE, tmp_path)
    bin_path, meta_path = tmp_path / TOKENS_BIN, tmp_path / TOKENS_JSON
    good = bin_path.read_bytes()

    bin_path.write_bytes(good[:-2])
    with pytest.raises(
        DataError, match=r"tokens.bin' has 18 bytes .* 10 uint16 tokens \(20 bytes\)"
    ):
        TokenFile(tmp_path)

    bin_path.write_bytes(good[:-2] + b"\x01\x00")
    TokenFile(tmp_path)  # the size is right: only the hash can tell
    with pytest.raises(DataError, match=r"sha256 .* corrupt\. Rebuild it with .*prepare_corpus"):
        TokenFile(tmp_path, verify=True)

    bin_path.unlink()
    with pytest.raises(DataError, match=r"tokens.bin' is missing"):
        TokenFile(tmp_path)

    bin_path.write_bytes(good)
    metadata = json.loads(meta_path.read_text())
    meta_path.write_text(json.dumps({**metadata, "num_tokens": "10"}))
    with pytest.raises(DataError, match=r"mistypes field.*num_tokens"):
        TokenFile(tmp_path)
    meta_path.write_text(json.dumps({**metadata, "format_version": 99}))
    with pytest.raises(DataError, match=r"version 99, expected 'meshtrain-tokens' version 1"):
        TokenFile(tmp_path)
    meta_path.write_text('{"num_tokens": 1')
    with pytest.raises(DataError, match=re.escape(f"'{meta_path}' is unreadable")):
        TokenFile(tmp_path)


def test_prepare_corpus_reuses_an_intact_matching_file(tmp_path: Path) -> None:
    token_file = prepare_corpus(tmp_path, limit_bytes=30_000)
    assert 20_000 < len(token_file) <= 30_000 + token_file.info.num_documents
    assert token_file.info.source.startswith("docstrings of the Python")
    assert BYTE.decode(token_file.tokens[:60].tolist()).startswith(next(stdlib_documents())[:40])
    tokens = token_file.tokens.tolist()
    stamp = (tmp_path / TOKENS_BIN).stat().st_mtime_ns
    assert prepare_corpus(tmp_path, "byte", 30_000).info == token_file.info
    assert (tmp_path / TOKENS_BIN).stat().st_mtime_ns == stamp

    data = bytearray((tmp_path / TOKENS_BIN).read_bytes())
    data[100] ^= 1
    (tmp_path / TOKENS_BIN).write_bytes(data)
    assert prepare_corpus(tmp_path, BYTE, 30_000).tokens.tolist() == tokens

    smaller = prepare_corpus(tmp_path, limit_bytes=10_000)
    assert len(smaller) < len(token_file)
    assert smaller.tokens.tolist() == tokens[: len(smaller)]


# ---------------------------------------------------------------- datasets


@given(
    documents=st.lists(st.text(alphabet="abcdé\n ", max_size=30), min_size=1, max_size=6),
    seq_len=st.integers(1, 9),
)
@settings(max_examples=25)
def test_token_windows_cover_the_file_with_shifted_targets(
    tmp_path_factory: pytest.TempPathFactory, documents: list[str], seq_len: int
) -> None:
    tokens = [token for document in documents if document for token in [*BYTE.encode(document), 0]]
    assume(len(tokens) >= seq_len + 1)
    token_file = prepare_tokens(documents, BYTE, tmp_path_factory.mktemp("windows"))
    windows = TokenWindows(token_file, seq_len)
    assert len(windows) == (len(tokens) - 1) // seq_len
    targets = []
    for index in range(len(windows)):
        inputs, target = windows[index]
        assert inputs.shape == target.shape == (seq_len,)
        assert inputs.dtype == target.dtype == torch.int64
        assert inputs.tolist() == tokens[index * seq_len : (index + 1) * seq_len]
        assert inputs[1:].tolist() == target[:-1].tolist()
        targets += target.tolist()
    assert targets == tokens[1 : 1 + len(windows) * seq_len]  # every token a target once
    assert windows[-1][0].tolist() == windows[len(windows) - 1][0].tolist()


def test_token_windows_refuse_impossible_lengths_and_indices(tmp_path: Path) -> None:
    token_file = prepare_tokens(["abcd"], BYTE, tmp_path)
    with pytest.raises(DataError, match=r"seq_len=5.*has 5 tokens.*seq_len in \[1, 4\]"):
        TokenWindows(token_file, 5)
    with pytest.raises(DataError, match=r"seq_len=0"):
        TokenWindows(tmp_path, 0)
    windows = TokenWindows(tmp_path, 2)
    with pytest.raises(IndexError, match=r"sample 2 is out of range .* of 2 samples"):
        windows[2]


def test_synthetic_tokens_are_a_function_of_seed_and_index() -> None:
    data = SyntheticTokens(vocab_size=50, seq_len=16, n_samples=10, seed=3)
    late_first = [data[index][0] for index in (7, 2)]
    again = SyntheticTokens(vocab_size=50, seq_len=16, n_samples=10, seed=3)
    assert torch.equal(again[2][0], late_first[1]) and torch.equal(again[7][0], late_first[0])
    inputs, targets = data[4]
    assert inputs.dtype == torch.int64 and inputs.shape == targets.shape == (16,)
    assert torch.equal(inputs[1:], targets[:-1])
    assert int(inputs.min()) >= 0 and int(inputs.max()) < 50
    other_seed = SyntheticTokens(vocab_size=50, seq_len=16, n_samples=10, seed=4)
    assert not torch.equal(other_seed[4][0], inputs)
    assert not torch.equal(data[5][0], inputs)
    with pytest.raises(DataError, match=r"n_samples must be >= 1"):
        SyntheticTokens(vocab_size=50, seq_len=16, n_samples=0, seed=0)


# ---------------------------------------------------------------- distributed batches

_sizes = st.tuples(
    st.sampled_from([1, 2, 4]),  # dp_size
    st.integers(1, 3),  # sequences per rank
    st.integers(0, 40),  # samples beyond one global batch
)


@given(sizes=_sizes, seed=st.integers(0, 2**40))
@settings(max_examples=30)
def test_an_epoch_covers_every_kept_sample_once_across_ranks(
    sizes: tuple[int, int, int], seed: int
) -> None:
    dp_size, per_rank, extra = sizes
    global_batch = dp_size * per_rank
    n_samples = global_batch + extra
    loaders = _rank_loaders(n_samples, global_batch, dp_size, seed)
    steps = loaders[0].steps_per_epoch
    assert steps == n_samples // global_batch
    seen: list[int] = []
    for loader in loaders:
        for batch in islice(loader.batches(), steps):
            assert batch.inputs.shape == batch.targets.shape == (per_rank, 3)
            assert torch.equal(batch.targets, batch.inputs + 1000)
            seen += _indices(batch)
    assert len(seen) == len(set(seen)) == steps * global_batch
    dropped = set(range(n_samples)) - set(seen)
    assert len(dropped) == n_samples % global_batch
    assert set(loaders[0].epoch_order(0)[steps * global_batch :].tolist()) == dropped


@given(sizes=_sizes, seed=st.integers(0, 2**40), steps=st.integers(1, 12))
@settings(max_examples=30)
def test_global_batches_do_not_depend_on_the_data_parallel_degree(
    sizes: tuple[int, int, int], seed: int, steps: int
) -> None:
    _, per_rank, extra = sizes
    global_batch = 4 * per_rank
    n_samples = global_batch + extra
    reference = _global_steps(n_samples, global_batch, 1, seed, steps)
    for dp_size in (2, 4):
        assert _global_steps(n_samples, global_batch, dp_size, seed, steps) == reference
    loader = DistributedBatches(_IndexDataset(n_samples), global_batch, 0, 1, seed=seed)
    assert [loader.global_indices(DataPosition())] == [reference[0][0]]


@given(
    sizes=_sizes,
    seed=st.integers(0, 2**40),
    consumed=st.integers(0, 30),
    horizon=st.integers(1, 8),
)
@settings(max_examples=30)
def test_resuming_from_a_position_continues_the_uninterrupted_stream(
    sizes: tuple[int, int, int], seed: int, consumed: int, horizon: int
) -> None:
    dp_size, per_rank, extra = sizes
    global_batch = dp_size * per_rank
    dataset = _IndexDataset(global_batch + extra)
    loader = DistributedBatches(dataset, global_batch, dp_size - 1, dp_size, seed=seed)
    stream = list(islice(loader.batches(), consumed + horizon))
    position = stream[consumed - 1].position if consumed else DataPosition()
    # a fresh object, as after a restart; under the same dp layout
    restarted = DistributedBatches(dataset, global_batch, dp_size - 1, dp_size, seed=seed)
    resumed = list(islice(restarted.batches(start=position), horizon))
    for expected, actual in zip(stream[consumed:], resumed, strict=True):
        assert _indices(actual) == _indices(expected)
        assert actual.position == expected.position


def test_positions_count_steps_and_roll_over_epochs() -> None:
    loader = _rank_loaders(n_samples=7, global_batch=2, dp_size=1, seed=0)[0]
    positions = [batch.position for batch in islice(loader.batches(), 7)]
    assert positions == [
        DataPosition(0, 1),
        DataPosition(0, 2),
        DataPosition(1, 0),
        DataPosition(1, 1),
        DataPosition(1, 2),
        DataPosition(2, 0),
        DataPosition(2, 1),
    ]
    # the end of an epoch written as (epoch, steps_per_epoch) is the next epoch's start
    assert _indices(next(loader.batches(DataPosition(0, 3)))) == _indices(
        next(loader.batches(DataPosition(1, 0)))
    )


@pytest.mark.parametrize("seed", [0, 1, 12345])
def test_epochs_are_reshuffled_and_seeds_reproduce(seed: int) -> None:
    loader = _rank_loaders(n_samples=40, global_batch=8, dp_size=2, seed=seed)[1]
    epoch_0 = [_indices(batch) for batch in islice(loader.batches(), 5)]
    epoch_1 = [_indices(batch) for batch in islice(loader.batches(DataPosition(1, 0)), 5)]
    flat = [index for indices in epoch_0 for index in indices]
    assert sorted(flat) != flat  # shuffled
    assert epoch_0 != epoch_1
    assert sorted(loader.epoch_order(0).tolist()) == list(range(40))
    same_seed = _rank_loaders(n_samples=40, global_batch=8, dp_size=2, seed=seed)[1]
    assert [_indices(batch) for batch in islice(same_seed.batches(), 5)] == epoch_0
    other_seed = _rank_loaders(n_samples=40, global_batch=8, dp_size=2, seed=seed + 1)[1]
    assert [_indices(batch) for batch in islice(other_seed.batches(), 5)] != epoch_0
    # seed + epoch does not alias another (seed, epoch) pair, unlike DistributedSampler's
    assert not torch.equal(other_seed.epoch_order(0), loader.epoch_order(1))


def test_unshuffled_batches_follow_the_dataset_order() -> None:
    loader = DistributedBatches(_IndexDataset(9), 4, 1, 2, seed=0, shuffle=False)
    assert [_indices(batch) for batch in islice(loader, 3)] == [[1, 3], [5, 7], [1, 3]]
    assert loader.rank_indices(DataPosition(0, 1)) == [5, 7]


def test_distributed_batches_name_impossible_configurations() -> None:
    dataset = _IndexDataset(10)
    with pytest.raises(DataError, match=r"global batch of 6 .* over 4 data-parallel ranks"):
        DistributedBatches(dataset, 6, 0, 4, seed=0)
    with pytest.raises(DataError, match=r"_IndexDataset\(10\) has 10 samples, fewer than .* 12"):
        DistributedBatches(dataset, 12, 0, 2, seed=0)
    with pytest.raises(DataError, match=r"dp_rank=2.*dp_size=2"):
        DistributedBatches(dataset, 4, 2, 2, seed=0)
    loader = DistributedBatches(dataset, 4, 0, 2, seed=0)
    with pytest.raises(DataError, match=r"position .*step=3.* 2 steps .*10 samples // global"):
        loader.batches(DataPosition(0, 3))


def test_batches_of_a_prepared_corpus_read_through_the_memory_map(tmp_path: Path) -> None:
    token_file = prepare_corpus(tmp_path, limit_bytes=20_000)
    windows = TokenWindows(token_file, seq_len=32)
    loader = DistributedBatches(windows, global_batch=8, dp_rank=1, dp_size=4, seed=5)
    batch = next(iter(loader))
    assert batch.inputs.shape == batch.targets.shape == (2, 32)
    assert batch.inputs.dtype == torch.int64
    for row, index in enumerate(loader.rank_indices(DataPosition())):
        start = index * 32
        assert batch.inputs[row].tolist() == token_file.tokens[start : start + 32].tolist()
        assert batch.targets[row].tolist() == token_file.tokens[start + 1 : start + 33].tolist()
    assert os.fspath(windows.token_file.directory) == os.fspath(tmp_path)
