"""The job ``meshtrain train`` runs: the launcher's checks before any rank starts, torchrun's agent,
and one rank's life under it — train, then say how it ended in one line and exit with the status
:data:`meshtrain.launch.EXIT_CODES` names.

Run directly, :func:`train_command` checks the recipe (the cheap checks first, before torch is
imported), plans it on abstract ranks, locks the run directory and starts the ranks; under torchrun
it is one rank (:func:`train_rank`).

Example (what ``meshtrain train debug --nproc 4`` runs)::

    train_command(build_parser().parse_args(["train", "debug", "--nproc", "4"]))
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from meshtrain.errors import MeshtrainError, describe_os_error
from meshtrain.files import open_for_append

if TYPE_CHECKING:
    from meshtrain.recipes.recipe import Recipe
    from meshtrain.recipes.run import RunResult


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
    torch is imported: the recipe, then a run directory another job holds), lock the run
    directory, then run torchrun's agent here."""
    from meshtrain.launch import run_agent, torchrun_arguments
    from meshtrain.recipes.preflight import check_launch, check_wandb, refuse_busy_run
    from meshtrain.recipes.quick_check import check_recipe_quickly
    from meshtrain.recipes.source import parse_recipe, read_recipe
    from meshtrain.recipes.token_check import check_recipe_tokens

    nproc = args.nproc or 1
    text, source = read_recipe(args.recipe)
    data, source = parse_recipe(text, source, args.overrides)
    check_launch(data, source, nproc=nproc, nnodes=args.nnodes)
    check_recipe_quickly(data, source)  # the schema's torch-free checks: unknown keys, types
    if args.node_rank == 0:
        refuse_busy_run(data, source)  # in seconds, not after the plan check
    check_recipe_tokens(data)  # size, sha256 (cached by size and mtime), ids in the vocabulary
    _starting(args.recipe, data, nproc, args.nnodes)  # within a second: torch is not loaded yet
    check_wandb(data, source)  # imports wandb when the run logs to it: a broken install stops here
    sets = [item for override in args.overrides for item in ("--set", override)]
    arguments = torchrun_arguments(
        ["train", args.recipe, *sets],
        nproc=nproc,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        rdzv_endpoint=args.rdzv_endpoint,
        max_restarts=args.max_restarts,
    )
    from meshtrain.files.lock import TOKEN_VARIABLE
    from meshtrain.recipes import load_recipe

    recipe = load_recipe(args.recipe, args.overrides)  # the model's own limits, before the rest
    from meshtrain.recipes.preflight import check_data_size, check_plan, check_run_files, lock_run
    from meshtrain.recipes.resume_guard import check_before_launch

    warmup, steps = recipe.train.warmup_steps, recipe.train.steps
    if warmup > steps:  # a smoke test of a long recipe: allowed, and said
        print(
            f"{recipe.name}: note: train.warmup_steps = {warmup} is longer than train.steps = "
            f"{steps}: the learning rate ramps the whole run, to {steps}/{warmup} of train.lr",
            flush=True,
        )
    checking = time.perf_counter()
    plan = check_plan(recipe, nproc * args.nnodes)
    print(
        f"{recipe.name}: plan proven on {nproc * args.nnodes} abstract ranks in "
        f"{time.perf_counter() - checking:.1f} s",
        flush=True,
    )
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
    with lock_run(recipe.run_dir, recipe.checkpoint_dir) as token:
        os.environ[TOKEN_VARIABLE] = token
        check_run_files(recipe.run_dir)
        check_before_launch(recipe)  # no silent start-over, no silent change: before the ranks
        finished = _nothing_to_train(recipe)  # decided here: no rank starts for nothing
        if finished:
            print(finished, flush=True)
            return 0
        _prepare_data(recipe)  # once, here: a bad file is refused before any rank starts
        check_data_size(recipe, plan)  # one global batch, and what [eval] reads
        print(f"{recipe.name}: starting {nproc} rank{'s' if nproc != 1 else ''}", flush=True)
        return run()


def _run_and_explain(run: functools.partial[int], data: dict) -> int:
    """Run the ranks; after a failure, name a token file that changed under the job (a rank
    whose memory-mapped tokens shrank dies by SIGBUS before it can)."""
    from meshtrain.launch import EXIT_FAILED
    from meshtrain.recipes.token_check import token_change

    code = run()
    if code == EXIT_FAILED and (changed := token_change(data)):  # a rank died without a word
        say(f"meshtrain: {changed}")
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
    allow = recipe.checkpoint.allow_unverified
    point = find_resume_point(recipe.checkpoint_dir, verify=False, allow_unverified=allow)
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
    from meshtrain.train.data import prepare_corpus
    from meshtrain.train.data.documents import FILE_SOURCES

    check_file_keys(recipe)  # data.validation or format on a source without files: refused
    if recipe.data.source in FILE_SOURCES:
        prepare_recipe_data(recipe)
    elif recipe.data.source == "corpus":  # here, not in rank 0: a bad size is refused at once
        prepare_corpus(
            Path(recipe.data.path),
            tokenizer=recipe.data.tokenizer,
            limit_bytes=recipe.data.corpus_bytes,
        )


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
        signal.signal(number, stop_now)
    try:
        code, event, line = _train_rank(args, rank)
    except StopRequested as stopped:
        code, event = EXIT_STOPPED, "stopped"
        line = f"stopped by {stopped.signal_name} before training started; nothing to save."
        line = line if rank == 0 else ""
    ended = code in (EXIT_OK, EXIT_STOPPED)
    told = report_exit(code, event, "" if ended else line)  # the launcher prints errors once
    if line and (ended or not told):
        say(line, stream=sys.stdout if ended else None)
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
            return EXIT_FAILED, "lost contact", f"[rank {rank}] lost contact ({first_line(err)})"
        return EXIT_ERROR, "error", f"[rank {rank}] RecipeError: {describe_os_error(err)}"
    except Exception as err:
        if not lost_peer(err):  # a bug: its traceback goes to a log file, its first line here
            log = _write_traceback(err, rank, recipe.run_dir if recipe is not None else None)
            return EXIT_FAILED, "crash", f"[rank {rank}] {first_line(err)} (traceback: {log})"
        line = f"[rank {rank}] lost contact with another rank ({first_line(err)}); stopping."
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
            with open_for_append(path) as handle:
                handle.write(text)
            return str(path)
    return "not written: no writable directory"


def stop_now(number: int, frame: object) -> None:
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
        return "\n".join([line, *_summary(result)])
    return (
        f"{name}: the checkpoint in {recipe.checkpoint_dir} is already at step "
        f"{result.resumed_from} of {recipe.train.steps}; nothing to train. Raise train.steps or "
        "start a new run directory."
    )


def _summary(result: RunResult) -> list[str]:
    """The lines under a finished run's last line: time, tokens and throughput, the best
    validation loss, the last checkpoint and what to run next."""
    tally, run_dir = result.tally, result.run_dir
    lines = []
    if tally is not None:
        mfu = f"MFU {tally.mfu:.1%}" if tally.mfu is not None else "MFU n/a: no peak FLOP/s known"
        lines.append(
            f"  {tally.wall_s:.1f} s in all; {tally.tokens:,} tokens in {tally.train_s:.1f} s of "
            f"steps, saves and evaluations ({tally.tokens_per_s:,.0f} tokens/s, {mfu})"
        )
        if tally.best_eval is not None:
            step, loss = tally.best_eval
            lines.append(f"  best validation loss {loss:.4f} at step {step}")
    if result.checkpoint is not None:
        lines.append(f"  last checkpoint {result.checkpoint}")
    lines += [
        f"  next: meshtrain eval {run_dir}  |  meshtrain generate {run_dir} --prompt TEXT  |  "
        f"meshtrain export {run_dir} --out {run_dir}-hf",
        "  more steps: the same command with --set train.steps=N (it resumes from the last "
        "checkpoint)",
    ]
    return lines


def say(line: str, stream: TextIO | None = None) -> None:
    """One line on stderr (or ``stream``); a closed console is not an error."""
    with contextlib.suppress(OSError):
        print(line, file=stream or sys.stderr, flush=True)


def first_line(err: BaseException, limit: int = 160) -> str:
    """``Type: first line of the message``, cut to ``limit`` characters."""
    text = str(err).strip().splitlines()
    line = f"{type(err).__name__}: {text[0] if text else ''}"
    return line if len(line) <= limit else line[: limit - 1] + "…"
