"""Fault injection on ``meshtrain train --nproc 2`` (tier 3, real torchrun launches of the debug
recipe): stop signals to the launcher's process group, a rank killed under ``--max-restarts``, the
launcher killed outright, a second run on a busy run directory, a learning rate that ruins the
model, a rank stopped with SIGSTOP (the watchdog); on the SPMD pool's real ranks, checkpoints
missing a file, a resume with a changed recipe and token ids outside the vocabulary. Every resumed run is compared, loss by loss and bit for bit, with one uninterrupted run of
the same recipe on the same 2-rank mesh (the SPMD pool's gloo ranks run the same code)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from meshtrain import CheckpointError, DataError
from meshtrain.recipes import load_recipe
from meshtrain.recipes.run import train
from meshtrain.testing.runner import get_pool
from meshtrain.train.checkpoint.integrity import inspect_directory
from meshtrain.train.data import prepare_corpus
from meshtrain.train.metrics import WANDB_RUN_ID_FILE, read_jsonl

pytestmark = [pytest.mark.slow, pytest.mark.spmd]
ROOT = Path(__file__).resolve().parents[1]
STEPS = 8
CORPUS_BYTES = 300_000


def _overrides(run_dir: Path, corpus: Path, *extra: str) -> list[str]:
    return [
        f"train.steps={STEPS}",
        "train.warmup_steps=2",
        "train.seq_len=16",
        f"data.path={corpus}",
        f"data.corpus_bytes={CORPUS_BYTES}",
        f"logging.run_dir={run_dir}",
        "logging.log_every=1",
        "checkpoint.interval=100",
        *extra,
    ]


def uninterrupted_losses(overrides: list[str]) -> dict[int, float]:
    """On every pool rank: the recipe trained from scratch to the end."""
    return train(load_recipe("debug", overrides)).losses


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "tokens"
    prepare_corpus(path, limit_bytes=CORPUS_BYTES)
    return path


@pytest.fixture(scope="module")
def reference(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    run_dir = tmp_path_factory.mktemp("reference")
    overrides = _overrides(run_dir, corpus, "logging.wandb=disabled", "logging.console=false")
    losses = get_pool(2).run(uninterrupted_losses, overrides)[0]
    assert sorted(losses) == list(range(1, STEPS + 1))
    return losses


def train_two_steps(overrides: list[str]) -> str:
    """On every pool rank: train two steps (saving them); the error's message if it raises."""
    try:
        train(load_recipe("debug", overrides), stop_after=2)
    except CheckpointError as err:
        return err.message
    return "trained"


def test_a_run_whose_every_checkpoint_is_damaged_refuses_to_start_over(
    tmp_path: Path, corpus: Path
) -> None:
    overrides = _overrides(
        tmp_path / "run", corpus, "logging.wandb=disabled", "logging.console=false"
    )
    assert get_pool(2).run(train_two_steps, overrides) == ["trained"] * 2
    (payload, *_) = sorted((tmp_path / "run" / "checkpoints" / "step_00000002").glob("*.distcp"))
    payload.write_bytes(payload.read_bytes()[:-8])
    messages = get_pool(2).run(train_two_steps, overrides)
    assert messages[0] == messages[1]
    assert messages[0].startswith("no intact checkpoint to resume from in ")
    assert "  - step_00000002: damaged (__" in messages[0]
    assert "--set checkpoint.resume=false" in messages[0]


def test_checkpoints_missing_a_file_and_a_changed_recipe_are_refused_not_trained_over(
    tmp_path: Path, corpus: Path
) -> None:
    """Issue 33's measured silent losses, on real ranks: every checkpoint's ``.metadata``
    removed used to start over from step 1; a batch of 16 where 8 was saved, or another data
    seed, used to resume as if nothing changed. Each is now refused on every rank alike, naming
    the folder or the key and both values; ``--allow-change`` (checkpoint.allow_change) resumes
    on purpose, and a safe change (steps) passes with a line."""
    run_dir = tmp_path / "run"
    overrides = _overrides(run_dir, corpus, "logging.wandb=disabled", "logging.console=false")
    assert get_pool(2).run(train_two_steps, overrides) == ["trained"] * 2
    checkpoints = run_dir / "checkpoints"
    for changed in (["train.batch_size=16"], ["data.seed=7"]):
        message, again = get_pool(2).run(train_two_steps, [*overrides, *changed])
        assert message == again and message.startswith("the recipe differs from the one")
        key, value = changed[0].split("=")
        assert f"  - {key}: " in message and f" → {value}" in message
        assert f"--allow-change {key}" in message
    allowed = [*overrides, "train.batch_size=16", "checkpoint.allow_change=['train.batch_size']"]
    assert get_pool(2).run(train_two_steps, allowed) == ["trained"] * 2
    assert sorted(path.name for path in checkpoints.iterdir()) == [
        "step_00000002",
        "step_00000004",
    ]
    for folder in checkpoints.iterdir():
        (folder / ".metadata").unlink()
    messages = get_pool(2).run(train_two_steps, overrides)
    assert messages[0] == messages[1]
    assert "holds 2 checkpoint folders that a fresh start would overwrite" in messages[0]
    assert "  - step_00000004: damaged (.metadata: missing)" in messages[0]
    assert not (checkpoints / "step_00000002" / ".metadata").exists()  # nothing overwritten


def train_until_a_data_error(overrides: list[str]) -> str:
    """On every pool rank: train; the DataError's message (the test fails if none is raised)."""
    try:
        train(load_recipe("debug", overrides), stop_after=2)
    except DataError as err:
        return err.message
    return "trained"


@pytest.mark.parametrize("mesh", [["mesh.tp=2"], ["mesh.tp=1"]], ids=["tp2", "tp1"])
def test_a_token_id_outside_the_vocabulary_stops_every_plan_naming_the_file(
    tmp_path: Path, corpus: Path, mesh: list[str]
) -> None:
    """A token id of 60,000 in a 256-token vocabulary (the file resealed, so its checksum
    passes): under tp 2 the vocabulary-parallel embedding used to mask it and train on, under
    tp 1 it was an IndexError. Both ranks now raise the same DataError before the step."""
    tokens = tmp_path / "tokens"
    shutil.copytree(corpus, tokens)
    data = bytearray((tokens / "tokens.bin").read_bytes())
    data[0:2] = (60_000).to_bytes(2, "little")
    (tokens / "tokens.bin").write_bytes(bytes(data))
    meta = json.loads((tokens / "tokens.json").read_text())
    meta["sha256"] = hashlib.sha256(data).hexdigest()
    (tokens / "tokens.json").write_text(json.dumps(meta))
    overrides = _overrides(
        tmp_path / "run",
        tokens,
        "data.source=tokens",
        "data.shuffle=false",
        "logging.wandb=disabled",
        "logging.console=false",
        *mesh,
    )
    messages = get_pool(2).run(train_until_a_data_error, overrides)
    assert messages[0] == messages[1], messages
    assert messages[0].startswith(f"{tokens / 'tokens.bin'}: token id 60000 at row 0, column 0")
    assert "outside the model's 256-token vocabulary" in messages[0]
    assert not (tmp_path / "run" / "checkpoints").exists() or not list(
        (tmp_path / "run" / "checkpoints").iterdir()
    )


class Job:
    """One ``meshtrain train --nproc 2`` launcher in its own process group, its output read
    line by line; every process it starts carries the job's token in its environment."""

    def __init__(self, tmp_path: Path, args: list[str], *, plant: Path | None = None) -> None:
        self.token = uuid.uuid4().hex
        env = {key: value for key, value in os.environ.items() if not key.startswith("WANDB_")}
        env.update(
            PYTHONPATH=os.pathsep.join([*([str(plant)] if plant else []), *sys.path]),
            OMP_NUM_THREADS="1",
            MESHTRAIN_TEST_JOB=self.token,
            WANDB_DIR=str(tmp_path / "wandb-home"),
            WANDB_BASE_URL="http://127.0.0.1:9",
            WANDB_CONFIG_DIR=str(tmp_path / "wandb-config"),
            NETRC=str(tmp_path / "no-netrc"),
            WANDB_CACHE_DIR=str(tmp_path / "wandb-cache"),
        )
        self.process = subprocess.Popen(
            [sys.executable, "-m", "meshtrain", "train", "debug", "--nproc", "2", *args],
            cwd=ROOT,
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.lines: list[str] = []

    def wait_for(self, pattern: str) -> re.Match[str]:
        """Read output until a line matches ``pattern`` (the job announcing an event)."""
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line)
            if found := re.search(pattern, line):
                return found
        raise AssertionError(f"the job ended without {pattern!r}:\n{self.output}")

    def finish(self, timeout: float = 300) -> int:
        rest, _ = self.process.communicate(timeout=timeout)
        self.lines += rest.splitlines(keepends=True)
        return self.process.returncode

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def processes(self) -> list[str]:
        """Every live process of this job, ``pid:name`` (ranks, wandb's helpers, ...)."""
        return [f"{pid}:{name}" for pid, name, _ in _processes(self.token)]

    def rank_pid(self, rank: int) -> int:
        (pid,) = [pid for pid, _, env in _processes(self.token) if f"RANK={rank}" in env]
        return pid


def _processes(token: str) -> Iterator[tuple[int, str, list[str]]]:
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = (entry / "environ").read_bytes().decode(errors="replace").split("\0")
            name = (entry / "comm").read_text().strip()
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if f"MESHTRAIN_TEST_JOB={token}" in env:
            yield int(entry.name), name, env


def _sets(overrides: list[str]) -> list[str]:
    return [item for value in overrides for item in ("--set", value)]


def _losses(run_dir: Path) -> list[tuple[int, float]]:
    return [(row["step"], row["loss"]) for row in read_jsonl(run_dir / "metrics.jsonl")]


STOPPED = (
    r"debug: stopped by (SIG\w+) after step (\d+)\. Run the same command to resume from step "
    r"(\d+) \(checkpoint (\S+)\)\."
)


def test_a_stop_signal_saves_and_the_rerun_resumes_bit_for_bit(
    tmp_path: Path, corpus: Path, reference: dict[int, float]
) -> None:
    """SIGTERM to the launcher's process group reaches both ranks (each in its own session);
    they finish the step, save, exit 75 with one line; the rerun says where it resumed, trains
    the rest with the uninterrupted run's losses, logs each step once, continues the wandb run."""
    run_dir = tmp_path / "run"
    sets = _sets(_overrides(run_dir, corpus))
    first = Job(tmp_path, sets)
    first.wait_for(rf"^step 2/{STEPS} ")
    os.killpg(first.process.pid, signal.SIGTERM)
    assert first.finish() == 75, first.output
    stopped = re.search(STOPPED, first.output)
    assert stopped is not None, first.output
    name, step, resume_step, checkpoint = stopped.groups()
    assert (name, step) == ("SIGTERM", resume_step) and Path(checkpoint).is_dir()
    assert "Traceback" not in first.output and "Error" not in first.output
    wandb_id = (run_dir / WANDB_RUN_ID_FILE).read_text().strip()

    second = Job(tmp_path, sets)
    assert second.finish() == 0, second.output
    assert f"debug: resumed from step {step} (checkpoint {checkpoint})" in second.output
    assert _losses(run_dir) == sorted(reference.items())  # each step once, the same losses
    assert (run_dir / WANDB_RUN_ID_FILE).read_text().strip() == wandb_id
    offline = [path.name for path in (run_dir / "wandb").glob("offline-run-*")]
    assert len(offline) == 2 and all(wandb_id in name for name in offline)


def test_a_killed_rank_is_restarted_and_resumes_bit_for_bit(
    tmp_path: Path, corpus: Path, reference: dict[int, float]
) -> None:
    run_dir = tmp_path / "run"
    overrides = _overrides(run_dir, corpus, "checkpoint.interval=3", "logging.wandb=disabled")
    job = Job(tmp_path, ["--max-restarts", "1", *_sets(overrides)])
    job.wait_for(rf"^step 1/{STEPS} ")
    rank1 = job.rank_pid(1)
    job.wait_for(rf"^step 4/{STEPS} ")
    os.kill(rank1, signal.SIGKILL)
    assert job.finish() == 0, job.output
    resumed = re.findall(r"debug: resumed from step (\d+) \(checkpoint ", job.output)
    assert resumed in (["3"], ["6"]), job.output
    assert _losses(run_dir) == sorted(reference.items()), job.output
    assert f"debug: trained to step {STEPS}" in job.output


def test_killing_the_launcher_stops_every_rank_and_leaves_nothing_running(
    tmp_path: Path, corpus: Path
) -> None:
    """SIGKILL to the launcher's group: the ranks notice their parent is gone, take the stop
    path (a checkpoint), and exit; wandb's processes exit with rank 0. Meanwhile a second run
    on the same directory is refused, naming the first one."""
    run_dir = tmp_path / "run"
    sets = _sets(_overrides(run_dir, corpus, "train.steps=100000"))
    job = Job(tmp_path, sets)
    job.wait_for(r"^step 2/100000 ")
    rival = Job(tmp_path, sets)
    assert rival.finish() == 2, rival.output
    assert f"in use by another run: pid {job.process.pid} on host" in rival.output
    refusal = [line for line in rival.lines if not line.startswith("meshtrain train debug: ")]
    assert len(refusal) == 1, rival.output  # after the line saying what starts: one line
    assert any("wandb-core" in process for process in job.processes()), job.processes()
    os.killpg(job.process.pid, signal.SIGKILL)
    deadline = time.monotonic() + 120
    while job.processes() and time.monotonic() < deadline:
        time.sleep(0.2)  # no event to wait on for processes that are not our children
    assert job.processes() == [], "processes left running after the launcher was killed"
    assert job.finish() == -signal.SIGKILL
    stopped = re.search(STOPPED, job.output)
    assert stopped is not None and stopped.group(1) == "SIGTERM", job.output
    # the stop path's checkpoint is the last one (a periodic one may precede it on a slow start)
    statuses = inspect_directory(run_dir / "checkpoints")
    assert [s.status for s in statuses] == ["intact"] * len(statuses), statuses
    assert statuses[-1].step == int(stopped.group(2)) >= 2


def test_a_spent_nonfinite_budget_exits_2_without_a_restart_or_a_skipped_checkpoint(
    tmp_path: Path, corpus: Path
) -> None:
    """A good run stopped by Ctrl-C (SIGINT), then resumed with a learning rate that ruins the
    model (allowed with --allow-change): after 10 skipped steps in a row every rank stops with the
    same TrainingError, shown once; ``--max-restarts`` does not retry it; no checkpoint holds a
    skipped step, and the last good checkpoint survives ``keep_last = 1``."""
    run_dir = tmp_path / "run"
    good = _overrides(
        run_dir,
        corpus,
        "train.steps=40",
        "checkpoint.interval=2",
        "checkpoint.keep_last=1",
        "logging.wandb=disabled",
    )
    first = Job(tmp_path, _sets(good))
    first.wait_for(r"^step 4/40 ")
    os.kill(first.process.pid, signal.SIGINT)
    assert first.finish() == 75, first.output
    stopped = re.search(STOPPED, first.output)
    assert stopped is not None and stopped.group(1) == "SIGINT", first.output
    resume = int(stopped.group(3))

    ruined = Job(
        tmp_path,
        [
            "--max-restarts",
            "1",
            "--allow-change",
            "train.lr",
            "--allow-change",
            "train.min_lr",
            *_sets([*good, "train.lr=1e6", "train.min_lr=0"]),
        ],
    )
    assert ruined.finish() == 2, ruined.output
    errors = [line for line in ruined.lines if "TrainingError" in line]
    assert len(errors) == 1 and errors[0].startswith("[ranks 0, 1] TrainingError: step "), errors
    assert "11 steps in a row were skipped (max_consecutive_skips = 10)" in errors[0]
    last_good = run_dir / "checkpoints" / f"step_{resume:08d}"
    assert (
        f"The last good checkpoint (trained 2 steps past with no skipped step) is {last_good}"
        in errors[0]
    )
    assert ruined.output.count("debug: resumed from step") == 1, "a TrainingError is not retried"
    skipped = {row["step"]: row["skipped"] for row in read_jsonl(run_dir / "metrics.jsonl")}
    statuses = inspect_directory(run_dir / "checkpoints")
    assert last_good in [status.path for status in statuses]
    assert all(status.status == "intact" and not skipped[status.step] for status in statuses)


CLOCK_STEPS = """
import time
_wall, _began = time.time, time.monotonic()
# the wall clock steps forward an hour every 2 s in every process of the job (NTP, a resumed VM)
time.time = lambda: _wall() + 3600 * int((time.monotonic() - _began) // 2)
"""


@pytest.mark.extended  # a real launch held until the watchdog fires: ~75 s on 2 cores
def test_a_stopped_rank_is_named_by_the_watchdog_and_the_job_ends_with_124(
    tmp_path: Path, corpus: Path
) -> None:
    """SIGSTOP to rank 1 mid-run used to hold the job for the collective timeout (651 s) and end
    in "lost contact … killed by SIGKILL". Now the watchdog (train.heartbeat_timeout, 15 s here,
    120 s by default) names the rank, the step it reached and its process state, dumps rank 0's
    stacks, and ends the job with 124; the checkpoints left are intact and nothing keeps
    running. Before that, the wall clock steps by an hour every 2 s in every process and the
    whole job is paused for longer than the allowance: neither ends it (the watchdog used to
    read the wall clock and ended such a job with "no heartbeat for 3601 s")."""
    run_dir = tmp_path / "run"
    overrides = _overrides(
        run_dir,
        corpus,
        "train.steps=100000",
        "checkpoint.interval=2",
        "logging.wandb=disabled",
        "train.heartbeat_timeout=15",
    )
    plant = tmp_path / "plant"
    plant.mkdir()
    (plant / "sitecustomize.py").write_text(CLOCK_STEPS)
    job = Job(tmp_path, _sets(overrides), plant=plant)
    job.wait_for(r"^step 1/100000 ")
    rank1 = job.rank_pid(1)
    job.wait_for(r"^step 4/100000 ")
    paused = [int(entry.split(":")[0]) for entry in job.processes()]
    for pid in paused:  # the launcher, its agent and the ranks, all at once
        os.kill(pid, signal.SIGSTOP)
    time.sleep(18)
    for pid in paused:
        os.kill(pid, signal.SIGCONT)
    reached = int(job.wait_for(r"^step (\d+)/100000 ").group(1))
    job.wait_for(rf"^step {reached + 2}/100000 ")  # alive after the pause and the clock's steps
    os.kill(rank1, signal.SIGSTOP)
    stopped_at = time.monotonic()
    assert job.finish(timeout=180) == 124, job.output
    detected_s = time.monotonic() - stopped_at
    found = re.search(
        r"meshtrain: rank 1 stopped making progress after step (\d+): no heartbeat "
        r"for (\d+) s .*its process is stopped by a signal",
        job.output,
    )
    assert found is not None, job.output
    assert 15 <= detected_s < 60, detected_s
    assert 15 <= int(found.group(2)) < 30  # measured on the watchdog's clock, not the wall's
    assert int(found.group(1)) >= reached  # the step it reached (its last heartbeat)
    assert "Traceback" not in job.output
    stacks = (run_dir / "logs" / "stacks-rank-0.txt").read_text()
    assert "most recent call first" in stacks and "meshtrain" in stacks
    statuses = inspect_directory(run_dir / "checkpoints")
    intact = [status.step for status in statuses if status.status == "intact"]
    assert intact and max(intact) >= 2, statuses  # a save the stop interrupted is never listed
    assert all(status.status == "intact" or ".tmp-" in status.path.name for status in statuses)
    deadline = time.monotonic() + 30
    while job.processes() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert job.processes() == []
    print(f"watchdog: detected in {detected_s:.1f} s after SIGSTOP at step {found.group(1)}")


PLANTED_CRASH = """
import os
if os.environ.get("RANK") == "1":  # a bug planted in rank 1 only, at step 3
    import meshtrain.train.heartbeat as heartbeat
    progress = heartbeat.progress
    def planted(step):
        if step == 3:
            raise ValueError("planted fault at step 3")
        progress(step)
    heartbeat.progress = planted
"""


def test_a_crash_is_named_by_the_rank_that_failed_first_with_its_own_line(
    tmp_path: Path, corpus: Path
) -> None:
    """A bug in one rank used to read as "lost contact" (exit status 1 from any exception) with
    a traceback per rank on the console. Planted in rank 1 (a sitecustomize the test puts on the
    ranks' path, not in the library): the summary names rank 1 and its own first error line, the
    traceback is in the run directory's log, not on the console; exit status 1."""
    plant = tmp_path / "plant"
    plant.mkdir()
    (plant / "sitecustomize.py").write_text(PLANTED_CRASH)
    run_dir = tmp_path / "run"
    overrides = _overrides(run_dir, corpus, "logging.wandb=disabled", "checkpoint.interval=2")
    job = Job(tmp_path, _sets(overrides), plant=plant)
    assert job.finish() == 1, job.output
    log = run_dir / "logs" / "rank-1.log"
    expected = (
        f"meshtrain: rank 1 failed first: ValueError: planted fault at step 3 (traceback: {log}). "
        "Run the same command to resume from the newest intact checkpoint"
    )
    assert expected in job.output, job.output
    assert "Traceback" not in job.output and "lost contact" not in job.output, job.output
    assert "ValueError: planted fault at step 3" in log.read_text()
    (status,) = inspect_directory(run_dir / "checkpoints")
    assert status.status == "intact" and status.step == 2


@pytest.mark.extended  # a real launch: ~50 s on 2 cores
def test_a_token_file_truncated_under_the_running_job_is_named(
    tmp_path: Path, corpus: Path
) -> None:
    """tokens.bin cut to 100 bytes while the job trains: the file is named either way. Cut
    between steps, every rank agrees that it changed size before the next read (one DataError
    line, exit status 2); cut while a rank reads the memory map, that rank dies by SIGBUS and the
    launcher checks the file again and names it (exit status 1). The checkpoints left are
    intact."""
    tokens = tmp_path / "tokens"
    shutil.copytree(corpus, tokens)
    run_dir = tmp_path / "run"
    overrides = _overrides(
        run_dir,
        tokens,
        "data.source=tokens",
        "train.steps=100000",
        "checkpoint.interval=2",
        "logging.wandb=disabled",
    )
    job = Job(tmp_path, _sets(overrides))
    job.wait_for(r"^step 3/100000 ")
    with open(tokens / "tokens.bin", "r+b") as handle:
        handle.truncate(100)
    code = job.finish()
    agreed = (
        f"[ranks 0, 1] DataError: token file '{tokens / 'tokens.bin'}' changed size while the job "
        "ran: 100 bytes, it was opened with "
    )
    rechecked = (
        "meshtrain: the token data changed while the job ran: token file "
        f"'{tokens / 'tokens.bin'}' has 100 bytes but tokens.json says "
    )
    assert (code, agreed in job.output) == (2, True) or (
        code == 1 and "was killed by SIGBUS" in job.output and rechecked in job.output
    ), job.output
    assert "Traceback" not in job.output
    statuses = inspect_directory(run_dir / "checkpoints")
    assert statuses and all(status.status == "intact" for status in statuses), statuses
