"""The training loop a recipe describes: plan, data, train step, checkpoints and metrics.

:func:`train` runs on every rank of an initialised process group (``meshtrain train`` under
``torchrun``, or any SPMD launcher) and does, in this order: lock the run directory (rank 0, for
the job; :mod:`~meshtrain.files.lock`), build the model on full tensors from the recipe's seed, plan
it, check that every rank has the same plan (:mod:`~meshtrain.train.fingerprint`), apply it, load
``[checkpoint] init_from`` into it (each rank its slices; :mod:`~meshtrain.recipes.pretrained`),
resume from the newest intact checkpoint when
there is one (under whatever mesh this run has: DCP reshards; damaged or unfinished ones are
passed over, one line each), then train, logging every step and saving at the recipe's interval
and at the end. A stop signal ends every rank after the same step with a checkpoint
(:mod:`~meshtrain.train.stop`); skipped steps are counted against the recipe's budget and never
checkpointed, and ``keep_last`` spares the last good checkpoint (:mod:`~meshtrain.train.guard`).

Example (on every rank)::

    result = train(load_recipe("debug", ["train.steps=20"]))
    result.losses[-1]
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshtrain.errors import CheckpointError, MeshtrainError, RecipeError, TrainingError
from meshtrain.files.lock import TOKEN_VARIABLE
from meshtrain.lower import PipelinedModel, apply, materialise
from meshtrain.plan.api import plan as make_plan
from meshtrain.plan.ir import Plan
from meshtrain.recipes.data import recipe_datasets
from meshtrain.recipes.evaluation import Evaluator
from meshtrain.recipes.models import flops_per_token, vocab_size
from meshtrain.recipes.preflight import check_run_files, lock_run
from meshtrain.recipes.pretrained import initialise_from
from meshtrain.recipes.progress import count_progress
from meshtrain.recipes.recipe import Recipe
from meshtrain.recipes.resume_guard import check_recipe_unchanged, recorded_data_files, run_id
from meshtrain.recipes.router_stats import router_metrics
from meshtrain.recipes.sections import TrainSection
from meshtrain.spec.mesh import Mesh, make_mesh
from meshtrain.train import heartbeat
from meshtrain.train.batch import DataPosition
from meshtrain.train.checkpoint import (
    Checkpointer,
    export_safetensors,
    find_resume_point,
    list_checkpoints,
    load_checkpoint,
)
from meshtrain.train.checkpoint.files import checkpoint_name, checkpoint_step
from meshtrain.train.checkpoint.integrity import inspect_checkpoint
from meshtrain.train.data import (
    DistributedBatches,
)
from meshtrain.train.fingerprint import check_same_plan
from meshtrain.train.guard import LastGood, SkipBudget, SkipGuard, SkipRecord
from meshtrain.train.loss import data_parallel_rank, summed_cross_entropy
from meshtrain.train.metrics import Sinks, make_sinks
from meshtrain.train.profiling import StepProfiler, summary_table
from meshtrain.train.replicas import verify_replicas
from meshtrain.train.scaler import LossScaler
from meshtrain.train.schedule import WarmupCosine
from meshtrain.train.state import TrainState
from meshtrain.train.step import make_train_step
from meshtrain.train.stop import GracefulStop, signal_name
from meshtrain.train.throughput import Throughput
from meshtrain.train.token_guard import TokenGuard


@dataclass(frozen=True)
class RunResult:
    """What a run did, on every rank: the global loss of each step it trained (by step number),
    the step it resumed from (``None`` for a fresh start), its last checkpoint and run dir, the
    plan's fingerprint, and the signal that stopped it early (``None`` when it was not)."""

    losses: dict[int, float]
    resumed_from: int | None
    checkpoint: Path | None
    run_dir: Path
    fingerprint: str
    stopped_by: str | None = None
    last_step: int = 0
    tally: RunTally | None = None


@dataclass(frozen=True)
class RunTally:
    """What the run's end-of-run summary reports: wall time from ``train`` to its end, the time
    and global tokens of the steps trained, the mean MFU where the device's peak is known, and the
    best validation loss with its step (``None`` without ``[eval]``)."""

    wall_s: float
    train_s: float
    tokens: int
    mfu: float | None = None
    best_eval: tuple[int, float] | None = None

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.train_s if self.train_s > 0 else 0.0


def train(
    recipe: Recipe,
    *,
    device: torch.device | None = None,
    stop_after: int | None = None,
    stop: GracefulStop | None = None,
) -> RunResult:
    """Train ``recipe`` on this process group (see the module docstring).

    ``stop_after`` ends this run after that many steps (with a checkpoint), as a job with a time
    limit would; the schedule still runs to ``train.steps``, and the next run resumes there.
    SIGTERM, SIGINT and SIGHUP stop every rank after the same step, with a checkpoint
    (:mod:`meshtrain.train.stop`), and the result names the signal; ``stop`` is a
    :class:`GracefulStop` whose handlers the caller installed (by default ``train`` installs its
    own while it runs, in the main thread).
    """
    device = device or torch.device("cpu")
    owned = stop is None
    stop = stop or GracefulStop()
    started = time.perf_counter()
    with _run_locks(recipe), stop.installed(enabled=owned):
        result = _train(recipe, device, stop_after, stop)
    if result.tally is None:
        return result
    tally = dataclasses.replace(result.tally, wall_s=time.perf_counter() - started)
    return dataclasses.replace(result, tally=tally)


def _train(
    recipe: Recipe, device: torch.device, stop_after: int | None, stop: GracefulStop
) -> RunResult:
    started = time.perf_counter()
    mesh = make_mesh(recipe.mesh_axes())
    plan, applied, model = start_model(recipe, mesh, device)
    announce(
        f"{recipe.name}: model built, planned and placed on {dist.get_world_size()} ranks in "
        f"{time.perf_counter() - started:.1f} s"
    )
    fingerprint = check_same_plan(plan.to_json(), recipe.raw)
    optimizer = recipe.optimizer_fn()(applied.parameters())
    train_cfg = recipe.train
    schedule = WarmupCosine(
        train_cfg.lr, train_cfg.warmup_steps, train_cfg.steps, train_cfg.min_lr, train_cfg.decay
    )
    step_fn = make_train_step(
        plan,
        summed_cross_entropy,
        optimizer,
        schedule,
        max_norm=train_cfg.max_norm,
        on_nonfinite=train_cfg.on_nonfinite,
        scaler=loss_scaler(train_cfg, plan),
    )
    state = TrainState.create(applied, optimizer)
    checkpointer = Checkpointer(recipe.checkpoint_config())
    budget = SkipBudget(train_cfg.max_consecutive_skips, train_cfg.max_total_skips)
    state, guard, last_good, resume = _resume(recipe, state, optimizer, checkpointer, budget)
    stop.arm()  # from here on a stop waits for a step boundary and saves
    dp_rank, dp_size = data_parallel_rank(plan)
    dataset, validation = _dataset(recipe, model)
    loader = DistributedBatches(
        dataset,
        recipe.train.batch_size,
        dp_rank,
        dp_size,
        seed=recipe.data.seed,
        shuffle=recipe.data.shuffle,
    )
    sinks = make_sinks(
        recipe.logging_config(),
        run_dir=recipe.run_dir,
        rank=dist.get_rank(),
        total_steps=train_cfg.steps,
        run_name=recipe.name,
        start_step=state.step,
    )
    sinks.start(config=recipe.raw, plan_text=plan.explain(), plan_json=plan.to_json())
    meter = Throughput(
        flops_per_token=flops_per_token(model, train_cfg.seq_len),
        device=device,
    )
    loop = _Loop(recipe, plan, fingerprint, checkpointer, guard, last_good, resume)
    loop.run_id = run_id(resume)
    loop.evaluator = Evaluator(recipe, plan, applied, validation, dp_rank, dp_size, sinks)
    loop.router = router_metrics(applied)
    if recipe.profile.steps:
        loop.profiler = StepProfiler(
            recipe.profile.steps,
            recipe.run_dir / "profile",
            rank=dist.get_rank(),
            memory=recipe.profile.memory,
        )
    loop.tokens = TokenGuard.of(dataset, vocab_size(model) or 0)
    failed = True
    try:
        state = loop.run(state, step_fn, loader, sinks, meter, stop, stop_after, device)
        failed = False
    finally:
        sinks.close(failed=failed)
    if recipe.checkpoint.export and loop.saved is not None and loop.stopped_by is None:
        if dist.get_rank() == 0:
            export_safetensors(loop.saved, Path(recipe.checkpoint.export))
        dist.barrier()
    resumed_from = checkpoint_step(resume) if resume is not None else None
    return RunResult(
        loop.losses,
        resumed_from,
        loop.saved,
        recipe.run_dir,
        fingerprint,
        loop.stopped_by,
        state.step,
        loop.tally(),
    )


class _Loop:
    """The steps of one run: train, log, count skipped steps, save on the interval (never right
    after a skipped step), and stop with a checkpoint when every rank agrees to."""

    def __init__(
        self,
        recipe: Recipe,
        plan: Plan,
        fingerprint: str,
        checkpointer: Checkpointer,
        guard: SkipGuard,
        last_good: LastGood,
        resume: Path | None,
    ) -> None:
        self.recipe, self.plan, self.fingerprint = recipe, plan, fingerprint
        self.checkpointer, self.guard, self.last_good = checkpointer, guard, last_good
        self.losses: dict[int, float] = {}
        self.saved = resume
        self.saved_step = checkpoint_step(resume) if resume is not None else 0
        self.stopped_by: str | None = None
        self.run_id = ""  # recorded in every checkpoint: the directory belongs to this run
        self.evaluator: Evaluator | None = None  # [eval]
        self.profiler: StepProfiler | None = None  # [profile]; None: nothing recorded
        self.router: Callable[[], dict[str, Any]] | None = None  # MoE router statistics
        self.tokens = TokenGuard(0, "")  # set by _train: the data's ids and file checked
        # a checkpoint is good once the run trained a whole interval past it with no skip
        self.confirm_steps = max(1, recipe.checkpoint.interval)
        self.train_s, self.tokens_seen = 0.0, 0  # the end-of-run summary's figures
        self.mfu: list[float] = []
        self.best_eval: tuple[int, float] | None = None

    def tally(self) -> RunTally:
        """The figures of the end-of-run summary (wall time filled in by :func:`train`)."""
        mfu = sum(self.mfu) / len(self.mfu) if self.mfu else None
        return RunTally(0.0, self.train_s, self.tokens_seen, mfu, self.best_eval)

    def run(
        self,
        state: TrainState,
        step_fn: Any,
        loader: DistributedBatches,
        sinks: Sinks,
        meter: Throughput,
        stop: GracefulStop,
        stop_after: int | None,
        device: torch.device,
    ) -> TrainState:
        """Train until ``train.steps``, ``stop_after`` steps, an agreed stop or a spent budget."""
        steps, due = self.recipe.train.steps, False
        batches = iter(loader.batches(state.data))
        started = time.perf_counter()
        while state.step < steps and len(self.losses) != stop_after:
            # one collective per step agrees on a stop, the token file (stat before the read)
            # and the batch's ids, every rank alike, before the step's collectives
            readable = self.tokens.before_read()
            batch = next(batches, None) if readable else None
            if reason := self.tokens.agree(batch, stop.requested, device):
                self.stopped_by = signal_name(reason)
                break
            if batch is None:
                break  # the data ended (on every rank alike)
            if device.type != "cpu":
                batch = batch.to(device)
            if self.profiler is not None:
                self.profiler.before(state.step + 1)
            state, metrics = step_fn(state, batch)
            if self.profiler is not None:
                self.profiler.after(state.step)
            heartbeat.progress(state.step)  # the watchdog's heartbeat names the step reached
            self.losses[state.step] = metrics["loss"]
            if self.router is not None:  # a collective: every rank, every step
                metrics = {**metrics, **self.router()}
            metrics = meter.update(metrics)
            sinks.log(state.step, metrics)
            self._count(state.step, metrics)
            self.tokens_seen += int(metrics.get("tokens", 0))
            if "mfu" in metrics and not metrics.get("warmup"):
                self.mfu.append(float(metrics["mfu"]))
            verify = self.recipe.train.verify_every
            if verify and state.step % verify == 0:  # before a save: never checkpoint a drift
                verify_replicas(self.plan, state.params, state.optimizer, step=state.step)
            last = state.step == steps or len(self.losses) == stop_after
            evaluated = self.evaluator.after_step(state.step, last) if self.evaluator else None
            if evaluated is not None:
                meter.reset_timer()  # evaluating is not step time
                if self.best_eval is None or evaluated.loss < self.best_eval[1]:
                    self.best_eval = (state.step, evaluated.loss)
            due = due or self.checkpointer.due(state.step) or last
            if due and self.guard.may_checkpoint:
                self._save(state)
                due = False
                meter.reset_timer()  # saving is not step time
        stopped = self.stopped_by is not None and self.guard.may_checkpoint
        if stopped and state.step > self.saved_step:
            self._save(state, wait=True)  # synchronous: the job is ending
        self.checkpointer.wait()
        self.train_s = time.perf_counter() - started
        if self.profiler is not None:
            self.profiler.close()  # a run that ended inside the profiled steps still writes
            if self.profiler.summary is not None:
                announce(
                    f"profile of steps {self.profiler.first}-{self.profiler.last} → "
                    f"{self.profiler.out_dir} (rank 0):\n"
                    f"{summary_table(self.profiler.summary)}"
                )
        return state

    def _count(self, step: int, metrics: dict[str, float]) -> None:
        """Skipped-step accounting, and which checkpoint is the last good one."""
        skipped = bool(metrics.get("skipped"))
        self.last_good = self.last_good.after_step(
            skipped=skipped, confirm_steps=self.confirm_steps
        )
        self.checkpointer.protect(self.last_good.step)
        try:
            self.guard.update(step, metrics)
        except TrainingError as err:  # raised on every rank alike: collectives are safe
            self.checkpointer.wait()  # a save still in flight is from before the trouble
            raise TrainingError(f"{err.message} {self._advice()}") from None

    def _advice(self) -> str:
        good = self.last_good.step
        if good is None:
            return "No checkpoint of this run was confirmed good (trained past with no skip)."
        directory = self.recipe.checkpoint_dir
        newer = [path.name for path in list_checkpoints(directory) if checkpoint_step(path) > good]
        advice = (
            f"The last good checkpoint (trained {self.confirm_steps} steps past with no skipped "
            f"step) is {directory / checkpoint_name(good)}"
        )
        if newer:
            return f"{advice}; delete those saved since ({', '.join(newer)}) to resume from it."
        return f"{advice}; the next run resumes from it."

    def _save(self, state: TrainState, *, wait: bool = False) -> None:
        extra = _extra(state, self.plan, self.fingerprint, self.recipe)
        extra["nonfinite"] = self.guard.record.to_json()
        extra["last_good"] = self.last_good.to_json()
        extra["run"] = {
            "id": self.run_id,
            "recipe": self.recipe.name,
            "launched_from": os.getcwd(),  # where the recipe's relative paths point from
        }
        self.saved = self.checkpointer.save(
            state.step, state.params, state.optimizer, extra, wait=wait
        )
        self.saved_step, self.last_good = state.step, self.last_good.after_save(state.step)


def _resume(
    recipe: Recipe,
    state: TrainState,
    optimizer: torch.optim.Optimizer,
    checkpointer: Checkpointer,
    budget: SkipBudget,
) -> tuple[TrainState, SkipGuard, LastGood, Path | None]:
    """The state to start from: the newest intact checkpoint (every checkpoint passed over on
    the way is named on rank 0), restored with its skip counts and last good checkpoint, or a
    fresh one."""
    if not recipe.checkpoint.resume:
        return state, SkipGuard(budget), LastGood(), None
    allow = recipe.checkpoint.allow_unverified
    point = find_resume_point(recipe.checkpoint_dir, allow_unverified=allow)
    for line in point.describe_passed_over():
        announce(f"{recipe.name}: warning: {line}")
    point.refuse_start_over(recipe.checkpoint_dir)  # starting over would bury a run's work
    if point.checkpoint is None:
        return state, SkipGuard(budget), LastGood(), None
    for line in check_recipe_unchanged(recipe, point.checkpoint):  # before any tensor is read
        announce(f"{recipe.name}: {line}")
    extra = load_checkpoint(point.checkpoint, state.params, optimizer, verify=False)
    if allow and inspect_checkpoint(point.checkpoint, content=False).status == "unverified":
        announce(f"{recipe.name}: warning: {point.checkpoint} has no checksums: loaded unverified")
    guard = SkipGuard(budget, SkipRecord.from_json(extra.get("nonfinite")))
    state = _restore(state, extra)
    last_good = LastGood.resumed(extra.get("last_good"), state.step)
    checkpointer.protect(last_good.step)
    announce(f"{recipe.name}: resumed from step {state.step} (checkpoint {point.checkpoint})")
    return state, guard, last_good, point.checkpoint


@contextlib.contextmanager
def _run_locks(recipe: Recipe) -> Iterator[None]:
    """Rank 0 holds the run directory's lock (shared with its launcher's job through
    ``MESHTRAIN_RUN_TOKEN``); every rank raises the same error when it cannot."""
    with contextlib.ExitStack() as stack:
        problem = None
        if dist.get_rank() == 0:
            try:
                token = os.environ.get(TOKEN_VARIABLE)
                stack.enter_context(lock_run(recipe.run_dir, recipe.checkpoint_dir, token=token))
                check_run_files(recipe.run_dir)
            except MeshtrainError as err:
                problem = (type(err).__name__, err.message)
        outcomes: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(outcomes, problem)
        if outcomes[0] is not None:
            kind, message = outcomes[0]
            raise (CheckpointError if kind == "CheckpointError" else RecipeError)(message)
        yield


def announce(line: str) -> None:
    """One line on rank 0's console (an event: a resume, a checkpoint passed over, a stop); a
    closed console does not stop the run."""
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    with contextlib.suppress(OSError):
        print(line, flush=True)


def _load_progress(recipe: Recipe) -> contextlib.AbstractContextManager[Any]:
    """Rank 0's bar of the ``init_from`` tensors it has read (nothing elsewhere, or off a
    terminal: the "loaded" line says it)."""
    if not recipe.checkpoint.init_from or (dist.is_initialized() and dist.get_rank() != 0):
        return contextlib.nullcontext(None)
    return count_progress(f"loading {recipe.checkpoint.init_from}", "tensors")


def start_model(
    recipe: Recipe, mesh: Mesh, device: torch.device
) -> tuple[Plan, nn.Module | PipelinedModel, nn.Module]:
    """Build the recipe's model (with its ``[lora]`` adapters), plan it on ``mesh`` and apply the
    plan; returns the plan, the applied model and the model as built (for its config and
    vocabulary).

    With ``[model] meta_init`` (the default) the model is built on the meta device and each rank
    then allocates and initialises only its own shards (:func:`~meshtrain.materialise`): a rank's
    peak memory at start-up is its share at rest plus one module's full tensors. Otherwise every
    rank builds the full model from the recipe's seed before the plan shards it. Weights named by
    ``[checkpoint] init_from`` are then read slice by slice into the shards (not on a resume). A
    QLoRA base (``lora.quantize_base``) is NF4 from the start (meta storage on the meta device)
    and each shard is quantized as it is initialised or read, so the full-precision base never
    exists on a rank.
    """
    seed = recipe.train.seed
    meta = recipe.model.meta_init
    base = recipe.build_model(device="meta" if meta else device, seed=seed, adapters=False)
    model = recipe.adapt(base, seed=seed)
    plan = make_plan(
        model, mesh, recipe.rules(), recipe.plan_options(), example_inputs=recipe.example_inputs()
    )
    applied = apply(plan, model)
    if meta:
        materialise(applied, device=device, seed=seed)
    started = time.perf_counter()
    with _load_progress(recipe) as progress:  # a bar on rank 0's terminal
        loaded = initialise_from(recipe, applied, progress)  # each rank its slices
    if loaded is not None:
        announce(
            f"{recipe.name}: loaded {loaded.tensors} tensors from "
            f"{recipe.checkpoint.init_from} in {time.perf_counter() - started:.1f} s "
            f"({loaded.bytes_read / 2**20:,.1f} MiB read on rank 0)"
        )
    return plan, applied, model


def _dataset(recipe: Recipe, model: torch.nn.Module) -> Any:
    vocab = vocab_size(model)
    if vocab is None:
        raise RecipeError(
            f"{recipe.source}: the model reads no token ids (no vocab_size in its config, no "
            "nn.Embedding), so [data] has no vocabulary to draw or check tokens against. Train "
            "it from Python with your own batches, or give it an embedding."
        )
    return recipe_datasets(recipe, vocab)  # [data]: corpus, tokens, synthetic or files


def _extra(state: TrainState, plan: Plan, fingerprint: str, recipe: Recipe) -> dict[str, Any]:
    """The JSON half of a checkpoint: everything but tensors."""
    return {
        "step": state.step,
        "data": state.data.to_json(),
        "data_files": recorded_data_files(recipe),
        "rng": base64.b64encode(state.rng.numpy().tobytes()).decode(),
        "fingerprint": fingerprint,
        "mesh": {axis: plan.mesh.size(axis) for axis in plan.mesh.axis_names},
        "recipe": recipe.raw,
    }


def _restore(state: TrainState, extra: dict[str, Any]) -> TrainState:
    """The state a checkpoint's JSON half describes (tensors and the optimizer's
    hyper-parameters are already loaded in place)."""
    rng = torch.frombuffer(bytearray(base64.b64decode(extra["rng"])), dtype=torch.uint8).clone()
    return TrainState.create(
        state.model,
        state.optimizer,
        step=int(extra["step"]),
        data=DataPosition.from_json(extra["data"]),
        rng=rng,
    )


def loss_scaler(train_cfg: TrainSection, plan: Plan) -> LossScaler | None:
    """fp16's loss scaler as ``[train]``'s loss-scale keys set it (None for other precisions)."""
    if plan.options.precision != "fp16":
        return None
    static = train_cfg.loss_scale > 0
    return LossScaler(
        train_cfg.loss_scale if static else train_cfg.initial_loss_scale,
        growth_interval=train_cfg.loss_scale_window,
        hysteresis=train_cfg.loss_scale_hysteresis,
        min_scale=0.0 if static else train_cfg.min_loss_scale,
        dynamic=not static,
    )
