"""``meshtrain check``: a recipe shrunk to a few CPU ranks, proven to train like one device with
:func:`~meshtrain.testing.harness.assert_equivalent`; the report printed.

Example (what ``meshtrain check debug --world 2`` runs)::

    check_command(build_parser().parse_args(["check", "debug", "--world", "2"]))
"""

from __future__ import annotations

import argparse

from meshtrain.errors import RecipeError


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
        progress=_say,
    )
    print(report.format())
    return 0


def _say(line: str) -> None:
    print(line, flush=True)
