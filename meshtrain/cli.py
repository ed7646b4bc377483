"""The ``meshtrain`` command line: argument parsing only; each command calls Python functions.

``meshtrain train RECIPE [--set section.key=value ...]`` trains a recipe
(:func:`meshtrain.recipes.run.train`). Under ``torchrun`` it joins the process group; run directly
it starts ``--nproc`` local ranks through torchrun (one node by default; ``--nnodes``,
``--node-rank`` and ``--rdzv-endpoint`` make this machine one node of several). The recipe is
validated before any rank starts.

``meshtrain plan RECIPE --world N [--device-memory 80GiB] [--strategy auto] [--json]`` plans a
recipe on N abstract ranks (:func:`meshtrain.recipes.sizing.size_recipe`) and prints one rank's memory
and communication; exit status 3 when it does not fit the device memory.

``meshtrain check RECIPE [--world N] [--steps S]`` shrinks a recipe to ``N`` CPU ranks
(:func:`meshtrain.recipes.shrink`) and proves with :func:`meshtrain.testing.assert_equivalent`
that its plan trains like one device. Exit status: 0 when it does, 1 when it does not
(``EquivalenceError``), 2 for any other meshtrain error (a bad recipe, an impossible plan).

Example:
    >>> build_parser().parse_args(["check", "debug", "--world", "2"]).world
    2
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from meshtrain.errors import EquivalenceError, MeshtrainError, RecipeError
from meshtrain.recipes import describe_shrink, load_recipe, shrink
from meshtrain.recipes.models import vocab_size


def build_parser() -> argparse.ArgumentParser:
    """The parser of every subcommand."""
    parser = argparse.ArgumentParser(
        prog="meshtrain", description="JAX-style sharding specs compiled to PyTorch plans."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    check = commands.add_parser(
        "check",
        help="prove on CPU ranks that a recipe's plan trains like one device",
        description="Shrink RECIPE to N CPU ranks (same mesh axes, a small model of the same "
        "structure) and compare its plan with single-device training, step by step.",
    )
    _add_recipe(check, overrides=False)
    check.add_argument("--world", type=_positive, default=4, metavar="N",
                       help="number of CPU (gloo) ranks (default: 4)")  # fmt: skip
    check.add_argument("--steps", type=_positive, default=None, metavar="S",
                       help="training steps to compare (default: the shrunk recipe's)")  # fmt: skip
    check.set_defaults(run=check_command)

    train = commands.add_parser(
        "train",
        help="train a recipe (under torchrun, or on --nproc local ranks)",
        description="Train RECIPE. Under torchrun every rank runs this command; otherwise it "
        "starts the ranks itself through torchrun.",
    )
    _add_recipe(train)
    train.add_argument("--nproc", type=_positive, default=None, metavar="N",
                       help="ranks to start on this machine when not under torchrun (default 1)")  # fmt: skip
    train.add_argument("--nnodes", type=_positive, default=1, metavar="N",
                       help="number of nodes (machines), each running this command")  # fmt: skip
    train.add_argument("--node-rank", type=int, default=0, metavar="R",
                       help="this node's index, 0..nnodes-1")  # fmt: skip
    train.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT",
                       help="where the nodes meet (node 0's address), for --nnodes > 1")  # fmt: skip
    train.set_defaults(run=train_command)

    plan = commands.add_parser(
        "plan",
        help="per-rank memory and communication of a recipe at any world size, without hardware",
        description="Build RECIPE's model on the meta device, plan it on N abstract ranks and "
        "report one rank's memory (at rest and peak), activations per checkpointing mode, "
        "communication per mesh axis and the pipeline bubble.",
    )
    _add_recipe(plan)
    plan.add_argument("--world", type=_positive, required=True, metavar="N",
                      help="number of ranks to plan for")  # fmt: skip
    plan.add_argument("--device-memory", default=None, metavar="SIZE",
                      help="memory per device, e.g. 80GiB: says whether the plan fits")  # fmt: skip
    plan.add_argument("--strategy", choices=("recipe", "auto"), default="recipe",
                      help="the recipe's degrees, or let meshtrain choose (needs --device-memory)")  # fmt: skip
    plan.add_argument("--node-size", type=_positive, default=8, metavar="N",
                      help="devices per node, for --strategy auto (default 8)")  # fmt: skip
    plan.add_argument("--json", action="store_true", help="print JSON instead of the table")
    plan.set_defaults(run=plan_command)
    return parser


def _add_recipe(command: argparse.ArgumentParser, *, overrides: bool = True) -> None:
    """The RECIPE argument every command takes, and ``--set`` where the recipe can be changed."""
    command.add_argument("recipe", metavar="RECIPE", help="a recipe file, or a name in recipes/")
    if overrides:
        command.add_argument("--set", dest="overrides", action="append", default=[],
                             metavar="SECTION.KEY=VALUE",
                             help="override a recipe value, e.g. --set train.steps=100 (repeatable)")  # fmt: skip


def plan_command(args: argparse.Namespace) -> int:
    """``meshtrain plan``: size the recipe at ``--world`` ranks and print the report."""
    import json

    from meshtrain.recipes.sizing import size_recipe

    recipe = load_recipe(args.recipe, args.overrides)
    sizing = size_recipe(
        recipe, world=args.world, device_memory=args.device_memory, strategy=args.strategy,
        node_size=args.node_size,
    )  # fmt: skip
    if args.json:
        print(json.dumps(sizing.to_json(), indent=1, sort_keys=True))
    else:
        print(sizing.format(), end="")
    fits = sizing.footprint.fits
    return 0 if fits in (None, True) else 3


def train_command(args: argparse.Namespace) -> int:
    """``meshtrain train``: validate the recipe, then train on this rank or start the ranks."""
    from meshtrain.launch import (
        init_distributed,
        run_under_torchrun,
        torchrun_command,
        under_torchrun,
    )

    recipe = load_recipe(args.recipe, args.overrides)
    if not under_torchrun():
        sets = [item for override in args.overrides for item in ("--set", override)]
        command = torchrun_command(
            ["train", args.recipe, *sets], nproc=args.nproc or 1, nnodes=args.nnodes,
            node_rank=args.node_rank, rdzv_endpoint=args.rdzv_endpoint,
        )  # fmt: skip
        return run_under_torchrun(command)
    import torch.distributed as dist

    from meshtrain.recipes.run import train

    device = init_distributed()
    try:
        result = train(recipe, device=device)
        dist.barrier()
    except MeshtrainError as err:
        print(f"[rank {dist.get_rank()}] {type(err).__name__}: {err.message}", file=sys.stderr)
        return 2
    finally:
        dist.destroy_process_group()
    if int(os.environ.get("RANK", "0")) == 0:
        if result.losses:
            last = max(result.losses)
            print(f"{recipe.name}: trained to step {last}, loss {result.losses[last]:.4f}; "
                  f"run directory {result.run_dir}")  # fmt: skip
        else:
            print(f"{recipe.name}: the checkpoint in {recipe.checkpoint_dir} is already at step "
                  f"{result.resumed_from} of {recipe.train.steps}; nothing to train. Raise "
                  "train.steps or start a new run directory.")  # fmt: skip
    return 0


def check_command(args: argparse.Namespace) -> int:
    """``meshtrain check``: load, shrink, run the equivalence harness, print its report."""
    from meshtrain.testing.harness import TokenBatches, assert_equivalent

    recipe = load_recipe(args.recipe)
    small = shrink(recipe, args.world)
    print(describe_shrink(recipe, small), flush=True)
    vocab = vocab_size(small.build_model("meta"))
    if vocab is None:
        raise RecipeError(
            f"{recipe.source}: meshtrain check draws token batches, and the model reads no token "
            "ids (no vocab_size, no nn.Embedding). Check it from Python with "
            "mt.testing.assert_equivalent(..., batches=...)."
        )
    report = assert_equivalent(
        small.model_fn(),
        small.mesh_axes(),
        {**small.plan_options(), "rules": small.rules()},
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
        print(f"{type(err).__name__}: {err.message}", file=sys.stderr)
        return 2


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return int(text)
