"""Resuming a run: a run stopped at step 3 and resumed from its checkpoint continues with the same
losses as the uninterrupted run — bit for bit on the same mesh, and within the new plan's
reduction-order contract when the resumed run changes the data-parallel, tensor-parallel or
pipeline degree (DCP reshards the parameters and optimizer states; the data stream resumes at
the same global batch whatever the data-parallel degree)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import meshtrain as mt
from meshtrain.recipes import load_recipe
from meshtrain.recipes.run import train
from meshtrain.testing.contract import contract_for
from meshtrain.testing.runner import get_pool
from meshtrain.train import summed_cross_entropy
from meshtrain.train.data import DistributedBatches, TokenWindows, prepare_corpus
from meshtrain.train.hf.single_file import load_safetensors

pytestmark = [pytest.mark.spmd, pytest.mark.slow]
STEPS = 6


def _overrides(root: Path, run: str, corpus: Path, *extra: str) -> list[str]:
    return [
        f"train.steps={STEPS}",
        "train.warmup_steps=2",
        "train.optimizer=sgd",
        "train.lr=0.05",
        "train.seq_len=16",
        f"data.path={corpus}",
        f"logging.run_dir={root / run}",
        "logging.console=false",
        "logging.wandb=disabled",
        "checkpoint.interval=0",
        *extra,
    ]


def run_recipe(overrides: list[str], stop_after: int | None) -> dict:
    """Runs on every rank: train the debug recipe with ``overrides``; losses by step and the
    plan's contract."""
    recipe = load_recipe("debug", overrides)
    result = train(recipe, stop_after=stop_after)
    mesh = mt.make_mesh(recipe.mesh_axes(), world_size=_world(), abstract=True)
    plan = mt.plan(recipe.build_model(device="meta"), mesh, recipe.rules(), recipe.plan_options())
    return {
        "losses": result.losses,
        "resumed_from": result.resumed_from,
        "tolerance": contract_for(plan).tolerance,
    }


def _world() -> int:
    import torch.distributed as dist

    return dist.get_world_size()


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict[int, float]]:
    root = tmp_path_factory.mktemp("resume")
    corpus = root / "corpus"
    prepare_corpus(corpus, limit_bytes=300_000)
    (result, *_) = get_pool(4).run(run_recipe, _overrides(root, "straight", corpus), None)
    assert sorted(result["losses"]) == list(range(1, STEPS + 1))
    return root, corpus, result["losses"]


@pytest.mark.parametrize(
    ("world", "extra", "same_mesh"),
    [
        (4, (), True),  # {dp: 2, tp: 2} → the same
        (2, (), False),  # {dp: 2, tp: 2} → {dp: 1, tp: 2}: dp changes
        (4, ("mesh.tp=1",), False),  # → {dp: 4, tp: 1}: tp changes
        (4, ("mesh.tp=1", "mesh.pp=2", "parallel.pipeline.schedule=1F1B"), False),  # → pp 2 × dp 2
    ],
    ids=["same-mesh", "dp2tp2-to-dp1tp2", "dp2tp2-to-dp4", "dp2tp2-to-pp2dp2"],
)
def test_resumed_run_continues_the_uninterrupted_losses(
    uninterrupted: tuple[Path, Path, dict[int, float]],
    world: int,
    extra: tuple[str, ...],
    same_mesh: bool,
) -> None:
    root, corpus, straight = uninterrupted
    run = f"resumed-{world}-{'-'.join(extra) or 'same'}"
    first = get_pool(4).run(run_recipe, _overrides(root, run, corpus), 3)[0]
    assert sorted(first["losses"]) == [1, 2, 3]
    assert first["losses"] == {step: straight[step] for step in (1, 2, 3)}  # same mesh, bitwise
    second = get_pool(world).run(run_recipe, _overrides(root, run, corpus, *extra), None)[0]
    assert second["resumed_from"] == 3
    assert sorted(second["losses"]) == [4, 5, 6]
    if same_mesh:
        assert second["losses"] == {step: straight[step] for step in (4, 5, 6)}
        return
    # The first resumed step starts from exactly the saved state: its loss differs from the
    # uninterrupted run's only by the new plan's reduction order (the contract's per-step bound).
    # SGD adds at most one such bound per further step.
    tolerance = second["tolerance"]
    for k, step in enumerate((4, 5, 6), start=1):
        error = abs(second["losses"][step] - straight[step]) / abs(straight[step])
        assert error <= k * tolerance, (step, error, tolerance)


def test_exported_safetensors_start_a_new_run(
    uninterrupted: tuple[Path, Path, dict[int, float]],
) -> None:
    """A run exports its final weights to one safetensors file; a new run that starts from that
    file (``checkpoint.init_from``) sees, at its first step, the loss those weights give on one
    device for the first global batch."""
    root, corpus, straight = uninterrupted
    exported = root / "exported.safetensors"
    first = get_pool(4).run(
        run_recipe, _overrides(root, "export", corpus, f"checkpoint.export={exported}"), 3
    )[0]
    assert first["losses"] == {step: straight[step] for step in (1, 2, 3)}
    assert exported.is_file()
    start = _overrides(root, "from-export", corpus, f"checkpoint.init_from={exported}")
    second = get_pool(4).run(run_recipe, start, 1)[0]

    recipe = load_recipe("debug", start)
    model = recipe.build_model(seed=123)  # a different init: every weight must come from the file
    load_safetensors(exported, model)
    loader = DistributedBatches(
        TokenWindows(corpus, recipe.train.seq_len),
        recipe.train.batch_size,
        0,
        1,
        seed=recipe.data.seed,
    )
    batch = next(iter(loader.batches()))
    with torch.no_grad():
        expected = (
            float(summed_cross_entropy(model(batch.inputs), batch.targets)) / batch.targets.numel()
        )
    assert abs(second["losses"][1] - expected) <= second["tolerance"] * abs(expected)
    assert second["losses"][1] != straight[1]  # it did not start from the seed's weights
