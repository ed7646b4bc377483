"""What the launcher checks before any rank starts, so a launch that cannot work is refused in a
fraction of a second with one line and exit status 2, instead of failing inside every rank.

:func:`check_launch` reads the recipe as parsed (:mod:`meshtrain.recipes.source`) and imports no
torch: every number is finite, the mesh fits the ranks being started (``--nproc`` × ``--nnodes``),
the global batch splits over the data-parallel ranks and micro-batches, the data and files
the run reads exist (or can be made), an ``init_from`` directory holds the recipe's architecture,
and a QLoRA recipe finds torchao; :func:`check_wandb` then imports wandb for a run that logs
to it (a second, so after the launch is announced). A value of the wrong type is left to the schema, which
runs next (in :func:`meshtrain.recipes.load_recipe`). Then :func:`check_plan` checks the model
against the files it starts from (:mod:`~meshtrain.recipes.model_check`: an ``init_from`` of
another architecture or config, an unknown ``model_type``, QLoRA without torchao) and plans the
recipe on the launch's world with abstract ranks on the meta device — whatever ``mt.plan``
refuses (heads that do not split over tensor parallelism, a pipeline that does not fit) is
refused here too — and :func:`lock_run` takes the run directory's lock for the job.

Example:
    >>> check_launch({"mesh": {"dp": -1, "tp": 2}, "train": {"batch_size": 8}}, "r.toml",
    ...              nproc=3)
    Traceback (most recent call last):
    ...
    meshtrain.errors.RecipeError: r.toml: [mesh] {dp: -1, tp: 2} needs a multiple of 2 ranks (tp = 2), but this launch starts 3 (--nproc 3 × --nnodes 1). Start a multiple of 2 ranks (e.g. --nproc 2), or change the mesh (e.g. --set mesh.tp=1).
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from meshtrain.errors import RecipeError
from meshtrain.recipes.model_check import check_architecture, check_torchao
from meshtrain.recipes.sections import DataSection, ParallelSection, TrainSection

if TYPE_CHECKING:
    from meshtrain.plan.ir import Plan
    from meshtrain.recipes.recipe import Recipe

__all__ = [
    "DEFAULTS",
    "check_data_size",
    "check_launch",
    "check_plan",
    "check_run_files",
    "check_wandb",
    "lock_run",
    "refuse_busy_run",
]
#: ``[data] source`` values that read the user's files (as meshtrain.train.data.documents has them).
_FILE_SOURCES = ("jsonl", "text", "parquet", "hf-dataset")

#: The schema's defaults these checks need, read from its sections (which import no torch).
DEFAULTS: dict[str, Any] = {
    "train.batch_size": TrainSection.batch_size,
    "parallel.microbatches": ParallelSection.microbatches,
    "data.source": DataSection.source,
    "data.path": DataSection.path,
}


def check_launch(data: Mapping[str, Any], source: str, *, nproc: int, nnodes: int = 1) -> None:
    """Refuse (:class:`RecipeError`) a launch of the recipe ``data`` on ``nproc`` × ``nnodes``
    ranks that cannot work; see the module docstring."""
    _check_finite(data, source)
    sizes = _mesh_sizes(data, source, nproc, nnodes)
    if sizes is not None:
        _check_batch(data, source, sizes)
    _check_files(data, source)
    check_torchao(data.get("lora"), source)  # QLoRA trains with torchao


def check_wandb(data: Mapping[str, Any], source: str) -> None:
    """A run that logs to wandb (``[logging] wandb``, "offline" by default) imports it here, so
    a missing or broken install is one line before the ranks start, not a failure of rank 0."""
    logging = data.get("logging")
    mode = logging.get("wandb", "offline") if isinstance(logging, Mapping) else "offline"
    if mode == "disabled":
        return
    try:
        import wandb  # noqa: F401
    except Exception as error:
        raise RecipeError(
            f"{source}: [logging] wandb = {mode!r} logs to wandb, whose import fails here "
            f"({type(error).__name__}: {str(error).strip()[:160]}). Reinstall it "
            "(`pip install wandb`), or set logging.wandb = 'disabled' (`--set "
            "logging.wandb=disabled`) to train without it."
        ) from error


def _check_finite(data: Mapping[str, Any], source: str, where: str = "") -> None:
    for key, value in data.items():
        path = f"{where}.{key}" if where else str(key)
        if isinstance(value, Mapping):
            _check_finite(value, source, path)
        elif isinstance(value, float) and not math.isfinite(value):
            raise RecipeError(
                f"{source}: {path} = {value} is not a finite number: no recipe value can be "
                "infinite or NaN (an infinite learning rate trains NaN). Give a finite value."
            )


def _mesh_sizes(
    data: Mapping[str, Any], source: str, nproc: int, nnodes: int
) -> dict[str, int] | None:
    """The mesh's sizes on ``nproc × nnodes`` ranks (``None`` when the schema will refuse the
    table anyway: wrong types, several -1s)."""
    mesh = data.get("mesh")
    if not isinstance(mesh, Mapping) or not mesh:
        return None
    if not all(type(size) is int and (size >= 1 or size == -1) for size in mesh.values()):
        return None
    free = [axis for axis, size in mesh.items() if size == -1]
    if len(free) > 1:
        return None
    world = nproc * nnodes
    fixed = math.prod(size for size in mesh.values() if size != -1)
    shown = "{" + ", ".join(f"{axis}: {size}" for axis, size in mesh.items()) + "}"
    launch = f"this launch starts {world} (--nproc {nproc} × --nnodes {nnodes})"
    if free and world % fixed:
        axes = " × ".join(f"{axis} = {size}" for axis, size in mesh.items() if size != -1)
        shrink = next(axis for axis, size in mesh.items() if size not in (-1, 1))
        raise RecipeError(
            f"{source}: [mesh] {shown} needs a multiple of {fixed} ranks ({axes}), but {launch}. "
            f"Start a multiple of {fixed} ranks (e.g. --nproc {fixed}), or change the mesh "
            f"(e.g. --set mesh.{shrink}=1)."
        )
    if not free and fixed != world:
        nodes = f"--nproc {fixed // nnodes}" if fixed % nnodes == 0 else f"{fixed} ranks"
        raise RecipeError(
            f"{source}: [mesh] {shown} needs exactly {fixed} ranks, but {launch}. Start "
            f"{nodes}, or set one mesh axis to -1 to take the ranks there are."
        )
    return {axis: world // fixed if size == -1 else size for axis, size in mesh.items()}


def _check_batch(data: Mapping[str, Any], source: str, sizes: Mapping[str, int]) -> None:
    """The global batch splits over the data-parallel ranks and micro-batches (the planner's
    rule, checked here without torch); skipped where the schema or the planner decide."""
    train, parallel = data.get("train", {}), data.get("parallel", {})
    if not isinstance(train, Mapping) or not isinstance(parallel, Mapping):
        return
    batch = train.get("batch_size", DEFAULTS["train.batch_size"])
    fsdp = parallel.get("fsdp", [axis for axis in ParallelSection.fsdp if axis in sizes])
    pipeline = parallel.get("pipeline")
    micro = (
        pipeline.get("microbatches")
        if isinstance(pipeline, Mapping)
        else parallel.get("microbatches", DEFAULTS["parallel.microbatches"])
    )
    usable = isinstance(fsdp, list) and all(axis in sizes for axis in fsdp)
    if type(batch) is not int or type(micro) is not int or not usable or batch < 1 or micro < 1:
        return  # the schema (or the planner, for a pipeline's default micro-batches) decides
    data_ranks = math.prod(sizes[axis] for axis in fsdp)
    if batch % (data_ranks * micro):
        per_step = data_ranks * micro
        axes = " × ".join(f"{axis} = {sizes[axis]}" for axis in fsdp) or "none"
        raise RecipeError(
            f"{source}: train.batch_size = {batch} does not split into {data_ranks} data-parallel "
            f"ranks ({axes}) × {micro} micro-batches: each micro-batch needs a whole number of "
            f"sequences. Use a multiple of {per_step} (e.g. --set train.batch_size="
            f"{per_step * max(1, batch // per_step)}), or change the mesh or micro-batches."
        )


def _check_files(data: Mapping[str, Any], source: str) -> None:
    """The data the run reads exists, or its directory can be created; so do files it starts
    from."""
    checkpoint = data.get("checkpoint", {})
    start = checkpoint.get("init_from") if isinstance(checkpoint, Mapping) else None
    if isinstance(start, str) and start:
        _check_init_from(start, source)
        check_architecture(data.get("model"), start, source)  # another model's config.json
    table = data.get("data", {})
    table = table if isinstance(table, Mapping) else {}
    kind = table.get("source", DEFAULTS["data.source"])
    path = table.get("path", DEFAULTS["data.path"])
    if isinstance(path, str) and kind in _FILE_SOURCES and not Path(path).exists():
        raise RecipeError(
            f"{source}: data.path = {path!r} does not exist, and data.source = {kind!r} reads the "
            "documents there. Point data.path at your file (or directory of files)."
        )
    if not isinstance(path, str) or kind not in ("tokens", "corpus"):
        return
    prepared = (Path(path) / "tokens.json").is_file()
    if kind == "tokens" and not prepared:
        raise RecipeError(
            f"{source}: data.path = {path!r} holds no prepared tokens (no tokens.json there), and "
            "data.source = 'tokens' reads a prepared token directory. Fix the path, prepare it "
            "with meshtrain.train.data.prepare_tokens or prepare_corpus, or use data.source = "
            "'corpus'."
        )
    if kind == "corpus" and not prepared:
        existing = next(parent for parent in (Path(path), *Path(path).parents) if parent.exists())
        if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
            raise RecipeError(
                f"{source}: data.path = {path!r}: the corpus is tokenized there on first use, "
                f"but {str(existing)!r} is not a writable directory. Choose a writable "
                "data.path, or fix its permissions."
            )


def _check_init_from(start: str, source: str) -> None:
    """``init_from`` is a .safetensors file or a model directory with config.json and weights."""
    path = Path(start)
    weights = ("model.safetensors", "model.safetensors.index.json")
    if path.is_file() and path.suffix == ".safetensors":
        return
    if path.is_dir() and (path / "config.json").is_file():
        if any((path / name).is_file() for name in weights):
            return
        raise RecipeError(
            f"{source}: checkpoint.init_from = {start!r} has a config.json but no "
            "model.safetensors or model.safetensors.index.json: copy the weights there "
            "(save_pretrained writes them), or point at the directory that has them."
        )
    if not path.exists():
        what = "does not exist"
    elif path.is_dir():
        what = "is a directory without config.json"
    else:
        what = "is not a .safetensors file"
    raise RecipeError(
        f"{source}: checkpoint.init_from = {start!r} {what}: give a transformers model directory "
        "(config.json and model*.safetensors) or a .safetensors file the run starts from."
    )


def check_plan(recipe: Recipe, world: int) -> Plan:
    """Check the recipe's model against the files it starts from
    (:func:`~meshtrain.recipes.model_check.check_model`), then plan ``recipe`` on ``world``
    abstract ranks with the model on the meta device: whatever the planner refuses is refused
    before any rank starts (no memory, no process group)."""
    from meshtrain.plan.api import plan
    from meshtrain.recipes.model_check import check_model
    from meshtrain.spec.mesh import make_mesh

    base = recipe.lora.quantize_base if recipe.lora is not None else ""
    check_model(
        recipe.source, recipe.model, init_from=recipe.checkpoint.init_from, quantize_base=base
    )

    mesh = make_mesh(recipe.mesh_axes(), world_size=world, abstract=True)
    return plan(recipe.build_model(device="meta"), mesh, recipe.rules(), recipe.plan_options())


def check_data_size(recipe: Recipe, plan: Plan) -> None:
    """After the data is prepared, before any rank starts: the training windows hold one global
    batch, and a validation split that ``[eval]`` reads holds what it needs
    (:func:`~meshtrain.recipes.evaluation.validation_batch`). The ranks would refuse the same,
    each on its own line, after starting."""
    from meshtrain.errors import DataError
    from meshtrain.recipes.data import launch_datasets
    from meshtrain.recipes.evaluation import validation_batch

    train, validation = launch_datasets(recipe)
    batch = recipe.train.batch_size
    if len(train) < batch:
        raise DataError(
            f"{recipe.source}: the training data ({recipe.data.source} {recipe.data.path}) holds "
            f"{len(train)} sequences of train.seq_len + 1 = {recipe.train.seq_len + 1} tokens, "
            f"fewer than one global batch of train.batch_size = {batch}. Lower train.batch_size "
            "or train.seq_len, or add data."
        )
    if validation is not None and recipe.eval.every:
        dp_size = math.prod(plan.mesh.size(axis) for axis in plan.batch_axes)
        validation_batch(recipe, len(validation), dp_size, plan.pipeline is not None)


@contextlib.contextmanager
def lock_run(run_dir: Path, checkpoint_dir: Path, *, token: str | None = None) -> Iterator[str]:
    """Hold the locks of a run directory (and of its checkpoint directory, when that lies
    elsewhere) for a job; yields the job's token, for its ranks. No torch: the launcher takes
    them before anything slow."""
    import uuid

    from meshtrain.files.lock import acquire_run_lock

    token = token or uuid.uuid4().hex
    directories = [run_dir]
    if not checkpoint_dir.resolve().is_relative_to(run_dir.resolve()):
        directories.append(checkpoint_dir)
    with contextlib.ExitStack() as stack:
        for directory in directories:
            stack.enter_context(acquire_run_lock(directory, token=token))
        yield token


def refuse_busy_run(data: Mapping[str, Any], source: str) -> None:
    """Refuse, before anything slow, a run directory (or checkpoint directory) another job
    holds; no torch, nothing written where no run was. The job takes the lock for real after
    its plan check (:func:`lock_run`), which refuses a job that took it meanwhile."""
    from meshtrain.files.lock import LOCK_FILE, acquire_run_lock
    from meshtrain.recipes.source import run_directories

    for directory in run_directories(data, source):
        if (directory / LOCK_FILE).is_file():
            acquire_run_lock(directory).release()  # raises, naming the holder, when held


def check_run_files(run_dir: Path) -> None:
    """Refuse a symbolic link where the run writes: the files at the top of ``run_dir``
    (``config.json``, ``plan.txt``, ``metrics.jsonl``, ...) and anything in its ``logs/`` and
    ``profile/`` (the ranks also refuse each link as they write: this says it before they start).
    """
    from meshtrain.files import refuse_link
    from meshtrain.train.metrics.sinks import RUN_DIR_FILES

    for name in RUN_DIR_FILES:
        refuse_link(run_dir / name)
    for owned in ("logs", "profile"):
        refuse_link(run_dir / owned)
        if (run_dir / owned).is_dir():
            for entry in (run_dir / owned).iterdir():
                refuse_link(entry)
