"""The ``meshtrain`` command line: argument parsing only; each command calls Python functions.

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
import sys
from collections.abc import Sequence

from meshtrain.recipes import describe_shrink, load_recipe, shrink
from meshtrain.spec.errors import EquivalenceError, MeshtrainError


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
    check.add_argument("recipe", metavar="RECIPE", help="a recipe file, or a name in recipes/")
    check.add_argument("--world", type=_positive, default=4, metavar="N",
                       help="number of CPU (gloo) ranks (default: 4)")  # fmt: skip
    check.add_argument("--steps", type=_positive, default=None, metavar="S",
                       help="training steps to compare (default: the shrunk recipe's)")  # fmt: skip
    check.set_defaults(run=check_command)
    return parser


def check_command(args: argparse.Namespace) -> int:
    """``meshtrain check``: load, shrink, run the equivalence harness, print its report."""
    from meshtrain.testing.harness import TokenBatches, assert_equivalent

    recipe = load_recipe(args.recipe)
    small = shrink(recipe, args.world)
    print(describe_shrink(recipe, small), flush=True)
    report = assert_equivalent(
        small.model_fn(),
        small.mesh_axes(),
        {**small.plan_options(), "rules": small.rules()},
        batches=TokenBatches(
            small.model.config.vocab_size, small.train.batch_size, small.train.seq_len
        ),
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
