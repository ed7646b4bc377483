"""Documents tokenised once into packed token files with a loss mask, split into train and
validation, and read back as windows that never learn across a document boundary.

Why: real data arrives as documents of every length. Packing them end to end (each followed by
the end-of-document id) wastes no compute on padding, but a window then holds the end of one
document and the start of the next. The loss masks the boundary: the first token of every
document is never a target (it would be predicted from another document), and in the
instruction format neither is any prompt token (the model learns to answer, not to ask). The
mask lives beside the tokens (``loss_mask.bin``, one byte per token: 1 = a target that carries
loss). By default the models attend causally over the whole window, so a document's tokens
also see the documents before it in the window; with ``document_positions=True`` (the recipe's
``data.document_mask``) each sample also carries per-token positions that restart at every
document (:meth:`PackedWindows.positions`), and the models then attend only within each
document, as if it were alone (:mod:`meshtrain.spec.packing`).

:func:`prepare_documents` writes ``<out>/train`` and, with ``validation > 0``, ``<out>/validation``
(documents assigned by a seeded hash of their index, so the split is stable), and reuses them
when the files, fields, tokenizer and split are unchanged (file sizes and modification times are
part of the key). :class:`PackedWindows` reads them as ``(inputs, targets)`` samples, targets
masked with ``-100``; :class:`~meshtrain.train.data.DistributedBatches` resumes them at the
exact sample as it does any dataset.

Example:
    >>> import json, pathlib, tempfile
    >>> from meshtrain.train.data.documents import DocumentSource
    >>> from meshtrain.train.data.tokenizer import ByteTokenizer
    >>> with tempfile.TemporaryDirectory() as tmp:
    ...     rows = [{"prompt": "Q", "response": "ab"}, {"prompt": "Q", "response": "cd"}]
    ...     path = pathlib.Path(tmp, "d.jsonl")
    ...     _ = path.write_text("\\n".join(json.dumps(row) for row in rows))
    ...     source = DocumentSource("jsonl", str(path), format="instruction")
    ...     prepared = prepare_documents(source, ByteTokenizer(), pathlib.Path(tmp, "out"))
    ...     windows = PackedWindows(prepared.train, seq_len=7)
    ...     inputs, targets = windows[0]
    >>> inputs.tolist()
    [81, 97, 98, 0, 81, 99, 100]
    >>> targets.tolist()  # 'Q' is a prompt, and the second 'Q' starts another document
    [97, 98, 0, -100, 99, 100, 0]
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from meshtrain.files import replaced_atomically, write_text_atomically
from meshtrain.train.data.corpus import DataError
from meshtrain.train.data.documents import Document, DocumentSource, read_documents, source_files
from meshtrain.train.data.identity import (
    SourceFile,
    read_identity,
    source_identity,
    write_identity,
)
from meshtrain.train.data.loader import (
    TOKENS_BIN,
    TOKENS_JSON,
    TokenFile,
    TokenFileInfo,
    TokenWindows,
    _checked_index,
)
from meshtrain.train.data.pack_pool import default_workers, packed_chunks
from meshtrain.train.data.tokenizer import Tokenizer

__all__ = [
    "LOSS_MASK_BIN",
    "PackedWindows",
    "PreparedData",
    "prepare_documents",
    "restarting_positions",
]

LOSS_MASK_BIN = "loss_mask.bin"
_BATCH_DOCUMENTS = 512
#: ``progress(documents, tokens)`` after each batch of documents is tokenised.
Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class PreparedData:
    """The token directories :func:`prepare_documents` wrote (or reused)."""

    train: Path
    validation: Path | None
    reused: bool


def prepare_documents(
    source: DocumentSource,
    tokenizer: Tokenizer,
    out_dir: str | os.PathLike[str],
    *,
    validation: float = 0.0,
    seed: int = 0,
    progress: Progress | None = None,
    workers: int | None = None,
) -> PreparedData:
    """Tokenise ``source`` into ``out_dir/train`` (and ``out_dir/validation``), or reuse them.

    ``validation`` is the fraction of documents held out (0 for none); see the module docstring.
    A tokenizer without a batch encoder runs on ``workers`` processes (default:
    :func:`~meshtrain.train.data.pack_pool.default_workers`: this one for the byte tokenizer,
    whose ids are read as one array, up to 4 for a tokenizer encoding in Python on a source of
    4 MiB or more); the files are the same whatever the count.
    """
    if not 0.0 <= validation < 1.0:
        raise DataError(f"data.validation = {validation} must lie in [0, 1).")
    out = Path(out_dir)
    files = source_identity(source, read_identity(out))
    key = _cache_key(source, tokenizer, validation, seed, files)
    names = ("train", "validation") if validation > 0 else ("train",)
    if all(_matches(out / name, key) for name in names):
        write_identity(out, files)  # the stamps as they are now: the next check reads nothing
        return PreparedData(out / "train", out / "validation" if validation else None, True)
    writers = {name: _PackedWriter(out / name, tokenizer) for name in names}
    try:
        _tokenise(source, tokenizer, writers, validation, seed, progress, workers)
        for name, writer in writers.items():
            writer.finish(tokenizer, key, f"{source.kind} {source.path} ({name})")
    finally:
        for writer in writers.values():
            writer.close()
    write_identity(out, files)
    return PreparedData(out / "train", out / "validation" if validation else None, False)


def _tokenise(
    source: DocumentSource,
    tokenizer: Tokenizer,
    writers: dict[str, _PackedWriter],
    validation: float,
    seed: int,
    progress: Progress | None,
    workers: int | None,
) -> None:
    if getattr(tokenizer, "encode_batch", None) is None:  # a tokenizer in Python: processes
        if workers is None:
            size = sum(_stamp(path)[0] for path in source_files(source))
            workers = default_workers(tokenizer, size)
        _tokenise_on_pool(source, tokenizer, writers, validation, seed, progress, workers)
        return
    documents = tokens = 0
    batch: list[Document] = []

    def flush() -> None:
        nonlocal documents, tokens
        for index, (document, ids, prompt) in enumerate(_encoded(tokenizer, batch)):
            held_out = validation > 0 and _unit(seed, documents + index) < validation
            writers["validation" if held_out else "train"].add(ids, prompt, document)
            tokens += len(ids) + 1
        documents += len(batch)
        batch.clear()
        if progress is not None:
            progress(documents, tokens)

    for document in read_documents(source):
        batch.append(document)
        if len(batch) == _BATCH_DOCUMENTS:
            flush()
    flush()


def _tokenise_on_pool(
    source: DocumentSource,
    tokenizer: Tokenizer,
    writers: dict[str, _PackedWriter],
    validation: float,
    seed: int,
    progress: Progress | None,
    workers: int,
) -> None:
    """Chunks of documents encoded and packed on ``workers`` processes (:mod:`.pack_pool`),
    written in their order: the same files as one process."""
    documents = tokens = 0
    chunks = _chunks(read_documents(source), _BATCH_DOCUMENTS)
    for chunk in packed_chunks(tokenizer, chunks, workers=workers):
        if validation == 0:
            writers["train"].add_packed(chunk.tokens, chunk.mask, sum(map(bool, chunk.counts)))
        else:
            for index, (count, ids, mask) in enumerate(chunk.documents()):
                if count:
                    held_out = _unit(seed, documents + index) < validation
                    writers["validation" if held_out else "train"].add_packed(ids, mask, 1)
        tokens += sum(chunk.counts)
        documents += len(chunk.counts)
        if progress is not None:
            progress(documents, tokens)


def _chunks(documents: Iterable[Document], size: int) -> Iterator[list[Document]]:
    chunk: list[Document] = []
    for document in documents:
        chunk.append(document)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _encoded(
    tokenizer: Tokenizer, documents: Sequence[Document]
) -> Iterable[tuple[Document, list[int], int]]:
    """``(document, ids, prompt length)``; a tokenizer with ``encode_batch`` (Hugging Face's
    ``tokenizers``) encodes the batch on all cores."""
    encode = getattr(tokenizer, "encode_batch", None)
    texts = [document.text for document in documents]
    prompts = [document.prompt for document in documents]
    if encode is not None:
        text_ids, prompt_ids = encode(texts), encode(prompts)
    else:
        text_ids = [tokenizer.encode(text) for text in texts]
        prompt_ids = [tokenizer.encode(prompt) if prompt else [] for prompt in prompts]
    for document, ids, prompt in zip(documents, text_ids, prompt_ids, strict=True):
        yield document, [*prompt, *ids], len(prompt)


class _PackedWriter:
    """Streams documents (each followed by eos) and their loss mask into one token directory."""

    def __init__(self, directory: Path, tokenizer: Tokenizer) -> None:
        self._eos, self._vocab = tokenizer.eos_id, tokenizer.vocab_size
        self._out_dtype = np.dtype(np.uint16 if self._vocab <= 1 << 16 else np.uint32)
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        (directory / TOKENS_JSON).unlink(missing_ok=True)  # nothing looks valid until done
        self._scratch = [
            replaced_atomically(directory / name) for name in (TOKENS_BIN, LOSS_MASK_BIN)
        ]
        paths = [context.__enter__() for context in self._scratch]
        self._streams = [open(path, "wb") for path in paths]  # noqa: SIM115 (closed in close())
        self._digest = hashlib.sha256()
        self.tokens = self.documents = 0
        self._finished = False

    def add(self, ids: list[int], prompt: int, document: Document) -> None:
        if not ids[prompt:]:
            return  # an empty document (or an empty response) teaches nothing
        self._check(ids, document)
        mask = np.ones(len(ids) + 1, dtype=np.uint8)
        mask[: max(prompt, 1)] = 0  # the document's first token, and the prompt
        data = np.asarray([*ids, self._eos], dtype=self._out_dtype).tobytes()
        self._streams[0].write(data)
        self._streams[1].write(mask.tobytes())
        self._digest.update(data)
        self.tokens += len(ids) + 1
        self.documents += 1

    def add_packed(
        self, tokens: bytes | memoryview, mask: bytes | memoryview, documents: int
    ) -> None:
        """``documents`` already packed end to end
        (:func:`~meshtrain.train.data.pack_pool.pack_chunk`)."""
        self._streams[0].write(tokens)
        self._streams[1].write(mask)
        self._digest.update(tokens)
        self.tokens += len(mask)
        self.documents += documents

    def _check(self, ids: list[int], document: Document) -> None:
        bad = [token for token in ids if not 0 <= token < self._vocab]
        if bad:
            raise DataError(
                f"{document.where}: the tokenizer produced id {bad[0]}, outside its vocabulary "
                f"[0, {self._vocab}). Use the tokenizer the model was trained with."
            )

    def finish(self, tokenizer: Tokenizer, key: str, description: str) -> None:
        if self.tokens == 0:
            name = self.directory.name
            raise DataError(
                f"{description}: no document with text to train on reached the {name} split. "
                + ("Raise data.validation or add documents." if name == "validation" else "")
            )
        for stream in self._streams:
            stream.flush()
            stream.close()
        for context in self._scratch:
            context.__exit__(None, None, None)
        self._finished = True
        info = TokenFileInfo(
            num_tokens=self.tokens,
            dtype=self._out_dtype.name,
            tokenizer=tokenizer.name,
            vocab_size=tokenizer.vocab_size,
            eos_id=tokenizer.eos_id,
            num_documents=self.documents,
            sha256=self._digest.hexdigest(),
            source=key,
        )
        text = json.dumps(info.to_json(), indent=2, sort_keys=True) + "\n"
        write_text_atomically(self.directory / TOKENS_JSON, text)

    def close(self) -> None:
        if self._finished:
            return
        for stream in self._streams:
            stream.close()
        for context in self._scratch:
            context.__exit__(DataError, DataError("unfinished"), None)  # drops the scratch file


class PackedWindows(TokenWindows):
    """Non-overlapping windows of a packed token directory, targets masked by its loss mask.

    The windows of :class:`~meshtrain.train.data.TokenWindows` (sample ``i`` reads the
    ``seq_len + 1`` tokens from ``i × seq_len``); a target whose ``loss_mask.bin`` byte is 0 is
    ``-100``. ``document_positions=True`` makes
    :class:`~meshtrain.train.data.DistributedBatches` attach each window's
    :meth:`positions` to its batches (``Batch.token_positions``): attention then stays within
    each document.

    Example::

        windows = PackedWindows("runs/sft/data/train", seq_len=512, document_positions=True)
        inputs, targets = windows[0]      # targets == -100 at prompts and document starts
        windows.positions(0)              # 0, 1, ... restarting after each end-of-document id
    """

    def __init__(
        self, directory: str | os.PathLike[str], seq_len: int, *, document_positions: bool = False
    ) -> None:
        token_file = TokenFile(directory)
        mask_path = token_file.directory / LOSS_MASK_BIN
        if not mask_path.is_file() or mask_path.stat().st_size != len(token_file):
            raise DataError(
                f"'{mask_path}' is missing or does not match '{token_file.bin_path}' (one "
                "byte per token). Delete the directory; the next run tokenises the data again."
            )
        if seq_len < 1 or len(token_file) < seq_len + 1:
            raise DataError(
                f"'{token_file.directory}' holds {len(token_file)} tokens, fewer than "
                f"one window of train.seq_len + 1 = {seq_len + 1}. Add documents or shorten "
                "train.seq_len."
            )
        super().__init__(token_file, seq_len)
        self.mask = np.memmap(mask_path, dtype=np.uint8, mode="r", shape=(len(token_file),))
        self.document_positions = document_positions

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, targets = super().__getitem__(index)
        start = _checked_index(index, len(self), self) * self.seq_len
        keep = torch.from_numpy(self.mask[start + 1 : start + self.seq_len + 1].astype(bool))
        return inputs, targets.masked_fill(~keep, -100)

    def positions(self, index: int) -> torch.Tensor:
        """Each input token's position in its document (int64, ``[seq_len]``): 0 at the
        window's first token and after every end-of-document id, counting up in between. A
        document cut by the window's start counts from 0 there (the window holds no earlier
        token of it).

        Example:
            >>> import pathlib, tempfile
            >>> from meshtrain.train.data.tokenizer import ByteTokenizer
            >>> with tempfile.TemporaryDirectory() as tmp:
            ...     source = pathlib.Path(tmp, "d.jsonl")
            ...     _ = source.write_text('{"text": "abc"}\\n{"text": "de"}\\n')
            ...     prepared = prepare_documents(DocumentSource("jsonl", str(source)),
            ...                                  ByteTokenizer(), pathlib.Path(tmp, "out"))
            ...     windows = PackedWindows(prepared.train, seq_len=6)
            ...     windows[0][0].tolist(), windows.positions(0).tolist()
            ([97, 98, 99, 0, 100, 101], [0, 1, 2, 3, 0, 1])
        """
        inputs, _ = super().__getitem__(index)
        return restarting_positions(inputs, self.token_file.eos_id)

    def __repr__(self) -> str:
        documents = ", document_positions=True" if self.document_positions else ""
        return f"PackedWindows('{self.token_file.directory}', seq_len={self.seq_len}{documents})"


def restarting_positions(tokens: torch.Tensor, eos_id: int) -> torch.Tensor:
    """Positions of ``tokens`` (``[seq]``) that restart at 0 after every ``eos_id`` (which ends
    its document and keeps its position in it).

    Example:
        >>> restarting_positions(torch.tensor([7, 8, 0, 5, 0, 0, 6]), eos_id=0).tolist()
        [0, 1, 2, 0, 1, 0, 0]
    """
    index = torch.arange(tokens.shape[-1])
    starts = torch.zeros_like(index, dtype=torch.bool)
    starts[1:] = tokens[:-1] == eos_id
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(-1).values
    return index - first


def _unit(seed: int, index: int) -> float:
    """A number in [0, 1) fixed by ``(seed, index)``: which split a document falls in."""
    digest = hashlib.sha256(f"meshtrain-split:{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") / 2**64


def _cache_key(
    source: DocumentSource,
    tokenizer: Tokenizer,
    validation: float,
    seed: int,
    identity: Sequence[SourceFile],
) -> str:
    """What the prepared tokens were made from: the source's settings, the tokenizer, the split
    and each file's content (its sha256: an edit that keeps size and time is seen)."""
    files = [(file.path, file.size, file.sha256) for file in identity]
    described = json.dumps(
        [
            source.kind,
            source.path,
            source.fields(),
            source.format,
            tokenizer.name,
            validation,
            seed,
            files,
        ],
        sort_keys=True,
    )
    return f"{source.kind}:{source.path}:{hashlib.sha256(described.encode()).hexdigest()[:16]}"


def _stamp(path: Path) -> tuple[int, int]:
    if path.is_dir():  # a saved dataset: its newest file
        stats = [item.stat() for item in path.rglob("*") if item.is_file()]
        return sum(stat.st_size for stat in stats), max(stat.st_mtime_ns for stat in stats)
    stat = path.stat()
    return stat.st_size, stat.st_mtime_ns


def _matches(directory: Path, key: str) -> bool:
    try:
        token_file = TokenFile(directory)
    except DataError:
        return False
    mask = directory / LOSS_MASK_BIN
    return (
        token_file.info.source == key and mask.is_file() and mask.stat().st_size == len(token_file)
    )
