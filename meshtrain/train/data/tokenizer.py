"""Tokenizers: text to token ids and back, with an end-of-document id.

Why: the data pipeline needs one small interface (:class:`Tokenizer`) so token files can be built
with the dependency-free :class:`ByteTokenizer` (256 ids, which fits the debug Llama's vocabulary
of 256) or, for real models, with a Hugging Face ``tokenizer.json`` through the optional
``tokenizers`` package, without the rest of the pipeline knowing which.

Example:
    >>> tokenizer = load_tokenizer("byte")
    >>> tokenizer.encode("héllo")
    [104, 195, 169, 108, 108, 111]
    >>> tokenizer.decode([104, 195, 169, 108, 108, 111])
    'héllo'
"""

from __future__ import annotations

import hashlib
import importlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from meshtrain.train.data.corpus import DataError

__all__ = [
    "ByteTokenizer",
    "HuggingFaceTokenizer",
    "Tokenizer",
    "TokenizerError",
    "load_tokenizer",
]

# End-of-text tokens of common Hugging Face tokenizers, tried in this order when none is named.
_KNOWN_EOS_TOKENS = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>", "<|eot_id|>", "[SEP]")


class TokenizerError(DataError):
    """A tokenizer that cannot be loaded, or ids it cannot decode."""


@runtime_checkable
class Tokenizer(Protocol):
    """What the data pipeline needs from a tokenizer.

    ``name`` identifies the tokenizer exactly (prepared token files record it, and are rebuilt
    when it changes); ids lie in ``[0, vocab_size)``; ``eos_id`` ends every document.
    """

    @property
    def name(self) -> str: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def eos_id(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


@dataclass(frozen=True)
class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, with NUL (id 0) as the end-of-document id.

    NUL never occurs in real text, so :meth:`encode` drops it from its input and id 0 is free to
    mean "end of document". Lone surrogates (not valid Unicode text) encode as ``?``.
    :meth:`decode` inverts :meth:`encode` exactly and shows invalid UTF-8 (a window cut through a
    multi-byte character) as U+FFFD instead of failing.

    Example:
        >>> tokenizer = ByteTokenizer()
        >>> tokenizer.encode("a\\x00b"), tokenizer.eos_id, tokenizer.vocab_size
        ([97, 98], 0, 256)
        >>> tokenizer.decode([0xC3])
        '�'
    """

    @property
    def name(self) -> str:
        return "byte"

    @property
    def vocab_size(self) -> int:
        return 256

    @property
    def eos_id(self) -> int:
        return 0

    def encode(self, text: str) -> list[int]:
        return list(text.replace("\x00", "").encode("utf-8", errors="replace"))

    def decode(self, ids: Sequence[int]) -> str:
        try:
            data = bytes(ids)
        except (ValueError, TypeError) as err:
            bad = next((i for i in ids if not (isinstance(i, int) and 0 <= i < 256)), None)
            raise TokenizerError(
                f"ByteTokenizer.decode: id {bad!r} is not a byte id in [0, 256). "
                "Decode ids produced by this tokenizer (vocab_size 256), or load the tokenizer "
                "the token file was built with."
            ) from err
        return data.decode("utf-8", errors="replace")


class HuggingFaceTokenizer:
    """A thin wrapper over a Hugging Face ``tokenizers`` ``tokenizer.json``.

    The optional ``tokenizers`` package is imported only here. Special tokens are neither added on
    :meth:`encode` (documents are joined with ``eos_id`` by the pipeline) nor skipped on
    :meth:`decode`. The end-of-document token is ``eos_token`` if given, else the first of
    ``<|end_of_text|>``, ``<|endoftext|>``, ``</s>``, ``<eos>``, ``<|eot_id|>``, ``[SEP]`` that
    the vocabulary has. ``name`` carries a hash of the file, so editing it invalidates token
    files built with the old one.

    Example::

        tokenizer = HuggingFaceTokenizer("llama3/tokenizer.json")
        ids = tokenizer.encode("hello world")
    """

    def __init__(self, path: str | os.PathLike[str], eos_token: str | None = None) -> None:
        self.path = Path(path)
        tokenizers = _import_tokenizers(self.path)
        try:
            self._tokenizer: Any = tokenizers.Tokenizer.from_file(str(self.path))
        except Exception as err:
            raise TokenizerError(
                f"cannot load Hugging Face tokenizer '{self.path}': {err}. Pass the path of a "
                "valid tokenizer.json (as saved by tokenizers' Tokenizer.save)."
            ) from err
        self._eos_id, self.eos_token = self._find_eos(eos_token)
        digest = hashlib.sha256(self.path.read_bytes()).hexdigest()[:16]
        self._name = f"hf:{self.path.name}:{digest}"

    @property
    def name(self) -> str:
        return self._name

    @property
    def vocab_size(self) -> int:
        return int(self._tokenizer.get_vocab_size(with_added_tokens=True))

    @property
    def eos_id(self) -> int:
        return self._eos_id

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tokenizer.decode(list(ids), skip_special_tokens=False))

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """:meth:`encode` of many texts at once, on all cores (the ``tokenizers`` thread pool)."""
        encodings = self._tokenizer.encode_batch(list(texts), add_special_tokens=False)
        return [list(encoding.ids) for encoding in encodings]

    def __repr__(self) -> str:
        return f"HuggingFaceTokenizer('{self.path}', eos_token={self.eos_token!r})"

    def _find_eos(self, eos_token: str | None) -> tuple[int, str]:
        candidates = (eos_token,) if eos_token is not None else _KNOWN_EOS_TOKENS
        for token in candidates:
            token_id = self._tokenizer.token_to_id(token)
            if token_id is not None:
                return int(token_id), token
        tried = ", ".join(repr(token) for token in candidates)
        raise TokenizerError(
            f"Hugging Face tokenizer '{self.path}' has no end-of-document token (tried {tried}). "
            "Pass eos_token= with a token its vocabulary has."
        )


def load_tokenizer(
    name_or_path: str | os.PathLike[str], *, eos_token: str | None = None
) -> Tokenizer:
    """The tokenizer ``"byte"`` names, or the Hugging Face tokenizer at a path.

    A path may be a ``tokenizer.json`` or a directory that holds one; ``eos_token`` picks its
    end-of-document token (see :class:`HuggingFaceTokenizer`).

    Example:
        >>> load_tokenizer("byte").name
        'byte'
    """
    if isinstance(name_or_path, str) and name_or_path == "byte":
        if eos_token is not None:
            raise TokenizerError(
                f"load_tokenizer('byte', eos_token={eos_token!r}): the byte tokenizer's "
                "end-of-document id is always 0 (NUL); drop eos_token."
            )
        return ByteTokenizer()
    path = Path(name_or_path)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise TokenizerError(
            f"unknown tokenizer '{name_or_path}': it is neither 'byte' nor the path of a "
            "Hugging Face tokenizer.json (or of a directory holding one). Use 'byte', or pass an "
            "existing tokenizer.json."
        )
    return HuggingFaceTokenizer(path, eos_token=eos_token)


def _import_tokenizers(path: Path) -> Any:
    try:
        return importlib.import_module("tokenizers")
    except ImportError as err:
        raise TokenizerError(
            f"loading Hugging Face tokenizer '{path}' needs the optional 'tokenizers' package, "
            "which is not installed: pip install tokenizers (or use the 'byte' tokenizer)."
        ) from err
