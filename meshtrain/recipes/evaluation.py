"""``[eval]`` during training, and what a finished run answers: ``meshtrain eval RUN_DIR`` and
``meshtrain generate RUN_DIR --prompt TEXT`` (:mod:`meshtrain.recipes.generation`).

During training (:class:`Evaluator`, on every rank): every ``[eval] every`` steps and at the last
step, the validation loss and perplexity over ``[eval] batches`` global batches of the held-out
data, on the run's own plan, pipelined ones included (:func:`meshtrain.train.evaluate.evaluate`),
logged to every sink as ``val_loss`` and ``val_perplexity``.

After training (:func:`load_run`, one process, no process group): the run's recipe is read from
its newest intact checkpoint, the model built on one device and its full weights read from that
checkpoint — whatever plan and mesh trained it (the checkpoint stores full-tensor names).
:func:`evaluate_run` computes the same validation loss.

Example::

    run = load_run("runs/debug")
    result, what = evaluate_run(run, batches=2)
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any

import torch
from torch import nn

from meshtrain.errors import CheckpointError, RecipeError
from meshtrain.lower.context.parallel import positions_keyword
from meshtrain.plan.ir import Plan
from meshtrain.plan.layers import main_output
from meshtrain.recipes.data import data_directory
from meshtrain.recipes.recipe import Recipe, recipe_from_data
from meshtrain.train.checkpoint import find_resume_point
from meshtrain.train.checkpoint.files import checkpoint_step, read_state_file
from meshtrain.train.data import DistributedBatches, TokenFile, TokenWindows
from meshtrain.train.data.documents import FILE_SOURCES
from meshtrain.train.data.packed import PackedWindows
from meshtrain.train.evaluate import EvalResult, evaluate
from meshtrain.train.hf.export import CheckpointTensors
from meshtrain.train.loss import IGNORE_INDEX
from meshtrain.train.metrics import Sinks

__all__ = ["Evaluator", "LoadedRun", "evaluate_run", "load_run"]


def validation_batch(recipe: Recipe, sequences: int, dp_size: int, pipelined: bool) -> int:
    """The global batch ``[eval]`` draws from a validation split of ``sequences``: the training
    batch, or fewer when the split is smaller (a multiple of the ``dp_size`` data-parallel
    ranks); a :class:`RecipeError` when that leaves no sequence for a rank, or when a pipelined
    plan (which evaluates whole training batches) has fewer than one. The launcher asks the
    same before any rank starts."""
    batch = min(recipe.train.batch_size, sequences // dp_size * dp_size)
    if pipelined and batch < recipe.train.batch_size:
        raise RecipeError(
            f"{recipe.source}: a pipelined plan evaluates whole training batches (the "
            f"stages' buffers have their shape), and the validation split has "
            f"{sequences} sequences of {recipe.train.seq_len} tokens, fewer than "
            f"train.batch_size = {recipe.train.batch_size}. Raise data.validation."
        )
    if batch < dp_size:
        raise RecipeError(
            f"{recipe.source}: the validation split has {sequences} sequences of "
            f"{recipe.train.seq_len} tokens, fewer than the {dp_size} data-parallel ranks. "
            "Raise data.validation."
        )
    return batch


class Evaluator:
    """Validation during a run: :meth:`after_step` evaluates when ``[eval] every`` says so (and
    at the last step) and logs the result to every sink. Built on every rank alike."""

    def __init__(
        self,
        recipe: Recipe,
        plan: Plan,
        model: Any,
        validation: Any,
        dp_rank: int,
        dp_size: int,
        sinks: Sinks,
    ) -> None:
        self.every, self.limit = recipe.eval.every, recipe.eval.batches
        self.plan, self.model, self.sinks = plan, model, sinks
        self.loader = None
        if self.every and validation is None:
            raise RecipeError(
                f"{recipe.source}: [eval] every = {self.every} needs held-out data, and "
                f"data.source = {recipe.data.source!r} has none. Set data.validation (e.g. 0.01) "
                "with a file source (jsonl, text, parquet, hf-dataset), or use synthetic data."
            )
        if self.every:
            batch = validation_batch(recipe, len(validation), dp_size, plan.pipeline is not None)
            self.loader = DistributedBatches(
                validation, batch, dp_rank, dp_size, seed=0, shuffle=False
            )

    def after_step(self, step: int, last: bool) -> EvalResult | None:
        if self.loader is None or not (step % self.every == 0 or last):
            return None
        limit = min(self.limit, self.loader.steps_per_epoch)  # each held-out sample once
        result = evaluate(self.plan, self.model, self.loader.batches(), batches_limit=limit)
        for sink in self.sinks.sinks:
            sink.log(step, result.metrics())
        return result


@dataclass(frozen=True)
class LoadedRun:
    """A run's recipe, its newest intact checkpoint and the model with that checkpoint's weights
    on one device."""

    recipe: Recipe
    checkpoint: Path
    model: nn.Module
    seconds: float
    passed_over: tuple[str, ...] = ()  # newer checkpoints not used, one line each with why

    @property
    def step(self) -> int:
        return checkpoint_step(self.checkpoint)


def load_run(run_dir: str | Path, *, trust_factory: str | None = None) -> LoadedRun:
    """The run in ``run_dir`` (or its checkpoints directory), loaded on one process. A recipe
    recorded in a checkpoint is data, not code: a model factory it names
    (``[model] factory = "module:function"``) is imported only when ``trust_factory`` names the
    same factory (``--trust-factory``); a checkpoint can come from anyone."""
    started = time.perf_counter()
    root = Path(run_dir)
    directory = root / "checkpoints" if (root / "checkpoints").is_dir() else root
    if not directory.is_dir():
        raise CheckpointError(
            f"{str(root)!r} is not a directory: give a run directory (logging.run_dir, e.g. "
            "runs/debug) or its checkpoints directory."
        )
    point = find_resume_point(directory)
    if point.checkpoint is None:
        raise CheckpointError(
            f"no intact checkpoint in {str(directory)!r}: train the run first (`meshtrain "
            "checkpoints DIR` lists what is there)."
        )
    extra = read_state_file(point.checkpoint).get("extra", {})
    raw = extra.get("recipe")
    if not isinstance(raw, dict):
        raise CheckpointError(f"{point.checkpoint} records no recipe; it was not saved by a run.")
    raw = _paths_from(raw, extra.get("run", {}).get("launched_from"))
    _check_factory(raw, point.checkpoint, trust_factory)  # before the recipe imports it
    # the run directory is where the user found it, not where the recorded (maybe relative)
    # path points from the current directory: its data is read from there
    run_root = root if directory != root else directory.parent
    raw = {**raw, "logging": {**raw.get("logging", {}), "run_dir": str(run_root.resolve())}}
    recipe = recipe_from_data(raw, f"{point.checkpoint} (the run's recipe)")
    seed = recipe.train.seed
    model = recipe.adapt(recipe.build_model(device="cpu", seed=seed, adapters=False), seed=seed)
    names = list(model.state_dict())
    tensors = CheckpointTensors(point.checkpoint)
    _check_same_model(point.checkpoint, model, tensors)
    model.load_state_dict(tensors.read(names))
    model.eval()
    seconds = time.perf_counter() - started
    return LoadedRun(recipe, point.checkpoint, model, seconds, tuple(point.describe_passed_over()))


#: recipe keys holding a path that a run reads again (evaluation, generation, export)
_PATH_KEYS = (("data", "path"), ("data", "tokenizer"), ("model", "hf"), ("checkpoint", "init_from"))


def _paths_from(raw: dict[str, Any], launched_from: object) -> dict[str, Any]:
    """The recorded recipe with each relative path of :data:`_PATH_KEYS` made absolute from
    the directory the run was launched in (when it is there): a run read from another
    directory, or after its run directory moved, finds its data, tokenizer and model.

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as launch:
        ...     (Path(launch) / "data").mkdir()
        ...     found = _paths_from({"data": {"path": "data", "tokenizer": "byte"}}, launch)
        ...     found["data"]["path"] == str(Path(launch) / "data"), found["data"]["tokenizer"]
        (True, 'byte')
    """
    if not isinstance(launched_from, str) or not launched_from:
        return raw
    found = dict(raw)
    for section, key in _PATH_KEYS:
        table = found.get(section)
        value = table.get(key) if isinstance(table, dict) else None
        if not isinstance(value, str) or not value or Path(value).is_absolute():
            continue
        candidate = Path(launched_from) / value
        if candidate.exists():
            found[section] = {**found[section], key: str(candidate)}
    return found


def _check_same_model(checkpoint: Path, model: nn.Module, tensors: CheckpointTensors) -> None:
    """Every tensor the model has, in the checkpoint with the same shape; else one line naming
    the first few that differ (it used to end in load_state_dict's RuntimeError)."""
    state = model.state_dict()
    missing = [name for name in state if name not in tensors]
    shapes = {
        name: (tuple(tensors.entries[name].size), tuple(state[name].shape))
        for name in state
        if name in tensors and tuple(tensors.entries[name].size) != tuple(state[name].shape)
    }
    if not missing and not shapes:
        return
    shown = [f"{name!r} missing" for name in missing[:3]] + [
        f"{name!r} saved {list(saved)}, the recipe's model {list(wanted)}"
        for name, (saved, wanted) in list(shapes.items())[:3]
    ]
    raise CheckpointError(
        f"{checkpoint} does not hold the model its recorded recipe builds: {len(missing)} "
        f"tensors missing and {len(shapes)} of another shape ({'; '.join(shown)}). It was saved "
        "from another model, or its recipe was changed."
    )


def _check_factory(raw: dict[str, Any], checkpoint: Path, trusted: str | None) -> None:
    """Refuse to import a model factory that only the checkpoint's recorded recipe names."""
    model = raw.get("model")
    factory = model.get("factory") if isinstance(model, dict) else None
    if factory and factory != trusted:
        raise CheckpointError(
            f"{checkpoint} records a model built by the factory {factory!r} ([model] factory in "
            "the run's recipe); meshtrain does not import code a checkpoint names, since a "
            "checkpoint can come from anyone. If you trust that module, name it yourself: "
            f"--trust-factory {factory}" + (f" (you named {trusted!r})." if trusted else ".")
        )


def evaluate_run(run: LoadedRun, *, batches: int | None = None) -> tuple[EvalResult, str]:
    """The validation loss of a loaded run over ``batches`` batches (``[eval] batches`` by
    default), on one process; and which data it read."""
    recipe = run.recipe
    dataset, what = _held_out(recipe)
    size = min(recipe.train.batch_size, len(dataset))
    loader = DistributedBatches(dataset, size, 0, 1, seed=0, shuffle=False)
    limit = batches or recipe.eval.batches
    loss_sum, tokens = 0.0, 0
    with torch.no_grad():
        for batch in islice(loader.batches(), min(limit, loader.steps_per_epoch)):
            # packed documents attending within themselves ([data] document_mask)
            keywords: dict[str, torch.Tensor] = {}
            if batch.token_positions is not None:
                keywords = {positions_keyword(run.model): batch.token_positions}
            logits = main_output(run.model(batch.inputs, **keywords)).float()
            loss_sum += float(
                nn.functional.cross_entropy(
                    logits.flatten(0, -2), batch.targets.flatten(), reduction="sum"
                )
            )
            tokens += int((batch.targets != IGNORE_INDEX).sum())
    loss = loss_sum / max(tokens, 1)
    return EvalResult(loss, math.exp(min(loss, 80.0)), tokens), what


def _held_out(recipe: Recipe) -> tuple[Any, str]:
    data, seq_len = recipe.data, recipe.train.seq_len
    if data.source in FILE_SOURCES:
        directory = data_directory(recipe)
        if data.validation > 0 and (directory / "validation").is_dir():
            validation = directory / "validation"
            return (
                PackedWindows(validation, seq_len, document_positions=data.document_mask),
                f"the validation split ({validation})",
            )
        train = PackedWindows(directory / "train", seq_len, document_positions=data.document_mask)
        return train, f"the training data, no split ({directory / 'train'})"
    if data.source in ("corpus", "tokens"):
        where = f"the training data, no split ({data.path})"
        return TokenWindows(TokenFile(data.path), seq_len), where
    raise RecipeError(
        f"{recipe.source}: data.source = {data.source!r} keeps no data on disk to evaluate on. "
        "Evaluate during training with [eval], or train on files with data.validation."
    )
