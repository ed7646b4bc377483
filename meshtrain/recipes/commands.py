"""The commands that answer from a recipe or a run directory, one function each, called by
:mod:`meshtrain.cli` with its parsed arguments: ``plan``, ``checkpoints``, ``export``, ``eval``,
``generate`` and ``recipe list``, ``recipe cp``, ``recipe from-deepspeed``. Each prints its answer and returns its exit status.

Example (what ``meshtrain checkpoints runs/debug --quick`` runs)::

    checkpoints_command(build_parser().parse_args(["checkpoints", "runs/debug", "--quick"]))
"""

from __future__ import annotations

import argparse
import functools
import signal
from pathlib import Path

from meshtrain.errors import MeshtrainError
from meshtrain.recipes.job import say, stop_now


def eval_command(args: argparse.Namespace) -> int:
    """``meshtrain eval``: the validation loss of a run's newest intact checkpoint."""
    from meshtrain.recipes.evaluation import evaluate_run, load_run

    run = load_run(args.run_dir, trust_factory=args.trust_factory)
    for line in run.passed_over:
        say(f"warning: {line}")
    print(f"loaded {run.checkpoint} (step {run.step}) in {run.seconds:.1f} s", flush=True)
    result, what = evaluate_run(run, batches=args.batches)
    print(
        f"step {run.step} | val_loss {result.loss:.4f} | val_perplexity "
        f"{result.perplexity:.4g} | {result.tokens:,} tokens of {what}"
    )
    return 0


def generate_command(args: argparse.Namespace) -> int:
    """``meshtrain generate``: a continuation of each ``--prompt`` from a run's checkpoint, the
    only one streamed as it comes, several printed in order with a blank line between."""
    from meshtrain.recipes.evaluation import load_run
    from meshtrain.recipes.generation import generate_batch, stream
    from meshtrain.recipes.sampling import Sampling, sampling_flags

    sampling = Sampling(
        **{keywords["dest"]: getattr(args, keywords["dest"]) for _, keywords in sampling_flags()}
    )
    run = load_run(args.run_dir, trust_factory=args.trust_factory)
    for line in run.passed_over:
        say(f"warning: {line}")
    say(f"loaded {run.checkpoint} (step {run.step}) in {run.seconds:.1f} s")
    settings = {"max_new_tokens": args.max_new_tokens, "sampling": sampling, "seed": args.seed}
    if len(args.prompt) == 1:
        print(args.prompt[0], end="", flush=True)
        for piece in stream(run, args.prompt[0], stop=args.stop, **settings):
            print(piece, end="", flush=True)
        print()
        return 0
    texts = generate_batch(run, args.prompt, stop=args.stop, **settings)
    print("\n\n".join(prompt + text for prompt, text in zip(args.prompt, texts)))
    return 0


def recipe_list_command(args: argparse.Namespace) -> int:
    """``meshtrain recipe list``: one line per recipe a name finds."""
    from meshtrain.recipes.catalog import recipe_entries, recipe_table

    print(recipe_table(recipe_entries()))
    return 0


def recipe_cp_command(args: argparse.Namespace) -> int:
    """``meshtrain recipe cp NAME DEST``: a copy of a recipe to edit."""
    from meshtrain.recipes.catalog import copy_recipe

    source, target = copy_recipe(args.name, args.destination)
    print(f"wrote {target} (a copy of {source}); train it with `meshtrain train {target}`")
    return 0


def from_deepspeed_command(args: argparse.Namespace) -> int:
    """``meshtrain recipe from-deepspeed``: write the recipe a DeepSpeed config means."""
    from meshtrain.recipes.deepspeed import read_deepspeed, translate_deepspeed

    if not Path(args.out).resolve().parent.is_dir():
        raise MeshtrainError(
            f"--out {args.out}: its directory {str(Path(args.out).resolve().parent)!r} does not "
            "exist. Create it first, or write the recipe elsewhere."
        )
    translation = translate_deepspeed(read_deepspeed(args.config), model=args.model)  # no torch
    steps = [f"train.steps={args.steps}"] if args.steps else []
    if args.overrides or steps:
        translation.override([*args.overrides, *steps], args.config)
    from meshtrain.recipes import recipe_from_toml

    recipe = recipe_from_toml(translation.toml(args.config), source=args.out)  # a valid recipe
    resolved = translation.resolve(recipe)
    Path(args.out).write_text(translation.toml(args.config), encoding="utf-8")
    print(
        f"wrote {args.out}: {len(translation.settings)} settings"
        + (f'; "auto" filled from the recipe: {len(resolved)}' if resolved else "")
        + (
            f"; tuning knobs without effect on the numbers: {len(translation.tuning)}"
            if translation.tuning
            else ""
        )
    )
    for line in resolved:
        print(f"  {line}")
    return 0


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
        progress=functools.partial(print, flush=True),
    )
    if args.json:
        print(json.dumps(sizing.to_json(), indent=1, sort_keys=True))
    else:
        print(sizing.format(), end="")
    fits = sizing.footprint.fits
    return 0 if fits in (None, True) else 3


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
            f"{step:>10}  {status.status:<10}  {size_text(status.size_bytes):>10}  "
            f"{status.path.name}{why}"
        )
    resumable = [status for status in statuses if status.loadable]
    if any(status.status == "unverified" for status in statuses):
        print("checkpoints without checksums load only with --set checkpoint.allow_unverified=true")
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
        signal.signal(number, stop_now)
    try:
        with byte_progress(f"exporting {args.run_dir}") as progress:
            report = export_run(
                args.run_dir,
                args.out,
                format=args.format,
                max_shard_size=args.max_shard_size,
                dtype=dtype,
                progress=progress,
                say=say,
            )
    except (KeyboardInterrupt, StopRequested) as err:
        name = err.signal_name if isinstance(err, StopRequested) else "SIGINT"
        say(
            f"export stopped by {name}: nothing was written to {args.out} (its scratch folder "
            "was removed); the checkpoint is unchanged. Run the same command again."
        )
        return 130
    print(
        f"wrote {report.out_dir}: {report.tensors} tensors, {size_text(report.total_bytes)} in "
        f"{len(report.files)} safetensors file{'s' if len(report.files) != 1 else ''}, from "
        f"{report.checkpoint}"
    )
    return 0


def size_text(size: int) -> str:
    """Bytes as ``1.5 GiB``."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size} B"
