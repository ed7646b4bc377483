"""``meshtrain train`` end to end under torchrun (tier 3): one node of 4 CPU ranks with the
shipped debug recipe on the real corpus, and two launcher processes on 127.0.0.1 as two nodes of
2 ranks each — which also stop together, with a clear message, when their recipes differ."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from meshtrain.train.metrics import read_jsonl

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One tokenized corpus for the module (built by the first run, reused by the others)."""
    return tmp_path_factory.mktemp("corpus") / "tokens"


def _environment(tmp_path: Path) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith("WANDB_")}
    env.pop("WANDB_API_KEY", None)
    env["WANDB_DIR"] = str(tmp_path)
    env["OMP_NUM_THREADS"] = "1"
    return env


def _train(args: list[str], tmp_path: Path, **popen: object) -> subprocess.Popen[str]:
    command = [sys.executable, "-m", "meshtrain", "train", *args]
    return subprocess.Popen(
        command,
        cwd=ROOT,
        env=_environment(tmp_path),
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        **popen,  # type: ignore[arg-type]
    )


def _sets(run_dir: Path, corpus: Path, steps: int, *extra: str) -> list[str]:
    values = [
        f"train.steps={steps}",
        "train.warmup_steps=2",
        f"logging.run_dir={run_dir}",
        f"data.path={corpus}",
        "data.corpus_bytes=1000000",
        "checkpoint.interval=0",
        "logging.log_every=5",
        *extra,
    ]
    return [item for value in values for item in ("--set", value)]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_debug_recipe_trains_on_four_local_ranks(tmp_path: Path, corpus_dir: Path) -> None:
    run_dir = tmp_path / "run"
    sets = _sets(run_dir, corpus_dir, 20, "checkpoint.interval=10", "checkpoint.async=true")
    process = _train(["debug", "--nproc", "4", *sets], tmp_path)
    output, _ = process.communicate(timeout=300)
    assert process.returncode == 0, output
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [row["step"] for row in rows] == [1, 5, 10, 15, 20]
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.5  # it learns the corpus's bytes
    assert all(row["tokens"] == 8 * 64 for row in rows)
    plan = json.loads((run_dir / "plan.json").read_text())
    assert plan["mesh"]["axes"] == [["dp", 2], ["tp", 2]]
    assert (run_dir / "plan.txt").read_text().strip()
    assert list((run_dir / "wandb").glob("offline-run-*")), "wandb offline run missing"
    saved = sorted(path.name for path in (run_dir / "checkpoints").iterdir())
    assert saved == ["step_00000010", "step_00000020"]  # async saves, both published
    assert "debug: trained to step 20" in output
    summary = output[output.index("debug: trained to step 20") :]
    assert "10,240 tokens in" in summary  # 20 steps of 8 × 64
    assert f"last checkpoint {run_dir / 'checkpoints' / 'step_00000020'}" in summary
    assert f"next: meshtrain eval {run_dir}" in summary
    again = _train(["debug", "--nproc", "4", *sets], tmp_path)
    output, _ = again.communicate(timeout=300)
    assert again.returncode == 0, output
    assert "already at step 20 of 20; nothing to train" in output


def _two_nodes(
    tmp_path: Path, corpus: Path, node1_extra: tuple[str, ...] = ()
) -> list[tuple[int, str]]:
    port = _free_port()
    run_dir = tmp_path / "run"
    launchers = [
        _train(
            [
                "debug",
                "--nproc",
                "2",
                "--nnodes",
                "2",
                "--node-rank",
                str(node),
                "--rdzv-endpoint",
                f"127.0.0.1:{port}",
                *_sets(run_dir, corpus, 4, *(node1_extra if node == 1 else ())),
            ],
            tmp_path,
        )
        for node in (0, 1)
    ]
    results = []
    for launcher in launchers:
        output, _ = launcher.communicate(timeout=300)
        results.append((launcher.returncode, output))
    return results


@pytest.mark.extended  # multi-node launches: the second tier (docs/testing.md, "Tiers")
def test_two_launchers_on_localhost_train_as_two_nodes(tmp_path: Path, corpus_dir: Path) -> None:
    results = _two_nodes(tmp_path, corpus_dir)
    for code, output in results:
        assert code == 0, output
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    assert plan["mesh"]["axes"] == [["dp", 2], ["tp", 2]]
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [row["step"] for row in rows] == [1, 4]  # written once, by global rank 0


@pytest.mark.extended
def test_nodes_with_different_recipes_stop_with_a_clear_message(
    tmp_path: Path, corpus_dir: Path
) -> None:
    results = _two_nodes(tmp_path, corpus_dir, node1_extra=("train.lr=0.001",))
    assert all(code != 0 for code, _ in results)
    joined = "\n".join(output for _, output in results)
    assert "TrainingError" in joined and "do not agree on what to train" in joined
    messages = [line for line in joined.splitlines() if "TrainingError" in line]
    # Every rank raises; a node's agent may stop a rank's sibling before it prints, so each
    # node shows at least one message.
    assert all("TrainingError" in output for _, output in results), joined
    # node 1 holds ranks 2 and 3 (static rendezvous by --node-rank) and was given lr 0.001
    assert all(
        "ranks [2, 3]" in line and "train.lr = 0.003 vs 0.001" in line for line in messages
    ), messages
