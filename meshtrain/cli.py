"""The ``meshtrain`` command line: argument parsing only; each command calls Python functions.

``meshtrain train RECIPE [--set section.key=value ...]`` trains a recipe
(:func:`meshtrain.recipes.run.train`). Under ``torchrun`` it joins the process group; run directly
it starts ``--nproc`` local ranks through torchrun's agent (one node by default; ``--nnodes``,
``--node-rank`` and ``--rdzv-endpoint`` make this machine one node of several; ``--max-restarts``
restarts failed ranks, which resume from the last checkpoint). Before any rank starts the recipe
is validated, the launch checked (:mod:`meshtrain.recipes.preflight`: a refusal takes a fraction
of a second) and planned on abstract ranks, and the run directory locked. Exit status: 0 done,
1 a rank failed, 2 a meshtrain error, 4 restarts spent, 75 stopped by a signal after saving a
checkpoint (run the same command to resume), 124 a rank stopped making progress (the watchdog) —
:data:`meshtrain.launch.EXIT_CODES`.

``meshtrain checkpoints RUN_DIR [--quick]`` lists a run's checkpoints with their status (intact,
damaged, incomplete), step and size; exit status 0 when one is intact to resume from, 1 when none
is, 2 when there is no such directory.

``meshtrain plan RECIPE --world N [--device-memory 80GiB] [--strategy auto] [--json] [--set ...]``
plans a recipe on N abstract ranks (:func:`meshtrain.recipes.sizing.size_recipe`) and prints one
rank's memory and communication; exit status 3 when it does not fit the device memory. Every
command that takes a RECIPE takes ``--set section.key=value`` for any section (``lora`` too).

``meshtrain export RUN_DIR --format hf --out OUT [--max-shard-size 5GB] [--dtype bfloat16]``
writes the newest intact checkpoint of a run as a Hugging Face ``transformers`` directory
(:func:`meshtrain.recipes.pretrained.export_run`); exit status 2 when there is nothing to export,
the format is unknown or OUT is not empty.

``meshtrain check RECIPE [--world N] [--steps S] [--set ...]`` shrinks a recipe to ``N`` CPU
ranks (:func:`meshtrain.recipes.shrink`) and proves with :func:`meshtrain.testing.assert_equivalent`
that its plan trains like one device. Exit status: 0 when it does, 1 when it does not
(``EquivalenceError``), 2 for any other meshtrain error (a bad recipe, an impossible plan).

``meshtrain --version`` prints ``meshtrain <version>`` (the installed package's) and exits 0.

Example:
    >>> build_parser().parse_args(["check", "debug", "--world", "2"]).world
    2
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from meshtrain.errors import EquivalenceError, MeshtrainError, RecipeError, describe_os_error

if TYPE_CHECKING:
    from meshtrain.recipes.recipe import Recipe
    from meshtrain.recipes.run import RunResult


def build_parser() -> argparse.ArgumentParser:
    """The parser of every subcommand."""
    parser = argparse.ArgumentParser(
        prog="meshtrain", description="JAX-style sharding specs compiled to PyTorch plans."
    )
    parser.add_argument("--version", action="version", version=f"meshtrain {_version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_check_command(commands)
    _add_train_command(commands)
    _add_checkpoints_command(commands)
    _add_plan_command(commands)
    _add_export_command(commands)
    _add_answer_commands(commands)
    return parser


def _add_check_command(commands: argparse._SubParsersAction) -> None:
    """``meshtrain check``."""
    check = commands.add_parser(
        "check",
        help="prove on CPU ranks that a recipe's plan trains like one device",
        description="Shrink RECIPE to N CPU ranks (same mesh axes, a small model of the same "
        "structure) and compare its plan with single-device training, step by step.",
    )
    _add_recipe(check)
    check.add_argument(
        "--world",
        type=_positive,
        default=4,
        metavar="N",
        help="number of CPU (gloo) ranks (default: 4)",
    )
    check.add_argument(
        "--steps",
        type=_positive,
        default=None,
        metavar="S",
        help="training steps to compare (default: the shrunk recipe's)",
    )
    check.add_argument(
        "--start-timeout",
        type=_positive,
        default=None,
        metavar="S",
        help="seconds the CPU ranks may go without progress while starting "
        "(default 120; raise it on a loaded machine)",
    )
    check.set_defaults(run=check_command)


def _add_train_command(commands: argparse._SubParsersAction) -> None:
    """``meshtrain train``."""
    train = commands.add_parser(
        "train",
        help="train a recipe (under torchrun, or on --nproc local ranks)",
        description="Train RECIPE. Under torchrun every rank runs this command; otherwise it "
        "starts the ranks itself through torchrun.",
    )
    _add_recipe(train)
    train.add_argument(
        "--nproc",
        type=_positive,
        default=None,
        metavar="N",
        help="ranks to start on this machine when not under torchrun (default 1)",
    )
    train.add_argument(
        "--nnodes",
        type=_positive,
        default=1,
        metavar="N",
        help="number of nodes (machines), each running this command",
    )
    train.add_argument(
        "--node-rank", type=int, default=0, metavar="R", help="this node's index, 0..nnodes-1"
    )
    train.add_argument(
        "--rdzv-endpoint",
        default=None,
        metavar="HOST:PORT",
        help="where the nodes meet (node 0's address), for --nnodes > 1",
    )
    train.add_argument(
        "--max-restarts",
        type=_count,
        default=0,
        metavar="N",
        help="restart the ranks up to N times when one fails; they resume from "
        "the last checkpoint (default 0)",
    )
    train.add_argument(
        "--stop-timeout",
        type=_positive,
        default=None,
        metavar="S",
        help="seconds the ranks get to finish their step and save after SIGTERM "
        "or Ctrl-C before they are killed (default: TORCH_ELASTIC_SHUTDOWN_TIMEOUT "
        "if set, else 300)",
    )
    train.add_argument(
        "--allow-change",
        dest="allow_change",
        action="append",
        default=[],
        metavar="KEY",
        help="resume although the recipe's KEY (or section) changed what training "
        "means since the checkpoint, e.g. --allow-change train.batch_size "
        "(repeatable)",
    )
    train.add_argument(
        "--profile",
        action="store_true",
        help="trace steps 3 to 5 with torch.profiler into <run_dir>/profile and "
        "print compute against collective time (as [profile] steps = [3, 5])",
    )
    train.set_defaults(run=train_command)


def _add_checkpoints_command(commands: argparse._SubParsersAction) -> None:
    """``meshtrain checkpoints``."""
    checkpoints = commands.add_parser(
        "checkpoints",
        help="list a run's checkpoints with their status, step and size",
        description="List the checkpoints of RUN_DIR (a run directory, or its checkpoints "
        "directory) and verify each against its checksums: intact, damaged (which file, why), "
        "incomplete (a save that did not finish) or unverified (saved without checksums).",
    )
    _add_run_dir(checkpoints)
    checkpoints.add_argument(
        "--quick",
        action="store_true",
        help="check sizes and the state file only, not every file's content",
    )
    checkpoints.set_defaults(run=checkpoints_command)


def _add_plan_command(commands: argparse._SubParsersAction) -> None:
    """``meshtrain plan``."""
    plan = commands.add_parser(
        "plan",
        help="per-rank memory and communication of a recipe at any world size, without hardware",
        description="Build RECIPE's model on the meta device, plan it on N abstract ranks and "
        "report one rank's memory (at rest and peak), activations per checkpointing mode, "
        "communication per mesh axis and the pipeline bubble.",
    )
    _add_recipe(plan)
    plan.add_argument(
        "--world", type=_positive, required=True, metavar="N", help="number of ranks to plan for"
    )
    plan.add_argument(
        "--device-memory",
        default=None,
        metavar="SIZE",
        help="memory per device, e.g. 80GiB: says whether the plan fits",
    )
    plan.add_argument(
        "--strategy",
        choices=("recipe", "auto"),
        default="recipe",
        help="the recipe's degrees, or let meshtrain choose (needs --device-memory)",
    )
    plan.add_argument(
        "--node-size",
        type=_positive,
        default=8,
        metavar="N",
        help="devices per node, for --strategy auto (default 8)",
    )
    plan.add_argument("--json", action="store_true", help="print JSON instead of the table")
    plan.set_defaults(run=plan_command)


def _add_export_command(commands: argparse._SubParsersAction) -> None:
    """``meshtrain export``."""
    export = commands.add_parser(
        "export",
        help="write a run's latest intact checkpoint as a Hugging Face transformers directory",
        description="Write the newest intact checkpoint of RUN_DIR (a run directory, or its "
        "checkpoints directory) to OUT as a transformers model directory: config.json and "
        "safetensors shards with their index, streamed one shard at a time in this process.",
    )
    _add_run_dir(export)
    export.add_argument(
        "--format",
        default="hf",
        metavar="FORMAT",
        help="what to write: hf (a transformers directory; the default)",
    )
    export.add_argument(
        "--out",
        required=True,
        metavar="OUT",
        help="the directory to create (must not exist, or be empty)",
    )
    export.add_argument(
        "--max-shard-size",
        default="5GB",
        metavar="SIZE",
        help="largest safetensors file, e.g. 5GB or 500MiB (default 5GB)",
    )
    export.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default=None,
        help="cast floating-point weights (default: as trained)",
    )
    export.set_defaults(run=export_command)


def _add_answer_commands(commands: argparse._SubParsersAction) -> None:
    """``eval``, ``generate`` and ``recipe from-deepspeed``."""
    evaluate = commands.add_parser(
        "eval",
        help="validation loss and perplexity of a run's latest intact checkpoint",
        description="Load the newest intact checkpoint of RUN_DIR on one process (whatever plan "
        "trained it) and print its loss and perplexity on the run's validation split (or its "
        "training data when it has none).",
    )
    _add_run_dir(evaluate)
    evaluate.add_argument(
        "--batches",
        type=_positive,
        default=None,
        metavar="M",
        help="batches to evaluate (default: the recipe's [eval] batches)",
    )
    evaluate.set_defaults(run=eval_command)
    generate = commands.add_parser(
        "generate",
        help="sample a continuation of a prompt from a run's latest intact checkpoint",
        description="Load the newest intact checkpoint of RUN_DIR on one process and continue "
        "TEXT with the run's tokenizer, stopping at the end-of-document token.",
    )
    _add_run_dir(generate)
    generate.add_argument("--prompt", required=True, metavar="TEXT", help="the text to continue")
    generate.add_argument(
        "--max-new-tokens",
        type=_positive,
        default=64,
        metavar="N",
        help="tokens to generate at most (default 64)",
    )
    generate.add_argument(
        "--temperature",
        type=float,
        default=0.8,
        metavar="T",
        help="sampling temperature; 0 picks the likeliest token (default 0.8)",
    )
    generate.add_argument("--seed", type=int, default=0, help="the sampling seed (default 0)")
    generate.set_defaults(run=generate_command)
    recipe = commands.add_parser("recipe", help="write recipes from other tools' configs")
    actions = recipe.add_subparsers(dest="action", required=True, metavar="ACTION")
    deepspeed = actions.add_parser(
        "from-deepspeed",
        help="translate a DeepSpeed ds_config.json into a recipe, key by key",
        description="Map every key of a DeepSpeed config (ZeRO stage, offload, bf16/fp16, "
        "gradient accumulation, clipping, optimizer, scheduler) to the recipe key with the same "
        "meaning; keys it cannot map are named and refused (exit status 2).",
    )
    deepspeed.add_argument("config", metavar="DS_CONFIG", help="the ds_config.json")
    deepspeed.add_argument(
        "--model",
        default="debug",
        metavar="MODEL",
        help="a preset name or a transformers model directory (default debug)",
    )
    deepspeed.add_argument(
        "--out", required=True, metavar="RECIPE", help="the recipe .toml to write"
    )
    deepspeed.set_defaults(run=from_deepspeed_command)


def eval_command(args: argparse.Namespace) -> int:
    """``meshtrain eval``: the validation loss of a run's newest intact checkpoint."""
    from meshtrain.recipes.evaluation import evaluate_run, load_run

    run = load_run(args.run_dir)
    print(f"loaded {run.checkpoint} (step {run.step}) in {run.seconds:.1f} s", flush=True)
    result, what = evaluate_run(run, batches=args.batches)
    print(
        f"step {run.step} | val_loss {result.loss:.4f} | val_perplexity "
        f"{result.perplexity:.4g} | {result.tokens:,} tokens of {what}"
    )
    return 0


def generate_command(args: argparse.Namespace) -> int:
    """``meshtrain generate``: a continuation of ``--prompt`` from a run's checkpoint."""
    from meshtrain.recipes.evaluation import generate, load_run

    run = load_run(args.run_dir)
    _say(f"loaded {run.checkpoint} (step {run.step}) in {run.seconds:.1f} s")
    text = generate(
        run,
        args.prompt,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        seed=args.seed,
    )
    print(args.prompt + text)
    return 0


def from_deepspeed_command(args: argparse.Namespace) -> int:
    """``meshtrain recipe from-deepspeed``: write the recipe a DeepSpeed config means."""
    from meshtrain.recipes.deepspeed import read_deepspeed, translate_deepspeed

    translation = translate_deepspeed(read_deepspeed(args.config), model=args.model)  # no torch
    text = translation.toml(args.config)
    from meshtrain.recipes import recipe_from_toml

    recipe_from_toml(text, source=args.out)  # the recipe it writes is a valid one
    Path(args.out).write_text(text, encoding="utf-8")
    print(
        f"wrote {args.out}: {len(translation.settings)} settings"
        + (
            f'; left to the recipe ("auto"): {", ".join(translation.auto)}'
            if translation.auto
            else ""
        )
        + (
            f"; tuning knobs without effect on the numbers: {len(translation.tuning)}"
            if translation.tuning
            else ""
        )
    )
    return 0


def _version() -> str:
    """meshtrain's version, from the installed package's metadata."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("meshtrain")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def _add_run_dir(command: argparse.ArgumentParser) -> None:
    """The RUN_DIR argument of the commands that read a run's checkpoints."""
    command.add_argument("run_dir", metavar="RUN_DIR", help="a run directory, e.g. runs/debug")


def _add_recipe(command: argparse.ArgumentParser) -> None:
    """The RECIPE argument every command takes, and ``--set`` to change any of its values."""
    command.add_argument("recipe", metavar="RECIPE", help="a recipe file, or a name in recipes/")
    command.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override a recipe value, e.g. --set train.steps=100 or "
        "--set lora.rank=8 (repeatable)",
    )


def plan_command(args: argparse.Namespace) -> int:
    """``meshtrain plan``: size the recipe at ``--world`` ranks and print the report."""
    import json

    from meshtrain.recipes import load_recipe
    from meshtrain.recipes.sizing import size_recipe

    recipe = load_recipe(args.recipe, args.overrides)
    sizing = size_recipe(
        recipe,
        world=args.world,
        device_memory=args.device_memory,
        strategy=args.strategy,
        node_size=args.node_size,
    )
    if args.json:
        print(json.dumps(sizing.to_json(), indent=1, sort_keys=True))
    else:
        print(sizing.format(), end="")
    fits = sizing.footprint.fits
    return 0 if fits in (None, True) else 3


def train_command(args: argparse.Namespace) -> int:
    """``meshtrain train``: train on this rank under torchrun, else check and start the ranks."""
    from meshtrain.launch import under_torchrun

    if args.allow_change:  # the ranks get it as a recipe value, like every other setting
        keys = ", ".join(f'"{key}"' for key in args.allow_change)
        args.overrides = [*args.overrides, f"checkpoint.allow_change=[{keys}]"]
    if args.profile and not any(item.startswith("profile.steps=") for item in args.overrides):
        args.overrides = [*args.overrides, "profile.steps=[3, 5]"]
    return train_rank(args) if under_torchrun() else launch_command(args)


def launch_command(args: argparse.Namespace) -> int:
    """Check everything a launch needs before any rank starts (the cheap checks first, before
    torch is imported), lock the run directory, then run torchrun's agent here."""
    from meshtrain.launch import run_agent, torchrun_arguments
    from meshtrain.recipes.preflight import check_launch
    from meshtrain.recipes.quick_check import check_recipe_quickly
    from meshtrain.recipes.source import parse_recipe, read_recipe
    from meshtrain.recipes.token_check import check_recipe_tokens

    nproc = args.nproc or 1
    text, source = read_recipe(args.recipe)
    data, source = parse_recipe(text, source, args.overrides)
    check_launch(data, source, nproc=nproc, nnodes=args.nnodes)
    check_recipe_quickly(data, source)  # the schema's torch-free checks: unknown keys, types
    check_recipe_tokens(data)  # size, sha256 (cached by size and mtime), ids in the vocabulary
    _starting(args.recipe, data, nproc, args.nnodes)  # within a second: torch is not loaded yet
    sets = [item for override in args.overrides for item in ("--set", override)]
    arguments = torchrun_arguments(
        ["train", args.recipe, *sets],
        nproc=nproc,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        rdzv_endpoint=args.rdzv_endpoint,
        max_restarts=args.max_restarts,
    )
    from meshtrain.recipes import load_recipe
    from meshtrain.recipes.preflight import check_plan, lock_run
    from meshtrain.recipes.resume_guard import check_before_launch
    from meshtrain.train.checkpoint.lock import TOKEN_VARIABLE

    recipe = load_recipe(args.recipe, args.overrides)
    check_plan(recipe, nproc * args.nnodes)
    run = functools.partial(
        run_agent,
        arguments,
        nproc=nproc,
        stop_timeout_s=args.stop_timeout,
        hang_timeout_s=recipe.train.heartbeat_timeout,
        log_dir=recipe.run_dir / "logs",
    )
    run = functools.partial(_run_and_explain, run, data)
    if args.node_rank != 0:  # node 0 holds the lock for the whole job
        return run()
    with lock_run(recipe) as token:
        os.environ[TOKEN_VARIABLE] = token
        check_before_launch(recipe)  # no silent start-over, no silent change: before the ranks
        finished = _nothing_to_train(recipe)  # decided here: no rank starts for nothing
        if finished:
            print(finished, flush=True)
            return 0
        _prepare_data(recipe)  # once, here: a bad file is refused before any rank starts
        return run()


def _run_and_explain(run: functools.partial[int], data: dict) -> int:
    """Run the ranks; after a failure, name a token file that changed under the job (a rank
    whose memory-mapped tokens shrank dies by SIGBUS before it can)."""
    from meshtrain.launch import EXIT_FAILED
    from meshtrain.recipes.token_check import token_change

    code = run()
    if code == EXIT_FAILED and (changed := token_change(data)):  # a rank died without a word
        _say(f"meshtrain: {changed}")
    return code


def _starting(name: str, data: dict, nproc: int, nnodes: int) -> None:
    """The first line of ``meshtrain train``: what starts, before the slow imports."""
    mesh = ", ".join(f"{axis}={size}" for axis, size in dict(data.get("mesh", {})).items())
    parallel = dict(data.get("parallel", {}))
    plan = ", ".join(
        f"{key} {parallel[key]}" for key in ("zero", "tp", "precision") if key in parallel
    )
    nodes = f" × {nnodes} nodes" if nnodes > 1 else ""
    print(
        f"meshtrain train {name}: {nproc} rank{'s' if nproc != 1 else ''}{nodes}, mesh "
        f"{{{mesh}}}, {plan or 'default plan'}; checking the plan before the ranks start",
        flush=True,
    )


def _nothing_to_train(recipe: Recipe) -> str:
    """The line to print when the run's newest complete checkpoint is already at
    ``train.steps`` (and the run resumes), else ``""``."""
    from meshtrain.train.checkpoint import find_resume_point
    from meshtrain.train.checkpoint.files import checkpoint_step

    if not recipe.checkpoint.resume or not recipe.checkpoint_dir.is_dir():
        return ""
    point = find_resume_point(recipe.checkpoint_dir, verify=False)
    if point.checkpoint is None or checkpoint_step(point.checkpoint) < recipe.train.steps:
        return ""
    return (
        f"{recipe.name}: the checkpoint in {recipe.checkpoint_dir} is already at step "
        f"{checkpoint_step(point.checkpoint)} of {recipe.train.steps}; nothing to train. Raise "
        "train.steps or start a new run directory."
    )


def _prepare_data(recipe: Recipe) -> None:
    """Tokenise the recipe's own files (``[data] source`` jsonl, text, parquet, hf-dataset)."""
    from meshtrain.recipes.data import check_file_keys, prepare_recipe_data
    from meshtrain.train.data.documents import FILE_SOURCES

    check_file_keys(recipe)  # data.validation or format on a source without files: refused
    if recipe.data.source in FILE_SOURCES:
        prepare_recipe_data(recipe)


def train_rank(args: argparse.Namespace) -> int:
    """One rank of ``meshtrain train`` under torchrun: train, then say how it ended — one line
    on rank 0 for a stop or the end; a meshtrain error or a lost peer goes to the launcher,
    which prints each distinct one once (under torchrun itself, every rank prints its own)."""
    from meshtrain.launch import (
        EXIT_ERROR,
        EXIT_OK,
        EXIT_STOPPED,
        StopRequested,
        refuse_restart,
        report_exit,
    )

    rank = int(os.environ.get("RANK", "0"))
    for number in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # until training starts
        signal.signal(number, _stop_now)
    try:
        code, event, line = _train_rank(args, rank)
    except StopRequested as stopped:
        code, event = EXIT_STOPPED, "stopped"
        line = f"stopped by {stopped.signal_name} before training started; nothing to save."
        line = line if rank == 0 else ""
    ended = code in (EXIT_OK, EXIT_STOPPED)
    told = report_exit(code, event, "" if ended else line)  # the launcher prints errors once
    if line and (ended or not told):
        _say(line, stream=sys.stdout if ended else None)
    if code == EXIT_ERROR:
        refuse_restart()  # the same recipe would fail the same way
    return code


def _train_rank(args: argparse.Namespace, rank: int) -> tuple[int, str, str]:
    """Train; return the exit status, the event the launcher is told and the line to show."""
    from meshtrain.launch import (
        EXIT_ERROR,
        EXIT_FAILED,
        EXIT_OK,
        EXIT_STOPPED,
        REPORT_VARIABLE,
        exit_with_parent,
        init_distributed,
        lost_peer,
    )

    exit_with_parent()
    if reports := os.environ.get(REPORT_VARIABLE):  # the launcher's watchdog reads the beats
        from meshtrain.train import heartbeat

        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        heartbeat.start(reports, rank=rank, attempt=attempt, every_s=2.0)
    import torch.distributed as dist

    from meshtrain.recipes import load_recipe
    from meshtrain.recipes.run import train
    from meshtrain.train.stop import GracefulStop

    stop = GracefulStop()
    stop.install()  # kept to the end: after training, a signal only sets a flag
    recipe = None
    try:
        try:
            recipe = load_recipe(args.recipe, args.overrides)
            device = init_distributed()
            result = train(recipe, device=device, stop=stop)
            dist.barrier()
        finally:
            stop.arm()  # leaving: a late signal (the agent stopping the job) changes nothing
            if dist.is_initialized():
                dist.destroy_process_group()
    except MeshtrainError as err:
        return EXIT_ERROR, "error", f"[rank {rank}] {type(err).__name__}: {err.message}"
    except OSError as err:
        if not err.filename:  # a socket's error: another rank is gone
            return EXIT_FAILED, "lost contact", f"[rank {rank}] lost contact ({_first_line(err)})"
        return EXIT_ERROR, "error", f"[rank {rank}] RecipeError: {describe_os_error(err)}"
    except Exception as err:
        if not lost_peer(err):  # a bug: its traceback goes to a log file, its first line here
            log = _write_traceback(err, rank, recipe.run_dir if recipe is not None else None)
            return EXIT_FAILED, "crash", f"[rank {rank}] {_first_line(err)} (traceback: {log})"
        line = f"[rank {rank}] lost contact with another rank ({_first_line(err)}); stopping."
        return EXIT_FAILED, "lost contact", line
    if result.stopped_by:
        return EXIT_STOPPED, "stopped", _ending(recipe, result) if rank == 0 else ""
    return EXIT_OK, "done", _ending(recipe, result) if rank == 0 else ""


def _write_traceback(err: BaseException, rank: int, run_dir: Path | None) -> str:
    """Write ``err``'s traceback to ``<run_dir>/logs/rank-<rank>.log`` (the temporary directory
    when there is no run directory, or it cannot be written); return the file's path."""
    import tempfile
    import traceback

    text = "".join(traceback.format_exception(err))
    for directory in ([Path(run_dir) / "logs"] if run_dir else []) + [Path(tempfile.gettempdir())]:
        path = directory / f"rank-{rank}.log"
        with contextlib.suppress(OSError):
            directory.mkdir(parents=True, exist_ok=True)
            with open(path, "a", encoding="utf-8") as handle:
                handle.write(text)
            return str(path)
    return "not written: no writable directory"


def _stop_now(number: int, frame: object) -> None:
    from meshtrain.launch import StopRequested

    raise StopRequested(number)


def _ending(recipe: Recipe, result: RunResult) -> str:
    """Rank 0's last line: how far the run got and where the next one resumes."""
    from meshtrain.train.checkpoint.files import checkpoint_step

    name, checkpoint = recipe.name, result.checkpoint
    if result.stopped_by:
        resume = (
            f"step {checkpoint_step(checkpoint)} (checkpoint {checkpoint})"
            if checkpoint is not None
            else "the start (no checkpoint was saved)"
        )
        return (
            f"{name}: stopped by {result.stopped_by} after step {result.last_step}. Run the same "
            f"command to resume from {resume}."
        )
    if result.losses:
        last = max(result.losses)
        line = (
            f"{name}: trained to step {last}, loss {result.losses[last]:.4f}; run directory "
            f"{result.run_dir}"
        )
        if checkpoint is not None and checkpoint_step(checkpoint) != last:
            line += (
                f" (step {last} was skipped for non-finite values, so the last checkpoint is "
                f"step {checkpoint_step(checkpoint)}: {checkpoint})"
            )
        return line
    return (
        f"{name}: the checkpoint in {recipe.checkpoint_dir} is already at step "
        f"{result.resumed_from} of {recipe.train.steps}; nothing to train. Raise train.steps or "
        "start a new run directory."
    )


def checkpoints_command(args: argparse.Namespace) -> int:
    """``meshtrain checkpoints``: every checkpoint of a run with its status, step and size."""
    from meshtrain.train.checkpoint.integrity import inspect_directory

    root = Path(args.run_dir)
    directory = root / "checkpoints" if (root / "checkpoints").is_dir() else root
    if not directory.is_dir():
        raise MeshtrainError(
            f"{str(root)!r} is not a directory: give a run directory (logging.run_dir, e.g. "
            "runs/debug) or its checkpoints directory."
        )
    statuses = inspect_directory(directory, content=not args.quick)
    if not statuses:
        print(f"no checkpoints in {directory}")
        return 1
    print(f"checkpoints in {directory}{' (sizes only: --quick)' if args.quick else ''}")
    print(f"{'step':>10}  {'status':<10}  {'size':>10}  directory")
    for status in statuses:
        step = "?" if status.step is None else str(status.step)
        why = f"  {'; '.join(status.problems)}" if status.status != "intact" else ""
        print(
            f"{step:>10}  {status.status:<10}  {_size(status.size_bytes):>10}  "
            f"{status.path.name}{why}"
        )
    resumable = [status for status in statuses if status.loadable]
    if not resumable:
        print("no intact checkpoint: a run in this directory starts from scratch")
        return 1
    print(f"a run resumes from step {resumable[-1].step} ({resumable[-1].path.name})")
    return 0


def export_command(args: argparse.Namespace) -> int:
    """``meshtrain export``: the run's newest intact checkpoint as a transformers directory."""
    import torch

    from meshtrain.launch import StopRequested
    from meshtrain.recipes.pretrained import export_run
    from meshtrain.recipes.progress import byte_progress

    dtype = getattr(torch, args.dtype) if args.dtype else None
    for number in (signal.SIGTERM, signal.SIGHUP):  # stop as Ctrl-C does: the scratch removed
        signal.signal(number, _stop_now)
    try:
        with byte_progress(f"exporting {args.run_dir}") as progress:
            report = export_run(
                args.run_dir,
                args.out,
                format=args.format,
                max_shard_size=args.max_shard_size,
                dtype=dtype,
                progress=progress,
            )
    except (KeyboardInterrupt, StopRequested) as err:
        name = err.signal_name if isinstance(err, StopRequested) else "SIGINT"
        _say(
            f"export stopped by {name}: nothing was written to {args.out} (its scratch folder "
            "was removed); the checkpoint is unchanged. Run the same command again."
        )
        return 130
    print(
        f"wrote {report.out_dir}: {report.tensors} tensors, {_size(report.total_bytes)} in "
        f"{len(report.files)} safetensors file{'s' if len(report.files) != 1 else ''}"
    )
    return 0


def _size(size: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size} B"


def check_command(args: argparse.Namespace) -> int:
    """``meshtrain check``: load, shrink, run the equivalence harness, print its report."""
    from meshtrain.recipes import describe_shrink, load_recipe, shrink
    from meshtrain.recipes.models import vocab_size
    from meshtrain.testing.harness import TokenBatches, assert_equivalent

    recipe = load_recipe(args.recipe, args.overrides)
    small = shrink(recipe, args.world)
    print(describe_shrink(recipe, small), flush=True)
    vocab = vocab_size(small.build_model("meta"))
    if vocab is None:
        raise RecipeError(
            f"{recipe.source}: meshtrain check draws token batches, and the model reads no token "
            "ids (no vocab_size, no nn.Embedding). Check it from Python with "
            "mt.testing.assert_equivalent(..., batches=...)."
        )
    if args.start_timeout is not None:
        from meshtrain.testing.runner import get_pool

        get_pool(args.world, start_timeout_s=args.start_timeout)  # the pool the harness uses
    report = assert_equivalent(
        small.model_fn(),
        small.mesh_axes(),
        {"options": small.plan_options(), "rules": small.rules()},
        batches=TokenBatches(vocab, small.train.batch_size, small.train.seq_len),
        steps=args.steps or small.train.steps,
        optimizer=small.optimizer_fn(),
    )
    print(report.format())
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; the exit status says how it went (see the module docstring)."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args))
    except EquivalenceError as err:
        print(err.message)
        return 1
    except MeshtrainError as err:
        _say(f"{type(err).__name__}: {err.message}")
        return 2
    except KeyboardInterrupt:  # Ctrl-C before any rank started: nothing to stop or save
        _say("interrupted before training started")
        return 130


def _say(line: str, stream: TextIO | None = None) -> None:
    """One line on stderr (or ``stream``); a closed console is not an error."""
    with contextlib.suppress(OSError):
        print(line, file=stream or sys.stderr, flush=True)


def _first_line(err: BaseException, limit: int = 160) -> str:
    text = str(err).strip().splitlines()
    line = f"{type(err).__name__}: {text[0] if text else ''}"
    return line if len(line) <= limit else line[: limit - 1] + "…"


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return int(text)


def _count(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number ≥ 0")
    return int(text)
