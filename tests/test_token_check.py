"""Token data verified (issue 33, point 3): the launcher checks a prepared token file's size,
sha256 (once per file version) and ids before any rank starts; the ranks check each batch's ids
against the model's vocabulary on every plan and name a file truncated under the job."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from meshtrain import DataError
from meshtrain.recipes.token_check import CACHE_FILE, verify_token_file
from meshtrain.train.batch import Batch, DataPosition
from meshtrain.train.data import prepare_tokens
from meshtrain.train.token_guard import TokenGuard

ROOT = Path(__file__).resolve().parents[1]


def _prepared(root: Path) -> Path:
    directory = root / "tokens"
    prepare_tokens(["hello world"] * 200, "byte", directory)
    return directory


def _rewrite(directory: Path, tokens: np.ndarray, *, reseal: bool) -> None:
    """Write ``tokens`` as tokens.bin; with ``reseal`` tokens.json records their sha256 too."""
    data = tokens.astype(np.uint16).tobytes()
    (directory / "tokens.bin").write_bytes(data)
    if reseal:
        meta = json.loads((directory / "tokens.json").read_text())
        meta.update(num_tokens=len(tokens), sha256=hashlib.sha256(data).hexdigest())
        (directory / "tokens.json").write_text(json.dumps(meta))


def test_a_verified_file_is_hashed_once_and_a_changed_one_again(tmp_path: Path) -> None:
    directory = _prepared(tmp_path)
    assert verify_token_file(directory).cached is False
    assert verify_token_file(directory).cached is True
    assert (directory / CACHE_FILE).is_file()
    tokens = np.fromfile(directory / "tokens.bin", dtype=np.uint16)
    tokens[100] ^= 1  # same size, bytes changed after preparation
    tokens.tofile(directory / "tokens.bin")
    with pytest.raises(DataError, match=r"changed after it was prepared: its sha256 is"):
        verify_token_file(directory)


def test_a_truncated_file_and_garbage_metadata_are_named(tmp_path: Path) -> None:
    directory = _prepared(tmp_path)
    data = (directory / "tokens.bin").read_bytes()
    (directory / "tokens.bin").write_bytes(data[:-6])
    with pytest.raises(DataError, match=r"tokens.bin' has [\d,]+ bytes but tokens.json says"):
        verify_token_file(directory)
    (directory / "tokens.json").write_text("{garbage")
    with pytest.raises(DataError, match=r"tokens.json' is unreadable"):
        verify_token_file(directory)


def test_an_id_outside_the_recorded_vocabulary_is_named_with_its_position(
    tmp_path: Path,
) -> None:
    directory = _prepared(tmp_path)
    tokens = np.fromfile(directory / "tokens.bin", dtype=np.uint16)
    tokens[1234] = 60_000
    _rewrite(directory, tokens, reseal=True)
    with pytest.raises(DataError) as caught:
        verify_token_file(directory)
    assert "holds token id 60000 at position 1,234 (token index)" in caught.value.message
    assert "outside its 256-token vocabulary" in caught.value.message


def test_the_launcher_refuses_bad_tokens_in_one_line_before_torch(tmp_path: Path) -> None:
    directory = _prepared(tmp_path)
    tokens = np.fromfile(directory / "tokens.bin", dtype=np.uint16)
    tokens[7] = 60_000
    _rewrite(directory, tokens, reseal=True)
    command = [
        sys.executable,
        "-X",
        "importtime",
        "-m",
        "meshtrain",
        "train",
        "debug",
        "--nproc",
        "2",
        "--set",
        "data.source='tokens'",
        "--set",
        f"data.path='{directory}'",
        "--set",
        f"logging.run_dir='{tmp_path / 'run'}'",
    ]
    began = time.monotonic()
    done = subprocess.run(
        command,
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    elapsed = time.monotonic() - began
    assert done.returncode == 2, done.stderr[-2000:]
    lines = [line for line in done.stderr.splitlines() if not line.startswith("import time:")]
    assert len(lines) == 1 and lines[0].startswith("DataError: token file "), lines
    assert "holds token id 60000 at position 7" in lines[0]
    imported = {
        line.split("|")[-1].strip()
        for line in done.stderr.splitlines()
        if line.startswith("import time:")
    }
    assert "torch" not in imported
    assert elapsed < 3, elapsed


def test_the_ranks_name_an_id_outside_the_models_vocabulary_and_a_truncated_file(
    tmp_path: Path,
) -> None:
    directory = _prepared(tmp_path)
    bin_path = directory / "tokens.bin"
    guard = TokenGuard(256, str(bin_path), bin_path, bin_path.stat().st_size)
    position = DataPosition(epoch=0, step=3)
    guard.check(Batch(torch.tensor([[1, 255]]), torch.tensor([[255, -100]]), position))
    with pytest.raises(DataError) as caught:
        guard.check(
            Batch(torch.tensor([[1, 2], [3, 300]]), torch.tensor([[2, 3], [4, 5]]), position)
        )
    assert caught.value.message.startswith(
        f"{bin_path}: token id 300 at row 1, column 1 of the inputs"
    )
    assert "data position (epoch 0, step 3)" in caught.value.message
    guard.check_file()
    bin_path.write_bytes(bin_path.read_bytes()[:100])
    with pytest.raises(DataError, match=r"changed size while the job ran: 100 bytes"):
        guard.check_file()


def test_one_agreement_per_step_names_the_file_the_batch_or_the_stop(tmp_path: Path) -> None:
    """The training loop's one check per step (``TokenGuard.agree``): the file is statted before
    the batch is read, a stop signal wins over the rest, then the file, then the batch."""
    directory = _prepared(tmp_path)
    bin_path = directory / "tokens.bin"
    guard = TokenGuard(256, str(bin_path), bin_path, bin_path.stat().st_size)
    good = Batch(torch.tensor([[1, 255]]), torch.tensor([[255, -100]]))
    bad = Batch(torch.tensor([[1, 300]]), torch.tensor([[2, 3]]))
    assert guard.before_read() and guard.agree(good, 0) == 0
    assert guard.agree(bad, 15) == 15  # a SIGTERM is taken before anything else
    with pytest.raises(DataError, match="token id 300 at row 0, column 1"):
        guard.agree(bad, 0)
    bin_path.write_bytes(bin_path.read_bytes()[:100])
    assert not guard.before_read()
    with pytest.raises(DataError, match=r"changed size while the job ran: 100 bytes"):
        guard.agree(None, 0)
