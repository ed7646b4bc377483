"""The ``meshtrain`` command line: argument parsing only; each command calls one Python function:
``train`` (:func:`meshtrain.recipes.job.train_command`), ``check``
(:mod:`meshtrain.testing.recipe_check`), ``plan``, ``checkpoints``, ``export``, ``eval``,
``generate`` and ``recipe list|cp|from-deepspeed`` (:mod:`meshtrain.recipes.commands`).

Every command that takes a RECIPE takes ``--set section.key=value`` for any section. Exit status:
0 done, 1 a rank failed (``check``: not equivalent; ``checkpoints``: none intact), 2 a meshtrain
error, 3 a plan that does not fit (``plan``), 4 restarts spent, 75 stopped by a signal after
saving (run the same command to resume), 124 a rank stopped making progress, 130 interrupted
before training started — :data:`meshtrain.launch.EXIT_CODES`; docs/training.md has the details.

Example:
    >>> build_parser().parse_args(["check", "debug", "--world", "2"]).world
    2
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from meshtrain.errors import EquivalenceError, MeshtrainError
from meshtrain.recipes import commands as answers
from meshtrain.recipes.job import say, train_command
from meshtrain.recipes.sampling import sampling_flags


def check_command(args: argparse.Namespace) -> int:
    """``meshtrain check`` (:mod:`meshtrain.testing.recipe_check`, imported when run: torch)."""
    from meshtrain.testing.recipe_check import check_command as check

    return check(args)


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
    _number(check, "--world", 4, "N", "number of CPU (gloo) ranks (default: 4)")
    _number(check, "--steps", None, "S", "training steps to compare (default: the shrunk recipe's)")
    _number(
        check,
        "--start-timeout",
        None,
        "S",
        "seconds the CPU ranks may go without progress while starting "
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
    _number(
        train,
        "--nproc",
        None,
        "N",
        "ranks to start on this machine when not under torchrun (default 1)",
    )
    _number(train, "--nnodes", 1, "N", "number of nodes (machines), each running this command")
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
    _number(
        train,
        "--stop-timeout",
        None,
        "S",
        "seconds the ranks get to finish their step and save after SIGTERM "
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
    checkpoints.set_defaults(run=answers.checkpoints_command)


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
    _number(plan, "--node-size", 8, "N", "devices per node, for --strategy auto (default 8)")
    plan.add_argument("--json", action="store_true", help="print JSON instead of the table")
    plan.set_defaults(run=answers.plan_command)


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
    export.set_defaults(run=answers.export_command)


def _add_answer_commands(commands: argparse._SubParsersAction) -> None:
    """``eval``, ``generate`` and ``recipe from-deepspeed``."""
    evaluate = commands.add_parser(
        "eval",
        help="validation loss and perplexity of a run's latest intact checkpoint",
        description="Load the newest intact checkpoint of RUN_DIR on one process (whatever plan "
        "trained it) and print its loss and perplexity on the run's validation split (or its "
        "training data when it has none).",
    )
    _add_run_dir(evaluate, builds_model=True)
    _number(evaluate, "--batches", None, "M", "batches to evaluate (default: [eval] batches)")
    evaluate.set_defaults(run=answers.eval_command)
    generate = commands.add_parser(
        "generate",
        help="sample a continuation of a prompt from a run's latest intact checkpoint",
        description="Load the newest intact checkpoint of RUN_DIR on one process and continue "
        "each --prompt TEXT with the run's tokenizer (streamed when there is one), stopping at "
        "the end-of-document token or before a --stop string S. (+): repeatable.",
    )
    _add_run_dir(generate, builds_model=True)
    generate.add_argument("--prompt", action="append", required=True, metavar="TEXT", help="(+)")
    generate.add_argument("--stop", action="append", default=[], metavar="S", help="(+)")
    _number(generate, "--max-new-tokens", 64, "N", "tokens to generate at most (default 64)")
    for flag, keywords in sampling_flags():
        generate.add_argument(flag, **keywords)
    generate.add_argument("--seed", type=int, default=0, help="the sampling seed (default 0)")
    generate.set_defaults(run=answers.generate_command)
    recipe = commands.add_parser("recipe", help="list, copy and translate recipes")
    actions = recipe.add_subparsers(dest="action", required=True, metavar="ACTION")
    listing = actions.add_parser("list", help="the recipes a name finds: model, mesh, summary")
    listing.set_defaults(run=answers.recipe_list_command)
    copy = actions.add_parser("cp", help="copy a recipe to edit: recipe cp NAME DEST")
    copy.add_argument("name", metavar="NAME", help="a name `recipe list` shows")
    copy.add_argument("destination", metavar="DEST", help="a new file, or a directory")
    copy.set_defaults(run=answers.recipe_cp_command)
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
    _number(deepspeed, "--steps", None, "N", "train.steps of the recipe (as --set train.steps=N)")
    _add_overrides(deepspeed)
    deepspeed.set_defaults(run=answers.from_deepspeed_command)


def _version() -> str:
    """meshtrain's version, from the installed package's metadata."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("meshtrain")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def _number(
    command: argparse.ArgumentParser, flag: str, default: int | None, metavar: str, text: str
) -> None:
    """An option that takes a positive whole number."""
    command.add_argument(flag, type=_positive, default=default, metavar=metavar, help=text)


def _add_run_dir(command: argparse.ArgumentParser, *, builds_model: bool = False) -> None:
    """The RUN_DIR argument of the commands that read a run's checkpoints, and
    ``--trust-factory`` for those that build its model."""
    command.add_argument("run_dir", metavar="RUN_DIR", help="a run directory, e.g. runs/debug")
    if builds_model:
        command.add_argument(
            "--trust-factory",
            metavar="MODULE:FUNCTION",
            help="import the model factory the run's recipe names (never imported otherwise)",
        )


def _add_recipe(command: argparse.ArgumentParser) -> None:
    """The RECIPE argument every command takes, and ``--set`` to change any of its values."""
    command.add_argument("recipe", metavar="RECIPE", help="a recipe file, or a name in recipes/")
    _add_overrides(command)


def _add_overrides(command: argparse.ArgumentParser) -> None:
    """``--set SECTION.KEY=VALUE``, repeatable."""
    command.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override a recipe value, e.g. --set train.steps=100 or "
        "--set lora.rank=8 (repeatable)",
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; the exit status says how it went (see the module docstring)."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args))
    except EquivalenceError as err:
        print(err.message)
        return 1
    except MeshtrainError as err:
        say(f"{type(err).__name__}: {err.message}")
        return 2
    except KeyboardInterrupt:  # Ctrl-C before any rank started: nothing to stop or save
        say("interrupted before training started")
        return 130


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return int(text)


def _count(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number ≥ 0")
    return int(text)
