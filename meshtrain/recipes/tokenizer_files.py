"""The tokenizer files an export carries, so ``transformers`` encodes and generates from the
exported directory directly.

A run whose ``[data] tokenizer`` is a ``tokenizer.json`` (or its directory) gets that file (and
the ``tokenizer_config.json`` / ``special_tokens_map.json`` beside it); a run on the byte
tokenizer gets a ``tokenizer.json`` that encodes exactly as :class:`ByteTokenizer` does — a
byte-level BPE without merges whose ids are the byte values — with NUL (id 0) as its
end-of-text token. A run on ``[model] hf`` already copies its model directory's files.

Example::

    write_tokenizer_files(recipe_raw, Path("export/"))   # ['tokenizer.json', ...]
"""

from __future__ import annotations

import importlib
import json
import shutil
from pathlib import Path
from typing import Any

from meshtrain.errors import CheckpointError
from meshtrain.recipes.sections import DataSection

__all__ = ["byte_tokenizer_json", "write_tokenizer_files"]

_BESIDE = ("tokenizer_config.json", "special_tokens_map.json")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte (what the ByteLevel pre-tokenizer emits)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {byte: chr(char) for byte, char in zip(printable, chars, strict=True)}


def byte_tokenizer_json() -> str:
    """A ``tokenizer.json`` whose ids are UTF-8 byte values, as :class:`ByteTokenizer`'s are.

    Example:
        >>> from tokenizers import Tokenizer
        >>> tokenizer = Tokenizer.from_str(byte_tokenizer_json())
        >>> tokenizer.encode("héllo").ids, tokenizer.decode([104, 195, 169])
        ([104, 195, 169, 108, 108, 111], 'hé')
    """
    tokenizers = importlib.import_module("tokenizers")  # optional: the hf extra

    vocab = {char: byte for byte, char in _bytes_to_unicode().items()}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(
        add_prefix_space=False, use_regex=False
    )
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    return str(tokenizer.to_str())


def write_tokenizer_files(recipe: Any, out_dir: Path) -> list[str]:
    """Write the run's tokenizer files into ``out_dir``; the names written."""
    data = recipe.get("data", {}) if isinstance(recipe, dict) else {}
    model = recipe.get("model", {}) if isinstance(recipe, dict) else {}
    default = DataSection.tokenizer
    name = data.get("tokenizer", default) if isinstance(data, dict) else default
    if isinstance(model, dict) and model.get("hf") and name in ("model", "byte"):
        return []  # the model directory's own files are copied with config.json
    if name == "byte":
        (out_dir / "tokenizer.json").write_text(byte_tokenizer_json(), encoding="utf-8")
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "eos_token": _bytes_to_unicode()[0],
            "model_max_length": 1 << 30,
            "clean_up_tokenization_spaces": False,
        }
        (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
        return ["tokenizer.json", "tokenizer_config.json"]
    source = Path(name)
    source = source / "tokenizer.json" if source.is_dir() else source
    if not source.is_file():
        raise CheckpointError(
            f"the run's tokenizer {name!r} is gone, so the export has no tokenizer files; "
            "restore it and export again."
        )
    shutil.copyfile(source, out_dir / "tokenizer.json")
    written = ["tokenizer.json"]
    for extra in _BESIDE:
        if (source.parent / extra).is_file():
            shutil.copyfile(source.parent / extra, out_dir / extra)
            written.append(extra)
    return written
