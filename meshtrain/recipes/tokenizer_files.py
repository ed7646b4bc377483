"""The tokenizer files an export carries, so ``transformers`` encodes and generates from the
exported directory directly.

A run whose ``[data] tokenizer`` is a ``tokenizer.json`` (or its directory) gets that file (and
the ``tokenizer_config.json`` / ``special_tokens_map.json`` beside it); a run on the byte
tokenizer gets a ``tokenizer.json`` that encodes exactly as :class:`ByteTokenizer` does — a
byte-level BPE without merges whose ids are the byte values — with NUL (id 0) as its
end-of-text token, also when the model came from a ``[model] hf`` directory (whose own tokenizer
files would encode other ids than the run trained on, so they are not copied). A run on the
model directory's tokenizer (``"model"``) gets that directory's files. Where the files are gone,
the export is refused before any weight is written (:func:`check_tokenizer_files`).

Example::

    check_tokenizer_files(recipe_raw)                    # before writing weights
    write_tokenizer_files(recipe_raw, Path("export/"))   # ['tokenizer.json', ...]
"""

from __future__ import annotations

import importlib
import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from meshtrain.errors import CheckpointError
from meshtrain.recipes.sections import DataSection

if TYPE_CHECKING:
    from meshtrain.recipes.recipe import Recipe

__all__ = [
    "MODEL_TOKENIZER_FILES",
    "byte_tokenizer_json",
    "check_tokenizer_files",
    "run_tokenizer",
    "write_tokenizer_files",
]

_BESIDE = ("tokenizer_config.json", "special_tokens_map.json")
#: A ``[model] hf`` directory's tokenizer files, copied when the run used them (``"model"``).
MODEL_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
)


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


def run_tokenizer(recipe: Recipe) -> str:
    """The recorded recipe's ``[data] tokenizer``: ``"byte"``, ``"model"`` or a path."""
    data = recipe.get("data", {}) if isinstance(recipe, dict) else {}
    name = data.get("tokenizer") if isinstance(data, dict) else None
    return str(name) if name else DataSection.tokenizer


def _model_directory(recipe: Recipe) -> Path | None:
    model = recipe.get("model", {}) if isinstance(recipe, dict) else {}
    hf = model.get("hf") if isinstance(model, dict) else None
    return Path(hf) if hf else None


def check_tokenizer_files(recipe: Recipe) -> None:
    """Refuse (a :class:`CheckpointError` naming the files and the fix) an export whose
    tokenizer files are gone, before it writes anything."""
    name, directory = run_tokenizer(recipe), _model_directory(recipe)
    if name == "byte":
        return
    if name == "model":
        found = directory is not None and any(
            (directory / file).is_file() for file in ("tokenizer.json", "tokenizer.model")
        )
        if not found:
            raise CheckpointError(
                f"the run's tokenizer is its model directory's ([data] tokenizer = 'model'), and "
                f"{str(directory)!r} holds no tokenizer.json or tokenizer.model, so the export "
                "would carry no tokenizer. Put the tokenizer files back there and export again."
            )
        return
    source = Path(name) / "tokenizer.json" if Path(name).is_dir() else Path(name)
    if not source.is_file():
        raise CheckpointError(
            f"the run's tokenizer {name!r} is gone, so the export would carry no tokenizer; "
            "restore it and export again."
        )


def write_tokenizer_files(recipe: Recipe, out_dir: Path) -> list[str]:
    """Write the run's tokenizer files into ``out_dir``; the names written (a run on its model
    directory's tokenizer: those files, copied with ``config.json``, so none here)."""
    name = run_tokenizer(recipe)
    if name == "model":
        return []
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
    shutil.copyfile(source, out_dir / "tokenizer.json")
    written = ["tokenizer.json"]
    for extra in _BESIDE:
        if (source.parent / extra).is_file():
            shutil.copyfile(source.parent / extra, out_dir / extra)
            written.append(extra)
    return written
