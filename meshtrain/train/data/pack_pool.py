"""Documents encoded and packed on a pool of processes, in order: the same bytes as one process.

Why: a tokenizer written in Python (the byte tokenizer, or any without a batch encoder running
on all cores) encodes one document at a time; on a corpus of gigabytes that is the whole wait
before training. :func:`packed_chunks` sends chunks of documents to worker processes, each of
which encodes them and builds the packed tokens (followed by the end-of-document id) and the
loss mask as bytes; the chunks come back in their original order, a bounded number in flight,
so the token file, its mask and its digest are byte for byte what one process writes.
:func:`pack_chunk` is the one packing rule both use, a chunk at a time; for the byte tokenizer
it reads the ids straight off the UTF-8 bytes as one array (the same ids as
``ByteTokenizer.encode``, without a Python int per byte), which is most of the gain on few
cores.

Example:
    >>> from meshtrain.train.data.documents import Document
    >>> from meshtrain.train.data.tokenizer import ByteTokenizer
    >>> docs = [Document("ab", "x:1"), Document("", "x:2"), Document("c", "x:3", prompt="Q")]
    >>> chunk = next(packed_chunks(ByteTokenizer(), [docs], workers=1))
    >>> chunk.counts, chunk.tokens, chunk.mask  # the empty document is left out
    ((3, 0, 3), b'a\\x00b\\x00\\x00\\x00Q\\x00c\\x00\\x00\\x00', b'\\x00\\x01\\x01\\x00\\x01\\x01')
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
import pickle
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from meshtrain.errors import DataError
from meshtrain.train.data.documents import Document
from meshtrain.train.data.tokenizer import ByteTokenizer, Tokenizer

__all__ = ["PackedChunk", "default_workers", "pack_chunk", "packed_chunks"]

#: Source bytes from which a pool pays for its start (measured in benchmarks/tokenise.py).
PARALLEL_MIN_BYTES = 4 << 20
#: More workers gain nothing: this process, parsing the documents, is the bottleneck (on 16
#: cores, 4 workers encode 128 MiB through ``encode()`` 1.78x faster than one, 16 workers 1.63x).
MAX_WORKERS = 4


@dataclass(frozen=True)
class PackedChunk:
    """Documents as the packed files hold them, end to end: their token ids each followed by the
    end-of-document id (``tokens``, in the file's dtype), one mask byte per token (``mask``, 1:
    carries loss) and each document's token count (``counts``; 0 for one left out: its text
    encodes to nothing, so it teaches nothing)."""

    tokens: bytes
    mask: bytes
    counts: tuple[int, ...]
    itemsize: int

    def documents(self) -> Iterator[tuple[int, memoryview, memoryview]]:
        """Each document's token count and its tokens' and mask's bytes, in order."""
        tokens, mask, start = memoryview(self.tokens), memoryview(self.mask), 0
        for count in self.counts:
            end = start + count
            yield count, tokens[start * self.itemsize : end * self.itemsize], mask[start:end]
            start = end


def pack_chunk(tokenizer: Tokenizer, documents: Sequence[Document], dtype: np.dtype) -> PackedChunk:
    """``documents`` encoded (each its prompt, then its text, then the end-of-document id) and
    packed end to end. The first token of each and its prompt carry no loss. Raises
    :class:`DataError` naming the document when an id falls outside the vocabulary."""
    fast = _byte_fast(tokenizer)
    eos: bytes | list[int] = b"\x00" if fast else [tokenizer.eos_id]
    parts: list[Any] = []
    counts, prompts = [], []
    for document in documents:
        prompt = _encode(tokenizer, document.prompt, fast)
        text = _encode(tokenizer, document.text, fast)
        if not text:
            counts.append(0)
            prompts.append(0)
            continue
        parts += (prompt, text, eos)
        counts.append(len(prompt) + len(text) + 1)
        prompts.append(len(prompt))
    if fast:
        ids = np.frombuffer(b"".join(parts), np.uint8)
    else:
        ids = np.asarray(list(itertools.chain.from_iterable(parts)), dtype=np.int64)
    ends = np.cumsum(counts, dtype=np.int64)
    _check_vocabulary(tokenizer, ids, ends, documents)
    mask = np.ones(len(ids), dtype=np.uint8)
    for end, count, prompt_count in zip(ends.tolist(), counts, prompts):
        if count:
            start = end - count
            mask[start : start + max(prompt_count, 1)] = 0  # the first token, and the prompt
    return PackedChunk(ids.astype(dtype).tobytes(), mask.tobytes(), tuple(counts), dtype.itemsize)


def _byte_fast(tokenizer: Tokenizer) -> bool:
    """The byte tokenizer with its own ``encode`` and end-of-document id 0: its ids are the
    UTF-8 bytes, read as an array without a Python int per byte."""
    return (
        isinstance(tokenizer, ByteTokenizer)
        and type(tokenizer).encode is ByteTokenizer.encode
        and tokenizer.eos_id == 0
    )


def _encode(tokenizer: Tokenizer, text: str, fast: bool) -> bytes | list[int]:
    """``tokenizer.encode(text)``; as bytes on the byte tokenizer's fast path (the same ids)."""
    if not text:
        return b"" if fast else []
    if fast:
        return text.replace("\x00", "").encode("utf-8", errors="replace")
    return tokenizer.encode(text)


def _check_vocabulary(
    tokenizer: Tokenizer, ids: np.ndarray, ends: np.ndarray, documents: Sequence[Document]
) -> None:
    vocab = tokenizer.vocab_size
    if ids.dtype == np.uint8 and vocab >= 256:
        return  # bytes: always inside
    bad = np.flatnonzero((ids < 0) | (ids >= vocab))
    if len(bad):
        document = documents[int(np.searchsorted(ends, bad[0], side="right"))]
        raise DataError(
            f"{document.where}: the tokenizer produced id {int(ids[bad[0]])}, outside its "
            f"vocabulary [0, {vocab}). Use the tokenizer the model was trained with."
        )


def default_workers(tokenizer: Tokenizer, source_bytes: int) -> int:
    """Worker processes for a source of ``source_bytes``: 1 (this process) for the byte
    tokenizer, whose array path outruns what a pool gains once this process has parsed the
    documents; up to :data:`MAX_WORKERS` for a tokenizer that encodes in Python, when the source
    is large enough to pay for the pool's start (``benchmarks/tokenise.py``)."""
    if _byte_fast(tokenizer) or source_bytes < PARALLEL_MIN_BYTES:
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(cores or 1, MAX_WORKERS))


def packed_chunks(
    tokenizer: Tokenizer, chunks: Iterable[Sequence[Document]], *, workers: int
) -> Iterator[PackedChunk]:
    """Each chunk of documents packed (:func:`pack_chunk`), in order; on ``workers``
    processes when more than 1 (and the tokenizer pickles), at most ``2 × workers`` chunks in
    flight."""
    dtype = _file_dtype(tokenizer)
    if workers <= 1 or not _pickles(tokenizer):  # a tokenizer that cannot travel: this process
        for chunk in chunks:
            yield _pack_chunk(tokenizer, list(chunk), dtype)
        return
    methods = multiprocessing.get_all_start_methods()
    context = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
    with ProcessPoolExecutor(workers, mp_context=context) as pool:
        pending: deque[Future[PackedChunk]] = deque()
        for chunk in chunks:
            pending.append(pool.submit(_pack_chunk, tokenizer, list(chunk), dtype))
            if len(pending) >= 2 * workers:
                yield _result(pending.popleft())
        while pending:
            yield _result(pending.popleft())


def _pickles(tokenizer: Tokenizer) -> bool:
    try:
        pickle.dumps(tokenizer)
    except (pickle.PicklingError, AttributeError, TypeError):
        return False
    return True


def _file_dtype(tokenizer: Tokenizer) -> np.dtype:
    return np.dtype(np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32)


def _pack_chunk(tokenizer: Tokenizer, documents: list[Document], dtype: np.dtype) -> PackedChunk:
    try:
        return pack_chunk(tokenizer, documents, dtype)
    except DataError as err:
        raise _WorkerDataError(err.message) from None


class _WorkerDataError(Exception):
    """A :class:`DataError` carried back from a worker (plain args, so it pickles)."""


def _result(future: Future[PackedChunk]) -> PackedChunk:
    try:
        return future.result()
    except _WorkerDataError as err:
        raise DataError(str(err.args[0])) from None
