"""Pipeline stage splitting: balanced contiguous cuts, explicit split points, errors at plan time."""

from __future__ import annotations

import itertools

import pytest
from helpers import TiedMLP
from hypothesis import given
from hypothesis import strategies as st

from meshtrain import PlanError
from meshtrain.models import LlamaConfig, build_llama
from meshtrain.plan.pipeline.stages import _balanced_starts, split_stages


def llama(layers: int, vocab: int = 256):
    return build_llama(
        LlamaConfig.preset("debug", n_layers=layers, vocab_size=vocab), device="meta"
    )


def test_every_unit_lands_on_exactly_one_stage_and_params_add_up() -> None:
    model = llama(6)
    stages = split_stages(model, 3)
    modules = [fqn for stage in stages for fqn in stage.modules]
    assert modules == ["tok_embeddings", *[f"layers.{i}" for i in range(6)], "norm", "output"]
    assert sum(stage.params for stage in stages) == sum(p.numel() for p in model.parameters())
    assert stages[0].extras == ("tok_embeddings",) and stages[-1].extras == ("norm", "output")


def test_heavy_embedding_and_head_push_blocks_to_the_middle() -> None:
    # vocab 4096: embedding and head (262,144 parameters each) outweigh a block (~37k), so the
    # first and last stages get one block each.
    stages = split_stages(llama(8, vocab=4096), 3)
    assert [len(stage.blocks) for stage in stages] == [1, 6, 1]


def test_explicit_split_points() -> None:
    stages = split_stages(llama(4), 2, split=["layers.3"])
    assert [stage.blocks for stage in stages] == [
        ("layers.0", "layers.1", "layers.2"),
        ("layers.3",),
    ]


def test_tied_weights_count_once() -> None:
    model = TiedMLP()
    stages = split_stages(model, 2)
    assert sum(stage.params for stage in stages) == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    ("stages", "split", "message"),
    [
        (5, "auto", r"has 4 repeated blocks but the pipeline asks for 5 stages"),
        (2, ["layers.9"], r"split point 'layers.9' is not a repeated block FQN"),
        (2, ["layers.1", "layers.2"], r"gives 2 split points for 2 stages"),
        (3, ["layers.2", "layers.1"], r"does not come after the previous stage's first block"),
        (2, "even", r"split='even': use 'auto' or a list of block FQNs"),
    ],
)
def test_bad_splits_are_plan_errors(stages: int, split: object, message: str) -> None:
    with pytest.raises(PlanError, match=message):
        split_stages(llama(4), stages, split=split)  # type: ignore[arg-type]


@given(st.lists(st.integers(1, 100), min_size=1, max_size=8), st.data())
def test_auto_split_minimises_the_heaviest_stage(weights: list[int], data: st.DataObject) -> None:
    n_stages = data.draw(st.integers(1, len(weights)))
    starts = _balanced_starts(weights, n_stages)
    assert starts[0] == 0 and starts == sorted(set(starts)) and len(starts) == n_stages

    def heaviest(cuts: tuple[int, ...]) -> int:
        bounds = [0, *cuts, len(weights)]
        return max(sum(weights[a:b]) for a, b in itertools.pairwise(bounds))

    best = min(
        heaviest(cuts) for cuts in itertools.combinations(range(1, len(weights)), n_stages - 1)
    )
    assert heaviest(tuple(starts[1:])) == best
