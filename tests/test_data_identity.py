"""Data identity on resume: a file source's files are recorded (path, size, sha256) when their
tokens are prepared and in every checkpoint; a resume on changed files is refused naming the
file (``--allow-change data.path`` continues on purpose), and prepared tokens are never reused
for files whose content changed, even when size and modification time were kept.

Before, a replaced or appended JSONL was re-tokenised and the run resumed at its old data
position in other tokens, without a word; an edit that kept size and mtime reused stale tokens."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from meshtrain import launch as launch_module
from meshtrain.cli import main
from meshtrain.recipes import load_recipe
from meshtrain.recipes.resume_guard import check_recipe_unchanged
from meshtrain.recipes.run import train
from meshtrain.testing.runner import get_pool
from meshtrain.train.checkpoint import find_resume_point
from meshtrain.train.data import TokenFile
from meshtrain.train.data.documents import DocumentSource
from meshtrain.train.data.packed import prepare_documents
from meshtrain.train.data.tokenizer import ByteTokenizer

ROWS = [{"text": f"document {i}: " + "words " * (i % 7 + 3)} for i in range(200)]


def _write(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def test_an_edit_that_keeps_size_and_mtime_is_tokenised_again(tmp_path: Path) -> None:
    data = tmp_path / "train.jsonl"
    _write(data, ROWS)
    out = tmp_path / "prepared"
    source = DocumentSource("jsonl", str(data))
    first = prepare_documents(source, ByteTokenizer(), out)
    assert not first.reused and prepare_documents(source, ByteTokenizer(), out).reused
    before = TokenFile(out / "train").info.sha256
    status = data.stat()
    data.write_text(data.read_text().replace("document 7:", "document X:"))  # same size
    os.utime(data, ns=(status.st_atime_ns, status.st_mtime_ns))  # same modification time
    assert data.stat().st_size == status.st_size and data.stat().st_mtime_ns == status.st_mtime_ns
    again = prepare_documents(source, ByteTokenizer(), out)
    assert not again.reused and TokenFile(out / "train").info.sha256 != before


def _overrides(root: Path, data: Path) -> list[str]:
    return [
        "train.steps=4",
        "train.warmup_steps=1",
        "train.seq_len=32",
        "train.batch_size=4",
        "mesh.tp=1",
        "data.source=jsonl",
        f"data.path={data}",
        f"logging.run_dir={root / 'run'}",
        "logging.console=false",
        "logging.wandb=disabled",
        "checkpoint.interval=2",
    ]


def _train(overrides: list[str], stop_after: int) -> list[int]:
    return sorted(train(load_recipe("debug", overrides), stop_after=stop_after).losses)


@pytest.fixture
def no_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    def started(*args: object, **kwargs: object) -> int:
        raise AssertionError("the launcher started ranks")

    monkeypatch.setattr(launch_module, "run_agent", started)


@pytest.mark.spmd
def test_a_resume_on_changed_data_is_refused_naming_the_file(
    tmp_path: Path, no_ranks: None, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "train.jsonl"
    _write(data, ROWS)
    overrides = _overrides(tmp_path, data)
    assert get_pool(2).run(_train, overrides, 2)[0] == [1, 2]
    checkpoint = find_resume_point(tmp_path / "run" / "checkpoints").checkpoint
    assert checkpoint is not None  # the 2-step run saved (checkpoint.interval=2)
    recorded = json.loads((checkpoint / "meshtrain.json").read_text())["extra"]["data_files"]
    assert [(Path(f["path"]).name, f["size"]) for f in recorded] == [
        ("train.jsonl", data.stat().st_size)
    ]
    _write(data, [*ROWS, {"text": "one more document"}])  # appended
    sets = [item for override in overrides for item in ("--set", override)]
    assert main(["train", "debug", "--nproc", "2", *sets]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("CheckpointError: checkpoint ")
    assert f"was trained on other data: {str(data)!r} changed (" in err
    assert "--allow-change data.path" in err
    allowed = load_recipe("debug", [*overrides, "checkpoint.allow_change=['data.path']"])
    (line,) = [line for line in check_recipe_unchanged(allowed, checkpoint) if "data" in line]
    assert line.startswith("resuming") and "on changed data, allowed: " in line
    _write(data, ROWS)  # restored: the same content resumes
    assert not [
        line for line in check_recipe_unchanged(load_recipe("debug", overrides), checkpoint)
    ]
