"""The launcher's check of a prepared token file, before any rank starts (no torch).

``tokens.json`` must read as meshtrain's token metadata, ``tokens.bin`` must hold exactly
``num_tokens × itemsize`` bytes, hash to the recorded sha256, and hold no token id outside the
recorded vocabulary. Hashing reads the whole file, so it runs at most once per file version: the
verdict is cached next to the file (``.tokens.verified.json``), keyed by the file's size and
modification time, and a later launch of an unchanged file only stats it. Each failure is one
:class:`~meshtrain.errors.DataError` naming the file and what to do.

Example:
    >>> import json, tempfile
    >>> root = Path(tempfile.mkdtemp())
    >>> _ = (root / "tokens.bin").write_bytes(bytes([1, 0, 2, 0, 3, 0]))
    >>> meta = {"num_tokens": 3, "dtype": "uint16", "vocab_size": 4, "eos_id": 0,
    ...         "sha256": hashlib.sha256(bytes([1, 0, 2, 0, 3, 0])).hexdigest()}
    >>> _ = (root / "tokens.json").write_text(json.dumps(meta))
    >>> verify_token_file(root).cached, verify_token_file(root).cached
    (False, True)
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshtrain.errors import DataError
from meshtrain.files import refuse_link, write_text_atomically
from meshtrain.recipes.sections import DataSection

__all__ = ["TokenCheck", "check_recipe_tokens", "token_change", "verify_token_file"]

CACHE_FILE = ".tokens.verified.json"
_CHUNK_TOKENS = 1 << 22
_ITEMSIZE = {"uint16": 2, "uint32": 4}


@dataclass(frozen=True)
class TokenCheck:
    """A verified token file: its ``tokens.bin``, token count and whether the verdict was
    cached (nothing read but the file's size and modification time)."""

    path: Path
    num_tokens: int
    cached: bool


def _metadata(meta_path: Path) -> dict[str, Any]:
    fix = f"Prepare {str(meta_path.parent)!r} again (prepare_tokens or prepare_corpus)."
    try:
        data = json.loads(meta_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise DataError(f"token metadata {str(meta_path)!r} is unreadable ({err}). {fix}") from err
    types = {"num_tokens": int, "dtype": str, "vocab_size": int, "sha256": str}
    wrong = [
        key
        for key, kind in types.items()
        if not isinstance(data, dict) or not isinstance(data.get(key), kind)
    ]
    if wrong or data["dtype"] not in _ITEMSIZE:
        raise DataError(
            f"token metadata {str(meta_path)!r} lacks or mistypes {', '.join(wrong) or 'dtype'} "
            f"(it is not meshtrain's tokens.json). {fix}"
        )
    return data


def _scan(bin_path: Path, dtype: str) -> tuple[str, int, int]:
    """sha256 of the file, its largest token id and the first position holding it."""
    import numpy as np

    digest, largest, where, offset = hashlib.sha256(), -1, 0, 0
    with open(bin_path, "rb") as stream:
        while chunk := stream.read(_CHUNK_TOKENS * _ITEMSIZE[dtype]):
            digest.update(chunk)
            tokens = np.frombuffer(chunk, dtype=dtype)
            if tokens.size and int(tokens.max()) > largest:
                largest, where = int(tokens.max()), offset + int(tokens.argmax())
            offset += tokens.size
    return digest.hexdigest(), largest, where


def verify_token_file(directory: str | Path) -> TokenCheck:
    """Check the token directory ``directory`` (see the module docstring); raise
    :class:`DataError` naming the file on any mismatch."""
    root = Path(directory)
    meta = _metadata(root / "tokens.json")
    bin_path = root / "tokens.bin"
    fix = f"Prepare {str(root)!r} again (prepare_tokens or prepare_corpus)."
    try:
        stat = bin_path.stat()
    except OSError as err:
        raise DataError(f"token file {str(bin_path)!r} cannot be read ({err}). {fix}") from err
    expected = meta["num_tokens"] * _ITEMSIZE[meta["dtype"]]
    if stat.st_size != expected:
        raise DataError(
            f"token file {str(bin_path)!r} has {stat.st_size:,} bytes but tokens.json says "
            f"{meta['num_tokens']:,} {meta['dtype']} tokens ({expected:,} bytes): it was "
            f"truncated or overwritten. {fix}"
        )
    key = {
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
        "sha256": meta["sha256"],
        "vocab_size": meta["vocab_size"],
    }
    cache = root / CACHE_FILE
    refuse_link(cache)  # a cache read through a link could skip the scan; one written, clobber
    with contextlib.suppress(OSError, ValueError):
        if json.loads(cache.read_text()) == key:
            return TokenCheck(bin_path, meta["num_tokens"], cached=True)
    sha256, largest, where = _scan(bin_path, meta["dtype"])
    if sha256 != meta["sha256"]:
        raise DataError(
            f"token file {str(bin_path)!r} changed after it was prepared: its sha256 is "
            f"{sha256[:16]}…, tokens.json records {meta['sha256'][:16]}…. {fix}"
        )
    if largest >= meta["vocab_size"]:
        raise DataError(
            f"token file {str(bin_path)!r} holds token id {largest} at position {where:,} (token "
            f"index), outside its {meta['vocab_size']}-token vocabulary: an embedding would "
            f"read past its table. {fix}"
        )
    with contextlib.suppress(OSError):  # a read-only data directory is verified each launch
        write_text_atomically(cache, json.dumps(key))
    return TokenCheck(bin_path, meta["num_tokens"], cached=False)


def check_recipe_tokens(data: Mapping[str, Any]) -> TokenCheck | None:
    """Verify the recipe's prepared token file (``data.source = "tokens"``); ``None`` for other
    sources (a corpus is checked, and rebuilt when damaged, where the ranks prepare it)."""
    table = data.get("data")
    table = table if isinstance(table, Mapping) else {}
    kind = table.get("source", DataSection.source)
    path = table.get("path", DataSection.path)
    if kind != "tokens" or not isinstance(path, str):
        return None
    if not (Path(path) / "tokens.json").is_file():
        return None  # preflight refuses a missing token directory
    return verify_token_file(os.fspath(path))


def token_change(data: Mapping[str, Any]) -> str | None:
    """After a failed job: the recipe's token file, checked again, when it no longer matches
    (a rank reading a memory-mapped file that shrank under it dies by SIGBUS, before it can say
    why); ``None`` when it still matches or there is none."""
    try:
        check_recipe_tokens(data)
    except DataError as err:
        return f"the token data changed while the job ran: {err.message}"
    return None
