"""Nothing on disk redirects a write: a symbolic link where meshtrain writes in a run, data or
checkpoint directory is refused with one line naming it, and the file it points to is left as
it was. Before, a run directory made beforehand with ``config.json``, ``plan.txt``,
``plan.json``, ``metrics.jsonl`` or ``meshtrain.lock`` linked to files elsewhere had a fresh run
overwrite or append to those files (run as root on a shared volume: any file).

Each writer is tried on a real link to a real file (no mocks of the filesystem), and the
launcher on a real run directory."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from meshtrain import launch as launch_module
from meshtrain.cli import main
from meshtrain.errors import CheckpointError
from meshtrain.files import open_for_append, replaced_atomically, write_text_atomically
from meshtrain.files.lock import LOCK_FILE, acquire_run_lock
from meshtrain.recipes.token_check import verify_token_file
from meshtrain.train.checkpoint.files import write_state_file
from meshtrain.train.metrics import (
    METRICS_FILE,
    WANDB_RUN_ID_FILE,
    JsonlSink,
    LoggingConfig,
    WandbSink,
    truncate_jsonl,
)
from meshtrain.train.metrics.sinks import RUN_DIR_FILES, RUN_FILES, RunFilesSink

VICTIM_TEXT = "someone else's file\n"


def _victim(tmp_path: Path) -> Path:
    victim = tmp_path / "elsewhere" / "victim.txt"
    victim.parent.mkdir(exist_ok=True)
    victim.write_text(VICTIM_TEXT)
    return victim


def _linked(run_dir: Path, name: str, victim: Path) -> Path:
    link = run_dir / name
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(victim)
    return link


def _run_files(run_dir: Path) -> None:
    RunFilesSink(run_dir).start(config={"a": 1}, plan_text="plan", plan_json="{}")


def _metrics(run_dir: Path) -> None:
    sink = JsonlSink(run_dir / METRICS_FILE)
    sink.log(1, {"loss": 1.0})


def _wandb_run_id(run_dir: Path) -> None:
    sink = WandbSink(LoggingConfig(wandb="offline"), run_dir=run_dir, run_name="r")
    sink._run_id()


WRITERS: dict[str, tuple[str, Callable[[Path], object]]] = {
    **{name: (name, _run_files) for name in RUN_FILES},
    "metrics": (METRICS_FILE, _metrics),
    "metrics-truncated": (METRICS_FILE, lambda run_dir: truncate_jsonl(run_dir / METRICS_FILE, 0)),
    "wandb-run-id": (WANDB_RUN_ID_FILE, _wandb_run_id),
    "lock": (LOCK_FILE, acquire_run_lock),
    "rank-log": ("logs/rank-0.log", lambda run_dir: open_for_append(run_dir / "logs/rank-0.log")),
    "checkpoint-state": ("ckpt/meshtrain.json", lambda d: write_state_file(d / "ckpt", "{}")),
    "whole-file": ("data/tokens.json", lambda d: write_text_atomically(d / "data/tokens.json", "")),
}


@pytest.mark.parametrize("case", list(WRITERS))
def test_every_writer_refuses_a_link_and_leaves_its_target_alone(tmp_path: Path, case: str) -> None:
    name, write = WRITERS[case]
    run_dir = tmp_path / "run"
    victim = _victim(tmp_path)
    link = _linked(run_dir, name, victim)
    with pytest.raises(CheckpointError) as refusal:
        write(run_dir)
    text = str(refusal.value)
    assert "\n" not in text and f"refusing to write {str(link)!r}: it is a symbolic link" in text
    assert str(victim) in text and "Remove the link" in text
    assert victim.read_text() == VICTIM_TEXT and link.is_symlink()


def test_a_dangling_link_is_refused_too_and_nothing_is_created_through_it(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    target = tmp_path / "elsewhere" / "created-by-the-run.txt"
    target.parent.mkdir()
    _linked(run_dir, "plan.txt", target)
    with pytest.raises(CheckpointError, match="it is a symbolic link"):
        _run_files(run_dir)
    with pytest.raises(CheckpointError, match="it is a symbolic link"):
        open_for_append(run_dir / "plan.txt")
    assert not target.exists()


def test_scratch_files_are_new_files_and_never_outlive_the_write(tmp_path: Path) -> None:
    with replaced_atomically(tmp_path / "state.json") as scratch:
        assert scratch.is_file() and scratch.stat().st_size == 0
        scratch.write_text("{}")
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]


def test_a_link_in_the_token_cache_is_refused(tmp_path: Path) -> None:
    """The token check's cache says a token file was verified: read through a link it could
    skip the check, written through one it would clobber the target. Refused, naming it."""
    import numpy as np

    data = tmp_path / "data"
    data.mkdir()
    np.array([1, 2, 3], dtype=np.uint16).tofile(data / "tokens.bin")
    import hashlib

    meta = {
        "num_tokens": 3,
        "vocab_size": 8,
        "dtype": "uint16",
        "sha256": hashlib.sha256((data / "tokens.bin").read_bytes()).hexdigest(),
    }
    (data / "tokens.json").write_text(json.dumps(meta))
    from meshtrain.recipes.token_check import CACHE_FILE

    victim = _victim(tmp_path)
    _linked(data, CACHE_FILE, victim)
    with pytest.raises(CheckpointError, match=r"tokens\.verified\.json': it is a symbolic link"):
        verify_token_file(data)
    assert victim.read_text() == VICTIM_TEXT


@pytest.fixture
def no_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    def started(*args: object, **kwargs: object) -> int:
        raise AssertionError("the launcher started ranks")

    monkeypatch.setattr(launch_module, "run_agent", started)


@pytest.mark.parametrize("name", [*RUN_DIR_FILES, LOCK_FILE, "logs/rank-0.log"])
def test_the_launcher_refuses_a_linked_run_directory_before_any_rank_starts(
    tmp_path: Path, name: str, no_ranks: None, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    victim = _victim(tmp_path)
    _linked(run_dir, name, victim)
    sets = ["--set", "data.source=synthetic", "--set", f"logging.run_dir={run_dir}"]
    assert main(["train", "debug", "--nproc", "2", "--set", "logging.wandb=disabled", *sets]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("CheckpointError: refusing to write ")
    assert str(run_dir / name) in err and "symbolic link" in err
    assert victim.read_text() == VICTIM_TEXT
