"""Training data: token files on disk, read through memory maps, in deterministic distributed batches.

Why: a training run must see every sample once per epoch, in an order that is reshuffled each
epoch yet identical on every rank, and must resume mid-epoch from a checkpoint exactly where it
stopped, even under another data-parallel degree. Tokens live in one flat binary file (``uint16``
or ``uint32``) read through :class:`numpy.memmap`, so opening a corpus costs nothing and a batch
touches only the pages it reads.

The pieces, bottom up:

- :func:`prepare_tokens` / :func:`prepare_corpus` write ``tokens.bin`` + ``tokens.json``
  atomically; :class:`TokenFile` opens and checks them.
- :class:`TokenWindows` (windows of a token file) and :class:`SyntheticTokens` (seeded random
  tokens) are map-style datasets of ``(inputs, targets)`` pairs.
- :class:`DistributedBatches` turns a dataset into this data-parallel rank's share of each global
  batch, as :class:`~meshtrain.train.batch.Batch` objects that carry the position after them.

Example:
    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as out_dir:
    ...     token_file = prepare_tokens(["hello world", "more text"], ByteTokenizer(), out_dir)
    ...     windows = TokenWindows(token_file, seq_len=4)
    ...     loader = DistributedBatches(windows, global_batch=2, dp_rank=0, dp_size=2, seed=0)
    ...     batch = next(loader.batches())
    >>> len(token_file), len(windows), loader.steps_per_epoch
    (22, 5, 2)
    >>> tuple(batch.inputs.shape), batch.position
    ((1, 4), DataPosition(epoch=0, step=1))
"""

from __future__ import annotations

import hashlib
import json
import operator
import os
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from meshtrain.files import replaced_atomically, write_text_atomically
from meshtrain.train.batch import Batch, DataPosition
from meshtrain.train.data.corpus import DataError, stdlib_documents, stdlib_source_description
from meshtrain.train.data.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer

__all__ = [
    "TOKENS_BIN",
    "TOKENS_JSON",
    "ByteTokenizer",
    "DataError",
    "DistributedBatches",
    "SyntheticTokens",
    "TokenDataset",
    "TokenFile",
    "TokenFileInfo",
    "TokenWindows",
    "prepare_corpus",
    "prepare_tokens",
]

TOKENS_BIN = "tokens.bin"
TOKENS_JSON = "tokens.json"
_FORMAT = "meshtrain-tokens"
_FORMAT_VERSION = 1
_WRITE_CHUNK_TOKENS = 1 << 20
_HASH_CHUNK_BYTES = 1 << 24
_BEGINNING = DataPosition()


@dataclass(frozen=True)
class TokenFileInfo:
    """The metadata ``tokens.json`` holds about ``tokens.bin``.

    ``source`` says which documents were tokenized; ``sha256`` is the hash of ``tokens.bin``.
    """

    num_tokens: int
    dtype: str
    tokenizer: str
    vocab_size: int
    eos_id: int
    num_documents: int
    sha256: str
    source: str
    format: str = _FORMAT
    format_version: int = _FORMAT_VERSION

    @property
    def itemsize(self) -> int:
        return int(np.dtype(self.dtype).itemsize)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def read(cls, meta_path: Path) -> TokenFileInfo:
        """Read and check ``tokens.json`` at ``meta_path`` (named in every error)."""
        hint = _rebuild_hint(meta_path.parent)
        try:
            data = json.loads(meta_path.read_text(encoding="utf-8"))
        except FileNotFoundError as err:
            raise DataError(
                f"no prepared token file at '{meta_path.parent}' ('{meta_path.name}' is missing; "
                f"an interrupted preparation leaves it so). {hint}"
            ) from err
        except (OSError, ValueError) as err:
            raise DataError(f"token metadata '{meta_path}' is unreadable ({err}). {hint}") from err
        if not isinstance(data, dict):
            data = {}
        if data.get("format") != _FORMAT or data.get("format_version") != _FORMAT_VERSION:
            raise DataError(
                f"token metadata '{meta_path}' has format {data.get('format')!r} version "
                f"{data.get('format_version')!r}, expected {_FORMAT!r} version "
                f"{_FORMAT_VERSION}. {hint}"
            )
        fields = cls.__dataclass_fields__
        wrong = [key for key, field in fields.items() if type(data.get(key)).__name__ != field.type]
        if wrong:
            raise DataError(
                f"token metadata '{meta_path}' lacks or mistypes field(s) {', '.join(wrong)}. {hint}"
            )
        info = cls(**{key: data[key] for key in fields})
        if info.dtype not in ("uint16", "uint32") or info.num_tokens < 1:
            raise DataError(
                f"token metadata '{meta_path}' has dtype {info.dtype!r} and {info.num_tokens} "
                f"tokens; expected uint16/uint32 and at least one token. {hint}"
            )
        return info


class TokenFile:
    """A prepared token file, opened read-only through a memory map.

    ``path`` is the directory :func:`prepare_tokens` wrote (or its ``tokens.bin`` /
    ``tokens.json``). Opening checks the metadata and that the binary holds exactly
    ``num_tokens × itemsize`` bytes, which catches truncated and half-written files; the sha256
    check over every byte runs only with ``verify=True`` (or :meth:`verify`), as it reads the
    whole file. ``tokens`` is the read-only :class:`numpy.memmap`. A token file pickles as its path,
    so data-loader workers reopen it instead of copying it.

    Example::

        token_file = TokenFile("data/stdlib-byte")
        token_file.tokens[:8]          # memmap slice: reads one page
    """

    def __init__(self, path: str | os.PathLike[str], *, verify: bool = False) -> None:
        given = Path(path)
        self.directory = given.parent if given.name in (TOKENS_BIN, TOKENS_JSON) else given
        self.bin_path = self.directory / TOKENS_BIN
        self.meta_path = self.directory / TOKENS_JSON
        self.info = TokenFileInfo.read(self.meta_path)
        try:
            size = self.bin_path.stat().st_size
        except FileNotFoundError as err:
            raise DataError(
                f"token file '{self.bin_path}' is missing although '{self.meta_path}' exists. "
                f"{_rebuild_hint(self.directory)}"
            ) from err
        expected = self.info.num_tokens * self.info.itemsize
        if size != expected:
            raise DataError(
                f"token file '{self.bin_path}' has {size} bytes but its metadata says "
                f"{self.info.num_tokens} {self.info.dtype} tokens ({expected} bytes): it is "
                f"truncated or was overwritten. {_rebuild_hint(self.directory)}"
            )
        self.tokens: np.memmap[Any, np.dtype[Any]] = np.memmap(
            self.bin_path, dtype=self.info.dtype, mode="r", shape=(self.info.num_tokens,)
        )
        if verify:
            self.verify()

    def __len__(self) -> int:
        return self.info.num_tokens

    @property
    def vocab_size(self) -> int:
        return self.info.vocab_size

    @property
    def eos_id(self) -> int:
        return self.info.eos_id

    def verify(self) -> None:
        """Raise :class:`DataError` unless ``tokens.bin`` hashes to the recorded sha256."""
        digest = hashlib.sha256()
        with open(self.bin_path, "rb") as stream:
            while chunk := stream.read(_HASH_CHUNK_BYTES):
                digest.update(chunk)
        if digest.hexdigest() != self.info.sha256:
            raise DataError(
                f"token file '{self.bin_path}' has sha256 {digest.hexdigest()[:16]}…, but "
                f"'{self.meta_path}' records {self.info.sha256[:16]}…: the file is corrupt. "
                f"{_rebuild_hint(self.directory)}"
            )

    def __reduce__(self) -> tuple[Any, ...]:
        return (TokenFile, (self.directory,))

    def __repr__(self) -> str:
        return (
            f"TokenFile('{self.directory}', {self.info.num_tokens} {self.info.dtype} tokens, "
            f"tokenizer={self.info.tokenizer!r})"
        )


def prepare_tokens(
    documents: Iterable[str],
    tokenizer: str | os.PathLike[str] | Tokenizer,
    out_dir: str | os.PathLike[str],
    *,
    source: str = "documents given to prepare_tokens",
) -> TokenFile:
    """Tokenize ``documents`` into ``out_dir/tokens.bin`` and describe them in ``tokens.json``.

    Every document is followed by ``tokenizer.eos_id`` (documents that encode to nothing are
    skipped). Tokens are ``uint16`` when the vocabulary has at most 65536 ids, else ``uint32``;
    they stream to disk in chunks, so the corpus never sits in memory. The write is atomic: the
    binary goes to a temporary file first, and ``tokens.json`` (written last, by rename) is what
    makes the directory valid, so a crash or an exception at any point leaves either the previous
    valid pair, or no ``tokens.json`` at all, never a half file that looks valid. Several
    processes must not prepare the same directory at once: prepare on one rank, then barrier.

    ``tokenizer`` is a :class:`Tokenizer` or what :func:`load_tokenizer` takes (``"byte"``, a
    ``tokenizer.json`` path), as for :func:`prepare_corpus`.

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as out_dir:
        ...     token_file = prepare_tokens(["ab", "c"], "byte", out_dir)
        ...     token_file.tokens.tolist(), token_file.info.dtype
        ([97, 98, 0, 99, 0], 'uint16')
    """
    if isinstance(tokenizer, str | os.PathLike):
        tokenizer = load_tokenizer(tokenizer)
    directory = Path(out_dir)
    directory.mkdir(parents=True, exist_ok=True)
    dtype = np.dtype(np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32)
    bin_path, meta_path = directory / TOKENS_BIN, directory / TOKENS_JSON
    with replaced_atomically(bin_path) as temp_path:
        with open(temp_path, "wb") as stream:
            num_tokens, num_documents, sha256 = _write_tokens(documents, tokenizer, dtype, stream)
        if num_tokens == 0:
            raise DataError(
                f"prepare_tokens('{directory}'): {source} gave no text to tokenize. Pass at "
                "least one non-empty document."
            )
        info = TokenFileInfo(
            num_tokens=num_tokens,
            dtype=dtype.name,
            tokenizer=tokenizer.name,
            vocab_size=tokenizer.vocab_size,
            eos_id=tokenizer.eos_id,
            num_documents=num_documents,
            sha256=sha256,
            source=source,
        )
        meta_path.unlink(missing_ok=True)  # until the new metadata lands, nothing looks valid
    write_text_atomically(meta_path, json.dumps(info.to_json(), indent=2, sort_keys=True) + "\n")
    return TokenFile(directory)


def prepare_corpus(
    out_dir: str | os.PathLike[str],
    tokenizer: str | os.PathLike[str] | Tokenizer = "byte",
    limit_bytes: int | None = None,
) -> TokenFile:
    """Tokenize the stdlib docstring corpus into ``out_dir``, or reuse it if already there.

    A token file already in ``out_dir`` is reused when it is intact (sha256 checked) and was built
    from the same corpus (Python version, stdlib path and ``limit_bytes``) with the same
    tokenizer; anything else is rebuilt. See :mod:`meshtrain.train.data.corpus` for the corpus.

    Example::

        token_file = prepare_corpus("data/stdlib-byte")   # ~1.7 M tokens, a few seconds once
        windows = TokenWindows(token_file, seq_len=256)
    """
    resolved = load_tokenizer(tokenizer) if isinstance(tokenizer, str | os.PathLike) else tokenizer
    source = stdlib_source_description(limit_bytes)
    wanted = (source, resolved.name, resolved.vocab_size, resolved.eos_id)
    try:
        existing = TokenFile(out_dir, verify=True)
        info = existing.info
        if (info.source, info.tokenizer, info.vocab_size, info.eos_id) == wanted:
            return existing
    except DataError:
        pass  # missing, damaged or stale: rebuild below
    return prepare_tokens(stdlib_documents(limit_bytes), resolved, out_dir, source=source)


class TokenDataset(Protocol):
    """A map-style dataset of ``(inputs, targets)`` int64 tensors of shape ``[seq_len]``."""

    @property
    def seq_len(self) -> int: ...

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]: ...


class TokenWindows:
    """Non-overlapping windows of a token file as ``(inputs, targets)`` samples.

    Sample ``i`` reads the ``seq_len + 1`` tokens starting at ``i × seq_len``: ``inputs`` are the
    first ``seq_len``, ``targets`` the last ``seq_len`` (the next token at every position).
    Consecutive windows share one boundary token, so no token is a target twice; the tail
    shorter than a window is unused. Only the memory-map pages of the window are read.

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as out_dir:
        ...     windows = TokenWindows(prepare_tokens(["abcdefg"], ByteTokenizer(), out_dir), 3)
        ...     inputs, targets = windows[1]
        >>> len(windows), inputs.tolist(), targets.tolist()
        (2, [100, 101, 102], [101, 102, 103])
    """

    def __init__(self, token_file: TokenFile | str | os.PathLike[str], seq_len: int) -> None:
        self.token_file = token_file if isinstance(token_file, TokenFile) else TokenFile(token_file)
        if seq_len < 1 or len(self.token_file) < seq_len + 1:
            raise DataError(
                f"TokenWindows('{self.token_file.directory}', seq_len={seq_len}): a window needs "
                f"seq_len + 1 tokens with seq_len >= 1, and the file has "
                f"{len(self.token_file)} tokens. Use a seq_len in [1, {len(self.token_file) - 1}] "
                "or prepare a bigger corpus."
            )
        self._seq_len = seq_len

    @property
    def seq_len(self) -> int:
        return self._seq_len

    @property
    def vocab_size(self) -> int:
        return self.token_file.vocab_size

    def __len__(self) -> int:
        return (len(self.token_file) - 1) // self._seq_len

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        position = _checked_index(index, len(self), self)
        start = position * self._seq_len
        window = self.token_file.tokens[start : start + self._seq_len + 1].astype(np.int64)
        tokens = torch.from_numpy(window)
        return tokens[:-1], tokens[1:]

    def __repr__(self) -> str:
        return f"TokenWindows({self.token_file!r}, seq_len={self._seq_len})"


@dataclass(frozen=True)
class SyntheticTokens:
    """Seeded random tokens with the interface of :class:`TokenWindows`, for benchmarks and tests.

    Sample ``i`` is a pure function of ``(seed, i)`` (NumPy's PCG64 seeded with both), so any rank
    can produce any sample without the others, in any order.

    Example:
        >>> data = SyntheticTokens(vocab_size=256, seq_len=8, n_samples=100, seed=0)
        >>> inputs, targets = data[3]
        >>> bool((inputs[1:] == targets[:-1]).all()), bool((data[3][0] == inputs).all())
        (True, True)
    """

    vocab_size: int
    seq_len: int
    n_samples: int
    seed: int

    def __post_init__(self) -> None:
        if min(self.vocab_size, self.seq_len, self.n_samples) < 1 or self.seed < 0:
            raise DataError(
                f"{self!r}: vocab_size, seq_len and n_samples must be >= 1 and seed >= 0. "
                "Pass positive sizes and a non-negative seed."
            )

    def __len__(self) -> int:
        return self.n_samples

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        position = _checked_index(index, self.n_samples, self)
        generator = np.random.default_rng([self.seed, position])
        window = generator.integers(0, self.vocab_size, size=self.seq_len + 1, dtype=np.int64)
        tokens = torch.from_numpy(window)
        return tokens[:-1], tokens[1:]


class DistributedBatches:
    """This data-parallel rank's share of every global batch, epoch after epoch.

    The semantics of :class:`torch.utils.data.DistributedSampler`, applied to global batches:

    - Each epoch visits a permutation of all sample indices drawn by a :class:`torch.Generator`
      seeded with ``(seed, epoch)``: reshuffled every epoch, identical on every rank and process
      (``shuffle=False`` keeps the natural order).
    - Global step ``k`` of an epoch takes ``permutation[k·B : (k+1)·B]`` (``B = global_batch``);
      the last ``len(dataset) mod B`` samples of the permutation, too few for a global batch, are
      dropped for that epoch (they differ from epoch to epoch). So every kept sample is seen
      exactly once per epoch, and ``steps_per_epoch = len(dataset) // B``.
    - Data-parallel rank ``r`` takes the strided slice ``[r::dp_size]`` of the global batch:
      ``B / dp_size`` sequences. Global sequence ``j`` sits on rank ``j mod dp_size``, row
      ``j // dp_size``; the global batch of a step, and its order, therefore do not depend on
      ``dp_size``, and a run resumed under another data-parallel degree sees the same batches.

    ``dp_rank``/``dp_size`` are the data-parallel coordinates (ranks that differ only along
    tensor or pipeline axes pass the same ones and get the same batch); nothing here issues a
    collective. Each :class:`~meshtrain.train.batch.Batch` carries the position after it, and
    ``batches(start=position)`` resumes exactly where that position left off. A dataset whose
    ``document_positions`` is true (:class:`~meshtrain.train.data.packed.PackedWindows` asked for
    them) also gives each batch its samples' ``positions(index)`` as ``token_positions``.

    Example:
        >>> data = SyntheticTokens(vocab_size=256, seq_len=4, n_samples=10, seed=0)
        >>> loader = DistributedBatches(data, global_batch=4, dp_rank=1, dp_size=2, seed=7)
        >>> loader.steps_per_epoch, loader.per_rank_batch
        (2, 2)
        >>> [batch.position.step for batch, _ in zip(loader.batches(), range(3))]
        [1, 0, 1]
    """

    def __init__(
        self,
        dataset: TokenDataset,
        global_batch: int,
        dp_rank: int,
        dp_size: int,
        *,
        seed: int,
        shuffle: bool = True,
    ) -> None:
        where = (
            f"DistributedBatches(global_batch={global_batch}, dp_rank={dp_rank}, dp_size={dp_size})"
        )
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise DataError(
                f"{where}: dp_rank must lie in [0, dp_size) with dp_size >= 1. Pass the rank's "
                "index along the data-parallel mesh axes and their total size."
            )
        if global_batch < 1 or global_batch % dp_size:
            raise DataError(
                f"{where}: the global batch of {global_batch} sequences cannot be split evenly "
                f"over {dp_size} data-parallel ranks. Use a global_batch that is a positive "
                f"multiple of dp_size={dp_size}."
            )
        if len(dataset) < global_batch:
            raise DataError(
                f"{where}: the dataset {dataset!r} has {len(dataset)} samples, fewer than one "
                f"global batch of {global_batch}. Use a global_batch of at most {len(dataset)}, "
                "a shorter seq_len, or a bigger corpus."
            )
        self.dataset = dataset
        self.global_batch = global_batch
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.shuffle = shuffle

    @property
    def steps_per_epoch(self) -> int:
        return len(self.dataset) // self.global_batch

    @property
    def per_rank_batch(self) -> int:
        return self.global_batch // self.dp_size

    def epoch_order(self, epoch: int) -> torch.Tensor:
        """The permutation of sample indices that ``epoch`` visits (identical on every rank)."""
        if not self.shuffle:
            return torch.arange(len(self.dataset))
        generator = torch.Generator().manual_seed(_epoch_seed(self.seed, epoch))
        return torch.randperm(len(self.dataset), generator=generator)

    def global_indices(self, position: DataPosition) -> list[int]:
        """Sample indices of the global batch that starts at ``position``, in global order."""
        epoch, step = self._checked_position(position)
        start = step * self.global_batch
        return self.epoch_order(epoch)[start : start + self.global_batch].tolist()

    def rank_indices(self, position: DataPosition) -> list[int]:
        """This rank's sample indices of the global batch that starts at ``position``."""
        return self.global_indices(position)[self.dp_rank :: self.dp_size]

    def batches(self, start: DataPosition = _BEGINNING) -> Iterator[Batch]:
        """This rank's batches from ``start`` on, forever (epochs follow one another).

        ``start`` is a position a previous batch carried (or the default, the very beginning);
        a checked position of ``(epoch, steps_per_epoch)`` means the start of ``epoch + 1``.
        """
        epoch, step = self._checked_position(start)
        return self._batches_from(epoch, step)

    def __iter__(self) -> Iterator[Batch]:
        return self.batches()

    def __repr__(self) -> str:
        return (
            f"DistributedBatches({self.dataset!r}, global_batch={self.global_batch}, "
            f"dp_rank={self.dp_rank}, dp_size={self.dp_size}, seed={self.seed}, "
            f"shuffle={self.shuffle})"
        )

    def _batches_from(self, epoch: int, step: int) -> Iterator[Batch]:
        while True:
            order = self.epoch_order(epoch)
            for current in range(step, self.steps_per_epoch):
                start = current * self.global_batch
                indices = order[start : start + self.global_batch][self.dp_rank :: self.dp_size]
                samples = [self.dataset[index] for index in indices.tolist()]
                inputs = torch.stack([inputs for inputs, _ in samples])
                targets = torch.stack([targets for _, targets in samples])
                positions = self._positions(indices.tolist())
                after = (
                    DataPosition(epoch, current + 1)
                    if current + 1 < self.steps_per_epoch
                    else DataPosition(epoch + 1, 0)
                )
                yield Batch(inputs, targets, after, positions)
            epoch, step = epoch + 1, 0

    def _positions(self, indices: list[int]) -> torch.Tensor | None:
        """The samples' token positions when the dataset gives them (packed windows with
        ``document_positions=True``), else ``None``."""
        if not getattr(self.dataset, "document_positions", False):
            return None
        positions = self.dataset.positions  # type: ignore[attr-defined]
        return torch.stack([positions(index) for index in indices])

    def _checked_position(self, position: DataPosition) -> tuple[int, int]:
        if position.epoch < 0 or not 0 <= position.step <= self.steps_per_epoch:
            raise DataError(
                f"data position {position} does not exist for {self!r}: epochs have "
                f"{self.steps_per_epoch} steps ({len(self.dataset)} samples // global batch "
                f"{self.global_batch}). Resume with the dataset and global_batch the position was "
                "recorded with."
            )
        if position.step == self.steps_per_epoch:
            return position.epoch + 1, 0
        return position.epoch, position.step


def _epoch_seed(seed: int, epoch: int) -> int:
    """A 63-bit generator seed for ``(seed, epoch)``; unlike ``seed + epoch`` (what
    DistributedSampler uses), distinct pairs never share a shuffle."""
    digest = hashlib.sha256(f"meshtrain-data:{seed}:{epoch}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def _checked_index(index: int, length: int, dataset: object) -> int:
    position = operator.index(index)
    if position < 0:
        position += length
    if not 0 <= position < length:
        raise IndexError(f"sample {index} is out of range for {dataset!r} of {length} samples")
    return position


def _write_tokens(
    documents: Iterable[str], tokenizer: Tokenizer, dtype: np.dtype[Any], stream: Any
) -> tuple[int, int, str]:
    """Stream encoded documents, each followed by eos, to ``stream``: (tokens, documents, sha256)."""
    digest = hashlib.sha256()
    eos_id = tokenizer.eos_id
    num_tokens = num_documents = 0
    pending: list[int] = []

    def flush() -> None:
        nonlocal num_tokens
        ids = np.asarray(pending, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= tokenizer.vocab_size):
            bad = int(ids[(ids < 0) | (ids >= tokenizer.vocab_size)][0])
            raise DataError(
                f"tokenizer {tokenizer.name!r} produced id {bad}, outside its vocabulary "
                f"[0, {tokenizer.vocab_size}), near document {num_documents}. Fix the tokenizer's "
                "vocab_size or its encode()."
            )
        data = ids.astype(dtype).tobytes()
        stream.write(data)
        digest.update(data)
        num_tokens += ids.size
        pending.clear()

    for document in documents:
        ids = tokenizer.encode(document)
        if not ids:
            continue
        pending.extend(ids)
        pending.append(eos_id)
        num_documents += 1
        if len(pending) >= _WRITE_CHUNK_TOKENS:
            flush()
    flush()
    return num_tokens, num_documents, digest.hexdigest()


def _rebuild_hint(directory: Path) -> str:
    return (
        f"Rebuild it with meshtrain.train.data.prepare_corpus('{directory}') (or prepare_tokens "
        "with your documents and tokenizer)."
    )
