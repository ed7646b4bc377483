"""No silent start-over and no silent change on resume (issue 33, points 1 and 2), in one
process: checkpoint folders that lack a file block a fresh start and are named when passed over;
the recipe a checkpoint was saved with is compared with the resuming one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from meshtrain import CheckpointError
from meshtrain.recipes import load_recipe
from meshtrain.recipes.resume_check import check_resume, compare_recipes
from meshtrain.recipes.resume_guard import check_before_launch, check_recipe_unchanged
from meshtrain.recipes.schema import key_table
from meshtrain.recipes.sections import SECTION_TYPES, FreeForm, about, resume_rule
from meshtrain.train.checkpoint import CheckpointConfig, Checkpointer, find_resume_point
from meshtrain.train.checkpoint.files import METADATA_FILE, STATE_FILE


def _save(directory: Path, *steps: int) -> None:
    checkpointer = Checkpointer(CheckpointConfig(directory, keep_last=0))
    for step in steps:
        weights = {"w": torch.arange(8.0) + step}
        checkpointer.save(step, weights, None, {"step": step})


@pytest.mark.parametrize("removed", [METADATA_FILE, STATE_FILE])
def test_checkpoints_each_missing_a_file_block_a_fresh_start_and_are_named(
    tmp_path: Path, removed: str
) -> None:
    _save(tmp_path, 1, 2)
    for step in (1, 2):
        (tmp_path / f"step_{step:08d}" / removed).unlink()
    point = find_resume_point(tmp_path)
    assert point.checkpoint is None
    with pytest.raises(CheckpointError) as caught:
        point.refuse_start_over(tmp_path)
    message = caught.value.message
    assert "holds 2 checkpoint folders that a fresh start would overwrite" in message
    assert "step_00000002: " in message and "step_00000001: " in message
    assert removed in message and "--set checkpoint.resume=false" in message


def test_a_newest_checkpoint_missing_its_metadata_is_named_when_passed_over(
    tmp_path: Path,
) -> None:
    _save(tmp_path, 1, 2)
    (tmp_path / "step_00000002" / METADATA_FILE).unlink()
    point = find_resume_point(tmp_path)
    assert point.checkpoint == tmp_path / "step_00000001"
    (line,) = point.describe_passed_over()
    assert line == (f"passed over {tmp_path / 'step_00000002'}: damaged ({METADATA_FILE}: missing)")
    point.refuse_start_over(tmp_path)  # something to resume: no refusal


def test_an_unfinished_first_save_does_not_block_a_fresh_start(tmp_path: Path) -> None:
    (tmp_path / "step_00000002.tmp-1a2b3c4d").mkdir()
    point = find_resume_point(tmp_path)
    assert point.checkpoint is None and len(point.passed_over) == 1
    point.refuse_start_over(tmp_path)


def test_an_unreadable_checkpoint_folder_blocks_a_fresh_start(tmp_path: Path) -> None:
    (tmp_path / "step_00000004").write_text("not a folder")
    point = find_resume_point(tmp_path)
    with pytest.raises(CheckpointError, match=r"step_00000004: damaged \(not a directory\)"):
        point.refuse_start_over(tmp_path)


@pytest.mark.parametrize(
    ("override", "key", "saved", "now"),
    [
        ("train.batch_size=16", "train.batch_size", 8, 16),
        ("train.seq_len=32", "train.seq_len", 64, 32),
        ("data.seed=7", "data.seed", 0, 7),
        ("data.path='other/corpus'", "data.path", "data/corpus", "other/corpus"),
        ("data.corpus_bytes=1000", "data.corpus_bytes", 4_000_000, 1000),
        ("model.dim=96", "model.dim", None, 96),
        ("train.optimizer='sgd'", "train.optimizer", "adamw", "sgd"),
        ("train.seed=1", "train.seed", 0, 1),
        ("parallel.precision='bf16'", "parallel.precision", "fp32", "bf16"),
        ("train.lr=0.01", "train.lr", 0.003, 0.01),
        ("data.validation=0.1", "data.validation", 0.0, 0.1),
    ],
)
def test_a_change_of_what_training_means_is_refused_naming_the_key_and_both_values(
    override: str, key: str, saved: object, now: object
) -> None:
    before = load_recipe("debug").raw
    after = load_recipe("debug", [override]).raw
    verdict = check_resume(before, after)
    assert [(change.key, change.saved, change.now) for change in verdict.refused] == [
        (key, saved, now)
    ]
    with pytest.raises(CheckpointError) as caught:
        verdict.raise_if_refused("runs/debug/checkpoints/step_00000006")
    shown = "unset" if saved is None else repr(saved)
    assert f"  - {key}: {shown} → {now!r}" in caught.value.message
    assert f"--allow-change {key}" in caught.value.message


def test_safe_changes_pass_with_a_line_each_and_allowed_ones_say_what_happens_to_the_data() -> None:
    before = load_recipe("debug").raw
    after = load_recipe(
        "debug",
        [
            "train.steps=400",
            "mesh.tp=1",
            "checkpoint.interval=5",
            "logging.log_every=1",
            "train.batch_size=16",
            "checkpoint.allow_change=['train.batch_size']",
        ],
    ).raw
    verdict = check_resume(before, after, allowed=("train.batch_size",), data_step=6)
    assert verdict.refused == ()
    text = "\n".join(verdict.lines)
    for key in ("train.steps", "mesh.tp", "checkpoint.interval", "logging.log_every"):
        assert f"resuming with a changed {key}: " in text and "(safe" in text
    assert (
        "train.batch_size: 8 → 16, allowed: the position is counted in global batches: the next "
        "batch starts at sample 96 of its epoch instead of 48, so samples 48–95 are skipped"
    ) in text


@pytest.mark.parametrize(
    "override",
    [
        "eval.every=3",
        "eval.batches=2",
        "profile.steps=[2, 4]",
        "profile.memory=false",
        "logging.wandb='disabled'",
        "train.heartbeat_timeout=300",
        "parallel.context='cp'",
    ],
)
def test_evaluation_profiling_logging_and_the_heartbeat_may_change_on_resume(override: str) -> None:
    """What only observes the run (evaluation, profiling, logging, the heartbeat) or lays it out
    (context parallelism) changes nothing trained: accepted, and said."""
    before = load_recipe("debug").raw
    after = load_recipe("debug", [override]).raw
    verdict = check_resume(before, after)
    assert verdict.refused == ()
    key = override.split("=")[0]
    assert [line for line in verdict.lines if f"resuming with a changed {key}: " in line]


def test_every_recipe_key_declares_its_resume_rule() -> None:
    """The rule lives with the key (``about(..., resume=...)``, required): every key of every
    section has one and the check reads it; a key no section declares is refused."""
    for section, section_type in SECTION_TYPES.items():
        keys = (
            [section]
            if isinstance(section_type, FreeForm)
            else [
                f"{section}.{key}"
                for key, spec in key_table(section).items()
                if spec.kinds != (dict,)
            ]
        )
        for key in keys:
            rule = resume_rule(
                key if isinstance(section_type, dict) or "." in key else f"{key}.anything"
            )
            assert rule in ("safe", "refuse"), key
    with pytest.raises(TypeError, match="resume"):
        about("a key without a rule", 1)  # type: ignore[call-arg]
    assert compare_recipes({"train": {"new_key": 1}}, {"train": {"new_key": 2}})[0].safe is False
    assert compare_recipes({"lora": {"rank": 8}}, {"lora": {"rank": 16}})[0].safe is False


def test_absent_keys_compare_as_their_defaults() -> None:
    assert compare_recipes({"checkpoint": {"keep_last": 3}}, {}) == []
    assert compare_recipes({"train": {"on_nonfinite": "skip"}}, {"train": {}}) == []


def test_the_launcher_refuses_a_changed_recipe_before_any_rank_starts(tmp_path: Path) -> None:
    run = [f"logging.run_dir={tmp_path}"]
    saved = load_recipe("debug", run)
    checkpointer = Checkpointer(CheckpointConfig(saved.checkpoint_dir, keep_last=0))
    extra = {
        "step": 6,
        "data": {"epoch": 0, "step": 6},
        "recipe": saved.raw,
        "run": {"id": "a1b2c3", "recipe": "debug"},
    }
    checkpointer.save(6, {"w": torch.zeros(4)}, None, extra)
    check_before_launch(load_recipe("debug", [*run, "train.steps=400", "mesh.tp=1"]))
    with pytest.raises(CheckpointError, match=r"  - train\.batch_size: 8 → 16\n"):
        check_before_launch(load_recipe("debug", [*run, "train.batch_size=16"]))
    allowed = load_recipe(
        "debug", [*run, "train.batch_size=16", "checkpoint.allow_change=['train.batch_size']"]
    )
    check_before_launch(allowed)
    lines = check_recipe_unchanged(allowed, saved.checkpoint_dir / "step_00000006")
    assert lines == [
        "resuming of run a1b2c3 with a changed train.batch_size: 8 → 16, allowed: the position "
        "is counted in global batches: the next batch starts at sample 96 of its epoch instead "
        "of 48, so samples 48–95 are skipped"
    ]
    (saved.checkpoint_dir / "step_00000006" / METADATA_FILE).unlink()
    with pytest.raises(CheckpointError, match="a fresh start would overwrite"):
        check_before_launch(load_recipe("debug", run))
