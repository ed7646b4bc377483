"""A recipe's ``[data]``: the datasets it trains and evaluates on, and the user's files tokenised
once (with a progress bar) before ranks start.

:func:`prepare_recipe_data` runs in the launcher (one process, before any rank): it reads the
files ``[data] path`` names, tokenises them with the recipe's tokenizer and packs them into
``<run_dir>/data`` (:mod:`meshtrain.train.data.packed`), or reuses what an earlier run wrote. A
bad file is refused there, one line naming the file and line. :func:`recipe_datasets` opens the
train and validation datasets on every rank (local rank 0 prepares first when a rank was
started without the launcher, e.g. under ``torchrun`` directly).

Example::

    prepared = prepare_recipe_data(load_recipe("sft.toml"))   # in the launcher
    train_data, validation = recipe_datasets(recipe, vocab=32000)   # on each rank
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from meshtrain.errors import RecipeError
from meshtrain.recipes.recipe import Recipe
from meshtrain.train.data import SyntheticTokens, TokenFile, TokenWindows, prepare_corpus
from meshtrain.train.data.documents import FILE_SOURCES, DocumentSource
from meshtrain.train.data.packed import PackedWindows, PreparedData, prepare_documents
from meshtrain.train.data.tokenizer import Tokenizer, load_tokenizer

__all__ = [
    "check_file_keys",
    "data_directory",
    "prepare_recipe_data",
    "recipe_datasets",
    "recipe_tokenizer",
]


def data_directory(recipe: Recipe) -> Path:
    """Where a file source's packed tokens go: ``<run_dir>/data``."""
    return recipe.run_dir / "data"


def recipe_tokenizer(recipe: Recipe) -> Tokenizer:
    """The recipe's tokenizer: ``"byte"``, a ``tokenizer.json`` (or its directory), or
    ``"model"``: the ``[model] hf`` directory's."""
    name = recipe.data.tokenizer
    if name == "model":
        if not recipe.model.hf:
            raise RecipeError(
                f"{recipe.source}: data.tokenizer = 'model' reads the tokenizer of the [model] hf "
                "directory, and this recipe has none. Name a tokenizer.json, or 'byte'."
            )
        return load_tokenizer(recipe.model.hf)
    return load_tokenizer(name)


def document_source(recipe: Recipe) -> DocumentSource:
    data = recipe.data
    return DocumentSource(
        data.source, data.path, data.text_field, data.format, data.prompt_field, data.response_field
    )


def prepare_recipe_data(
    recipe: Recipe, *, say: Callable[[str], None] | None = None
) -> PreparedData:
    """Tokenise a file source into ``<run_dir>/data`` (or reuse it), showing a progress bar on a
    terminal and one line when done; see the module docstring."""
    say = say or _print
    tokenizer = recipe_tokenizer(recipe)
    _check_tokenizer_fits(recipe, tokenizer)
    started = time.perf_counter()
    with _ProgressBar(f"tokenising {recipe.data.path}") as progress:
        prepared = prepare_documents(
            document_source(recipe),
            tokenizer,
            data_directory(recipe),
            validation=recipe.data.validation,
            seed=recipe.data.seed,
            progress=progress,
        )
    train = TokenFile(prepared.train).info
    held_out = TokenFile(prepared.validation).info if prepared.validation else None
    what = "reused" if prepared.reused else f"tokenised in {time.perf_counter() - started:.1f} s"
    split = f", {held_out.num_documents} held out for validation" if held_out else ""
    say(
        f"data: {train.num_documents} documents, {train.num_tokens:,} tokens "
        f"({tokenizer.name}){split}; {what} → {prepared.train.parent}"
    )
    return prepared


def recipe_datasets(recipe: Recipe, vocab: int) -> tuple[Any, Any | None]:
    """The train dataset and the validation dataset (``None`` when the recipe has none), on a
    rank of an initialised process group."""
    import torch.distributed as dist

    data, seq_len = recipe.data, recipe.train.seq_len
    check_file_keys(recipe)
    if data.source == "synthetic":
        seed = data.seed + 1_000_003  # held-out sequences: another stream of the same law
        return (
            SyntheticTokens(vocab, seq_len, data.samples, data.seed),
            SyntheticTokens(vocab, seq_len, max(1, data.samples // 16), seed),
        )
    local_first = int(os.environ.get("LOCAL_RANK", dist.get_rank())) == 0
    if data.source in FILE_SOURCES:
        if local_first:
            prepare_recipe_data(recipe, say=lambda line: None)  # reuses the launcher's work
        dist.barrier()
        out = data_directory(recipe)
        validation = out / "validation" if data.validation > 0 else None
        _check_vocab(recipe, out / "train", vocab)
        documents = data.document_mask
        return (
            PackedWindows(out / "train", seq_len, document_positions=documents),
            PackedWindows(validation, seq_len, document_positions=documents)
            if validation
            else None,
        )
    path = Path(data.path)
    if data.source == "corpus":
        if local_first:
            prepare_corpus(path, tokenizer=data.tokenizer, limit_bytes=data.corpus_bytes)
        dist.barrier()
    _check_vocab(recipe, path, vocab)
    return TokenWindows(TokenFile(path), seq_len), None


def launch_datasets(recipe: Recipe) -> tuple[Any, Any | None]:
    """The train and validation windows the launcher prepared (file sources and the corpus;
    synthetic data as drawn), read without a process group or a vocabulary: for the sizes."""
    data, seq_len = recipe.data, recipe.train.seq_len
    if data.source == "synthetic":
        return SyntheticTokens(256, seq_len, data.samples, data.seed), None
    if data.source in FILE_SOURCES:
        out, documents = data_directory(recipe), data.document_mask
        validation = out / "validation" if data.validation > 0 else None
        return (
            PackedWindows(out / "train", seq_len, document_positions=documents),
            PackedWindows(validation, seq_len, document_positions=documents)
            if validation
            else None,
        )
    return TokenWindows(TokenFile(data.path), seq_len), None


def check_file_keys(recipe: Recipe) -> None:
    """``data.validation``, ``data.format`` and ``data.document_mask`` apply to file sources
    only: refuse them elsewhere rather than ignore them; and ``data.document_mask`` with a
    pipeline, whose stages do not pass positions on.

    Example:
        >>> from meshtrain.recipes import load_recipe
        >>> check_file_keys(load_recipe("debug", ["data.validation=0.1"]))
        Traceback (most recent call last):
        ...
        meshtrain.errors.RecipeError: ...data.validation = 0.1 applies to data.source jsonl, text, parquet or hf-dataset; data.source = 'corpus' reads no document files. Remove it, or train on files.
    """
    data = recipe.data
    if data.document_mask and recipe.parallel.pipeline is not None:
        raise RecipeError(
            f"{recipe.source}: data.document_mask = true needs each token's position in its "
            "document at every layer, and pipeline stages do not pass positions on: remove "
            "[parallel.pipeline] or set data.document_mask = false."
        )
    if data.source in FILE_SOURCES:
        return
    for key, value, default in (
        ("validation", data.validation, 0.0),
        ("format", data.format, "text"),
        ("document_mask", data.document_mask, False),
    ):
        if value != default:
            raise RecipeError(
                f"{recipe.source}: data.{key} = {value!r} applies to data.source "
                f"{', '.join(FILE_SOURCES[:-1])} or {FILE_SOURCES[-1]}; data.source = "
                f"{data.source!r} reads no document files. Remove it, or train on files."
            )


def _check_tokenizer_fits(recipe: Recipe, tokenizer: Tokenizer) -> None:
    """Before tokenising: the tokenizer's ids fit the model's vocabulary (a meta-device model)."""
    from meshtrain.recipes.models import vocab_size

    vocab = vocab_size(recipe.build_model(device="meta"))
    if vocab is not None and tokenizer.vocab_size > vocab:
        raise RecipeError(
            f"{recipe.source}: data.tokenizer = {recipe.data.tokenizer!r} has "
            f"{tokenizer.vocab_size} ids, more than the model's vocabulary of {vocab}. Use the "
            "model's own tokenizer (data.tokenizer = 'model' for [model] hf), or a model with a "
            "vocabulary that large."
        )


def _check_vocab(recipe: Recipe, path: Path, vocab: int) -> None:
    tokens = TokenFile(path)
    if tokens.vocab_size > vocab:
        raise RecipeError(
            f"{recipe.source}: the token file {str(path)!r} was made with a {tokens.vocab_size}-"
            f"token vocabulary, but the model's is {vocab}. Use a model with a vocabulary of "
            "at least that size (--set model.vocab_size=...) or another tokenizer."
        )


class _ProgressBar:
    """A rich progress bar of documents and tokens, on a terminal only; a no-op elsewhere."""

    def __init__(self, title: str) -> None:
        self.title = title
        self._bar: Any = None
        self._task: Any = None

    def __enter__(self) -> Callable[[int, int], None] | None:
        if not sys.stdout.isatty():
            return None
        from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        self._bar = Progress(
            SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), transient=True
        )
        self._bar.start()
        self._task = self._bar.add_task(self.title)
        return self._update

    def _update(self, documents: int, tokens: int) -> None:
        assert self._bar is not None and self._task is not None
        self._bar.update(
            self._task, description=f"{self.title}: {documents:,} documents, {tokens:,} tokens"
        )

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.stop()


def _print(line: str) -> None:
    print(line, flush=True)
