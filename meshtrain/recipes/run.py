"""The training loop a recipe describes: plan, data, train step, checkpoints and metrics.

:func:`train` runs on every rank of an initialised process group (``meshtrain train`` under
``torchrun``, or any SPMD launcher) and does, in this order: build the model on full tensors from
the recipe's seed (or a safetensors file), plan it, check that every rank has the same plan
(:mod:`~meshtrain.train.fingerprint`), apply it, resume from the latest complete checkpoint when
there is one (under whatever mesh this run has: DCP reshards), then train, logging every step and
saving at the recipe's interval and at the end.

Example (on every rank)::

    result = train(load_recipe("debug", ["train.steps=20"]))
    result.losses[-1]
"""

from __future__ import annotations

import base64
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from meshtrain.errors import RecipeError
from meshtrain.lower import apply
from meshtrain.plan.api import plan as make_plan
from meshtrain.plan.ir import Plan
from meshtrain.recipes.models import flops_per_token, vocab_size
from meshtrain.recipes.recipe import Recipe
from meshtrain.spec.mesh import make_mesh
from meshtrain.train.batch import Batch, DataPosition
from meshtrain.train.checkpoint import (
    CheckpointConfig,
    Checkpointer,
    export_safetensors,
    latest_checkpoint,
    load_checkpoint,
    load_safetensors,
)
from meshtrain.train.data import (
    DistributedBatches,
    SyntheticTokens,
    TokenFile,
    TokenWindows,
    prepare_corpus,
)
from meshtrain.train.fingerprint import check_same_plan
from meshtrain.train.loss import data_parallel_rank, summed_cross_entropy
from meshtrain.train.metrics import LoggingConfig, make_sinks
from meshtrain.train.schedule import WarmupCosine
from meshtrain.train.state import TrainState
from meshtrain.train.step import make_train_step
from meshtrain.train.throughput import Throughput


@dataclass(frozen=True)
class RunResult:
    """What a run did, on every rank: the global loss of each step it trained (by step number),
    the step it resumed from (``None`` for a fresh start), its last checkpoint and run dir."""

    losses: dict[int, float]
    resumed_from: int | None
    checkpoint: Path | None
    run_dir: Path
    fingerprint: str


def train(
    recipe: Recipe, *, device: torch.device | None = None, stop_after: int | None = None
) -> RunResult:
    """Train ``recipe`` on this process group (see the module docstring).

    ``stop_after`` ends this run after that many steps (with a checkpoint), as a job with a time
    limit would; the schedule still runs to ``train.steps``, and the next run resumes there.
    """
    device = device or torch.device("cpu")
    rank = dist.get_rank()
    mesh = make_mesh(recipe.mesh_axes())
    model = _build_model(recipe, device)
    plan = make_plan(model, mesh, recipe.rules(), **recipe.plan_options())
    fingerprint = check_same_plan(plan.to_json(), recipe.raw)
    applied = apply(plan, model)
    optimizer = recipe.optimizer_fn()(applied.parameters())
    train_cfg = recipe.train
    schedule = WarmupCosine(train_cfg.lr, train_cfg.warmup_steps, train_cfg.steps,
                            train_cfg.min_lr)  # fmt: skip
    step_fn = make_train_step(plan, summed_cross_entropy, optimizer, schedule,
                              max_norm=train_cfg.max_norm,
                              on_nonfinite=train_cfg.on_nonfinite)  # type: ignore[arg-type]  # fmt: skip
    state = TrainState.create(applied, optimizer)
    checkpointer = Checkpointer(
        CheckpointConfig(
            directory=recipe.checkpoint_dir,
            interval=recipe.checkpoint.interval,
            keep_last=recipe.checkpoint.keep_last,
            async_save=recipe.checkpoint.async_save,
        )
    )
    resumed_from = None
    latest = latest_checkpoint(recipe.checkpoint_dir) if recipe.checkpoint.resume else None
    if latest is not None:
        state = _restore(state, load_checkpoint(latest, state.params, optimizer))
        resumed_from = state.step
    dp_rank, dp_size = data_parallel_rank(plan)
    loader = DistributedBatches(_dataset(recipe, model), recipe.train.batch_size, dp_rank, dp_size,
                                seed=recipe.data.seed, shuffle=recipe.data.shuffle)  # fmt: skip
    sinks = make_sinks(
        _logging_config(recipe), run_dir=recipe.run_dir, rank=rank,
        total_steps=train_cfg.steps, run_name=recipe.name,
    )  # fmt: skip
    sinks.start(config=recipe.raw, plan_text=plan.explain(), plan_json=plan.to_json())
    meter = Throughput(
        flops_per_token=flops_per_token(model, train_cfg.seq_len),
        device=device,
    )
    losses: dict[int, float] = {}
    saved: Path | None = latest
    failed = True
    try:
        for batch in loader.batches(state.data):
            if state.step >= train_cfg.steps or len(losses) == stop_after:
                break
            if device.type != "cpu":
                batch = Batch(batch.inputs.to(device), batch.targets.to(device), batch.position)
            state, metrics = step_fn(state, batch)
            losses[state.step] = metrics["loss"]
            sinks.log(state.step, meter.update(metrics))
            last = state.step == train_cfg.steps or len(losses) == stop_after
            if checkpointer.due(state.step) or last:
                extra = _extra(state, plan, fingerprint, recipe)
                saved = checkpointer.save(state.step, state.params, optimizer, extra)
                meter.reset_timer()  # saving is not step time
        checkpointer.wait()
        failed = False
    finally:
        sinks.close(failed=failed)
    if recipe.checkpoint.export and saved is not None:
        if rank == 0:
            export_safetensors(saved, Path(recipe.checkpoint.export))
        dist.barrier()
    return RunResult(losses, resumed_from, saved, recipe.run_dir, fingerprint)


def _build_model(recipe: Recipe, device: torch.device) -> torch.nn.Module:
    """Full tensors from the recipe's seed (identical on every rank), or from a safetensors file."""
    model = recipe.build_model(device=device, seed=recipe.train.seed)
    if recipe.checkpoint.init_from:
        load_safetensors(Path(recipe.checkpoint.init_from), model)
    return model


def _dataset(recipe: Recipe, model: torch.nn.Module) -> Any:
    data, seq_len = recipe.data, recipe.train.seq_len
    vocab = vocab_size(model)
    if vocab is None:
        raise RecipeError(
            f"{recipe.source}: the model reads no token ids (no vocab_size in its config, no "
            "nn.Embedding), so [data] has no vocabulary to draw or check tokens against. Train "
            "it from Python with your own batches, or give it an embedding."
        )
    if data.source == "synthetic":
        return SyntheticTokens(vocab, seq_len, data.samples, data.seed)
    path = Path(data.path)
    if data.source == "corpus":
        if int(os.environ.get("LOCAL_RANK", dist.get_rank())) == 0:
            prepare_corpus(path, tokenizer=data.tokenizer, limit_bytes=data.corpus_bytes)
        dist.barrier()
    tokens = TokenFile(path)
    if tokens.vocab_size > vocab:
        raise RecipeError(
            f"{recipe.source}: the token file {str(path)!r} was made with a {tokens.vocab_size}-"
            f"token vocabulary, but the model's is {vocab}. Use a model with a vocabulary of "
            "at least that size (--set model.vocab_size=...) or another tokenizer."
        )
    return TokenWindows(tokens, seq_len)


def _logging_config(recipe: Recipe) -> LoggingConfig:
    log = recipe.logging
    return LoggingConfig(console=log.console, jsonl=log.jsonl, wandb=log.wandb,
                         wandb_project=log.wandb_project, wandb_entity=log.wandb_entity or None,
                         log_every=log.log_every)  # fmt: skip


def _extra(state: TrainState, plan: Plan, fingerprint: str, recipe: Recipe) -> dict[str, Any]:
    """The JSON half of a checkpoint: everything but tensors."""
    return {
        "step": state.step,
        "data": state.data.to_json(),
        "rng": base64.b64encode(state.rng.numpy().tobytes()).decode(),
        "fingerprint": fingerprint,
        "mesh": {axis: plan.mesh.size(axis) for axis in plan.mesh.axis_names},
        "recipe": recipe.raw,
    }


def _restore(state: TrainState, extra: dict[str, Any]) -> TrainState:
    """The state a checkpoint's JSON half describes (tensors and the optimizer's
    hyper-parameters are already loaded in place)."""
    rng = torch.frombuffer(bytearray(base64.b64decode(extra["rng"])), dtype=torch.uint8).clone()
    return TrainState.create(state.model, state.optimizer, step=int(extra["step"]),
                             data=DataPosition.from_json(extra["data"]), rng=rng)  # fmt: skip
