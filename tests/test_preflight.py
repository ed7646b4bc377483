"""What ``meshtrain train`` refuses before any rank starts: the torch-free checks (mesh against
the ranks started, batch split, data paths, finite values) exit 2 with one line in under 3 s,
measured on the real command; what needs the model (sequence length, heads over tensor
parallelism) or the run directory (its lock, its permissions) is refused right after, with no
rank started either."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from meshtrain import MeshtrainError, RecipeError
from meshtrain import launch as launch_module
from meshtrain.cli import main
from meshtrain.files.lock import acquire_run_lock
from meshtrain.recipes import load_recipe
from meshtrain.recipes.preflight import DEFAULTS, check_launch, check_plan
from meshtrain.recipes.schema import DataSection, ParallelSection, TrainSection

ROOT = Path(__file__).resolve().parents[1]
#: The launcher's refusal budget (the issue's), measured from process start to exit.
REFUSAL_BUDGET_S = 3.0


def _recipe(**sections: dict[str, Any]) -> dict[str, Any]:
    base: dict[str, Any] = {
        "mesh": {"dp": -1, "tp": 2},
        "train": {"batch_size": 8},
        "data": {"source": "synthetic"},
    }
    for name, table in sections.items():
        base[name] = table if name == "mesh" else {**base.get(name, {}), **table}
    return base


def test_the_defaults_the_checks_assume_are_the_schemas() -> None:
    assert {
        "train.batch_size": TrainSection().batch_size,
        "parallel.microbatches": ParallelSection().microbatches,
        "data.source": DataSection().source,
        "data.path": DataSection().path,
    } == DEFAULTS


@pytest.mark.parametrize(
    ("recipe", "nproc", "nnodes", "message"),
    [
        (
            _recipe(),
            3,
            1,
            "[mesh] {dp: -1, tp: 2} needs a multiple of 2 ranks (tp = 2), but this launch starts 3 (--nproc 3 × --nnodes 1)",
        ),
        (
            _recipe(mesh={"dp": 2, "tp": 2}),
            2,
            1,
            "needs exactly 4 ranks, but this launch starts 2 (--nproc 2 × --nnodes 1). Start --nproc 4",
        ),
        (
            _recipe(mesh={"dp": 2, "tp": 2}),
            1,
            2,
            "needs exactly 4 ranks, but this launch starts 2 (--nproc 1 × --nnodes 2). Start --nproc 2",
        ),
        (
            _recipe(train={"batch_size": 6}),
            8,
            1,
            "train.batch_size = 6 does not split into 4 data-parallel ranks (dp = 4) × 1 micro-batches",
        ),
        (
            _recipe(parallel={"microbatches": 3}),
            4,
            1,
            "train.batch_size = 8 does not split into 2 data-parallel ranks (dp = 2) × 3 micro-batches",
        ),
        (
            _recipe(mesh={"pp": 2, "dp": -1}, parallel={"pipeline": {"microbatches": 3}}),
            4,
            1,
            "does not split into 2 data-parallel ranks (dp = 2) × 3 micro-batches",
        ),
        (_recipe(train={"lr": float("inf")}), 2, 1, "train.lr = inf is not a finite number"),
        (
            _recipe(train={"weight_decay": float("nan")}),
            2,
            1,
            "train.weight_decay = nan is not a finite number",
        ),
        (
            _recipe(parallel={"pipeline": {"axis": "pp", "x": float("-inf")}}),
            2,
            1,
            "parallel.pipeline.x = -inf is not a finite number",
        ),
    ],
    ids=[
        "mesh-multiple",
        "mesh-exact",
        "mesh-nodes",
        "batch",
        "microbatches",
        "pipeline-micro",
        "lr-inf",
        "weight-decay-nan",
        "nested-inf",
    ],
)
def test_impossible_launches_are_refused_naming_the_fix(
    recipe: dict[str, Any], nproc: int, nnodes: int, message: str
) -> None:
    with pytest.raises(RecipeError) as raised:
        check_launch(recipe, "r.toml", nproc=nproc, nnodes=nnodes)
    assert message in raised.value.message
    assert raised.value.message.startswith("r.toml: ")


def test_missing_data_and_files_are_refused(tmp_path: Path) -> None:
    tokens = _recipe(data={"source": "tokens", "path": str(tmp_path / "none")})
    with pytest.raises(RecipeError, match=r"holds no prepared tokens \(no tokens.json there\)"):
        check_launch(tokens, "r.toml", nproc=2)
    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory")
    corpus = _recipe(data={"source": "corpus", "path": str(blocked / "corpus")})
    with pytest.raises(RecipeError, match=f"'{blocked}' is not a writable directory"):
        check_launch(corpus, "r.toml", nproc=2)
    start = _recipe(checkpoint={"init_from": str(tmp_path / "model.safetensors")})
    with pytest.raises(RecipeError, match=r"checkpoint.init_from = .* does not exist"):
        check_launch(start, "r.toml", nproc=2)
    check_launch(_recipe(data={"source": "corpus", "path": str(tmp_path / "new")}), "r", nproc=2)


def test_init_from_must_be_a_safetensors_file_or_a_transformers_directory(tmp_path: Path) -> None:
    def start(path: Path) -> dict[str, Any]:
        return _recipe(checkpoint={"init_from": str(path)}, data={"source": "synthetic"})

    (tmp_path / "model.bin").write_bytes(b"x")
    with pytest.raises(RecipeError, match=r"init_from = .*model\.bin' is not a \.safetensors file"):
        check_launch(start(tmp_path / "model.bin"), "r.toml", nproc=2)
    with pytest.raises(
        RecipeError,
        match=r"init_from = .* is a directory without config\.json: "
        r"give a transformers model directory",
    ):
        check_launch(start(tmp_path), "r.toml", nproc=2)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(
        RecipeError,
        match=r"has a config\.json but no model\.safetensors or "
        r"model\.safetensors\.index\.json",
    ):
        check_launch(start(tmp_path), "r.toml", nproc=2)
    (tmp_path / "model.safetensors.index.json").write_text("{}")
    check_launch(start(tmp_path), "r.toml", nproc=2)
    (tmp_path / "one.safetensors").write_bytes(b"x")
    check_launch(start(tmp_path / "one.safetensors"), "r.toml", nproc=2)


def test_values_of_the_wrong_type_are_left_to_the_schema() -> None:
    for recipe in (
        _recipe(mesh={"dp": "two"}),
        _recipe(train={"batch_size": "8"}),
        _recipe(parallel={"fsdp": "dp"}),
        {"mesh": [1, 2]},
    ):
        check_launch(recipe, "r.toml", nproc=2)


@pytest.mark.parametrize(
    ("overrides", "world"),
    [
        ((), 4),
        ((), 3),
        ((), 6),
        (("mesh.tp=1",), 3),
        (("train.batch_size=6",), 8),
        (("train.batch_size=6",), 6),
        (("parallel.microbatches=4",), 4),
        (("parallel.microbatches=2",), 8),
        (("mesh.dp=2", "mesh.tp=2"), 8),
        (("mesh.pp=2", "mesh.tp=1", "parallel.pipeline.microbatches=2"), 4),
        (("mesh.pp=2", "mesh.tp=1", "parallel.pipeline.microbatches=3"), 4),
    ],
)
def test_the_fast_checks_agree_with_the_planner(overrides: tuple[str, ...], world: int) -> None:
    """The torch-free rules repeat the planner's for meshes and batches: both refuse, or both
    accept (the planner may refuse for reasons of its own only where the fast checks are silent)."""
    recipe = load_recipe("debug", ["data.source=synthetic", *overrides])
    try:
        check_launch(recipe.raw, recipe.source, nproc=world)
        fast = None
    except RecipeError as err:
        fast = err.message
    try:
        check_plan(recipe, world)
        planned = None
    except MeshtrainError as err:
        planned = err.message
    assert (fast is None) == (planned is None), (fast, planned)


def _launch(*args: str, cwd: Path = ROOT) -> tuple[int, str, float]:
    started = time.perf_counter()
    process = subprocess.run(
        [sys.executable, "-m", "meshtrain", "train", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    return process.returncode, process.stdout + process.stderr, time.perf_counter() - started


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (("--nproc", "3"), "needs a multiple of 2 ranks"),
        (("--nproc", "8", "--set", "train.batch_size=6"), "does not split into 4 data-parallel"),
        (("--nproc", "2", "--set", "train.lr=inf"), "train.lr = inf is not a finite number"),
        (("--nproc", "2", "--set", "train.lr=nan"), "train.lr = nan is not a finite number"),
        (
            ("--nproc", "2", "--set", "data.source=tokens", "--set", "data.path=/nonexistent"),
            "holds no prepared tokens",
        ),
        (("--nproc", "2", "--set", "train.stepz=3"), "unknown key train.stepz = 3 (did you mean"),
        (
            ("--nproc", "2", "--set", 'train.steps="abc"'),
            'train.steps = "abc" is a string, but steps must be a positive integer',
        ),
        (("--nproc", "2", "--set", "checkpoint.interval=-1"), "checkpoint.interval = -1 is out"),
    ],
    ids=["mesh", "batch", "lr-inf", "lr-nan", "data-path", "unknown-key", "steps-abc", "interval"],
)
def test_the_launcher_refuses_in_under_3_s_with_one_line(
    args: tuple[str, ...], expected: str
) -> None:
    code, output, seconds = _launch("debug", *args)
    assert code == 2, output
    assert output.count("\n") == 1 and output.startswith("RecipeError: ") and expected in output
    assert seconds < REFUSAL_BUDGET_S, f"refused in {seconds:.2f} s"


@pytest.fixture
def no_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The launcher must refuse before starting any rank."""

    def started(*args: object, **kwargs: object) -> int:
        raise AssertionError("the launcher started ranks")

    monkeypatch.setattr(launch_module, "run_agent", started)


def test_what_needs_the_model_is_refused_before_any_rank_starts(
    no_ranks: None, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["train", "debug", "--nproc", "2", "--set", "train.seq_len=100"]) == 2
    err = capsys.readouterr().err
    assert (
        err.count("\n") == 1
        and "train.seq_len = 100 is longer than the model's max_seq_len = 64" in err
    )
    heads = ["--set", "model.n_heads=2", "--set", "model.n_kv_heads=2", "--set", "mesh.tp=4"]
    assert main(["train", "debug", "--nproc", "4", *heads]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith("PlanError: ")
        and "do not split evenly over tensor-parallel axis 'tp' of size 4" in err
    )
    assert main(["train", "recipes"]) == 2
    assert "recipe 'recipes' is a directory, not a recipe file" in capsys.readouterr().err


def test_a_busy_or_unwritable_run_directory_is_refused_before_any_rank_starts(
    tmp_path: Path, no_ranks: None, capsys: pytest.CaptureFixture[str]
) -> None:
    sets = ["--set", "data.source=synthetic", "--set", f"logging.run_dir={tmp_path / 'run'}"]
    with acquire_run_lock(tmp_path / "run"):
        assert main(["train", "debug", "--nproc", "2", *sets]) == 2
    err = capsys.readouterr().err
    assert err.startswith("CheckpointError: run directory ") and "in use by another run" in err
    unwritable = "/sys/meshtrain-test-run" if os.geteuid() == 0 else "/proc/meshtrain-test-run"
    assert (
        main(
            [
                "train",
                "debug",
                "--nproc",
                "2",
                "--set",
                "data.source=synthetic",
                "--set",
                f"logging.run_dir={unwritable}",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"cannot lock the run directory '{unwritable}'" in err


def test_a_busy_run_directory_is_refused_first_within_seconds(tmp_path: Path) -> None:
    """A run directory another job holds was refused only after the plan check (32 s on a
    loaded machine): the launcher now probes the lock right after reading the recipe, before
    torch is imported."""
    run_dir = tmp_path / "run"
    sets = ["--set", f"logging.run_dir={run_dir}", "--set", "data.source=synthetic"]
    with acquire_run_lock(run_dir):
        started = time.perf_counter()
        process = subprocess.run(
            [sys.executable, "-m", "meshtrain", "train", "debug", "--nproc", "2", *sets],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        )
        seconds = time.perf_counter() - started
    assert process.returncode == 2, process.stdout + process.stderr
    assert process.stderr.startswith(f"CheckpointError: run directory '{run_dir}' is in use")
    assert process.stdout == ""  # not even the "checking the plan" line
    assert seconds < REFUSAL_BUDGET_S, f"refused in {seconds:.2f} s"


def test_a_refusal_that_needs_the_model_imports_no_lowering(tmp_path: Path) -> None:
    """``train.seq_len`` past the model's ``max_seq_len`` needs the model's config (torch), not
    the lowering: it used to import DTensor, dynamo and the train step first (7.4-10 s on 2
    quiet cores; 2.7-3.7 s since, most of it ``import torch``)."""
    code = (
        "import sys\n"
        "from meshtrain.cli import main\n"
        "code = main(['train', 'debug', '--nproc', '2', '--set', 'train.seq_len=100'])\n"
        "heavy = [m for m in ('torch._dynamo', 'meshtrain.lower', 'meshtrain.train.step') "
        "if m in sys.modules]\n"
        "print(code, heavy)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert done.stdout.splitlines()[-1] == "2 []", done.stdout + done.stderr
    assert "train.seq_len = 100 is longer than the model's max_seq_len = 64" in done.stderr


def test_a_broken_wandb_install_is_one_line_before_any_rank_starts(tmp_path: Path) -> None:
    """A run that logs to wandb (offline by default) with a wandb that fails to import: rank 0
    used to end with status 1 after the ranks started; the launcher now imports it first."""
    plant = tmp_path / "plant" / "wandb"
    plant.mkdir(parents=True)
    (plant / "__init__.py").write_text("raise ImportError('planted: a half-upgraded install')\n")
    started = time.perf_counter()
    process = subprocess.run(
        [sys.executable, "-m", "meshtrain", "train", "debug", "--nproc", "2"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(plant.parent), *sys.path])},
    )
    seconds = time.perf_counter() - started
    output = process.stdout + process.stderr
    assert process.returncode == 2, output
    (refusal,) = [line for line in output.splitlines() if line.startswith("RecipeError: ")]
    assert "[logging] wandb = 'offline' logs to wandb, whose import fails here" in refusal
    assert "ImportError: planted: a half-upgraded install" in refusal
    assert "logging.wandb=disabled" in refusal and "Traceback" not in output
    assert not (tmp_path / "runs").exists()  # no rank started, nothing written
    assert seconds < REFUSAL_BUDGET_S, f"refused in {seconds:.2f} s"


def test_a_recipe_that_is_a_fifo_or_unreadable_is_named_as_what_it_is(
    tmp_path: Path, no_ranks: None, capsys: pytest.CaptureFixture[str]
) -> None:
    """A FIFO given as the recipe was reported as "does not exist" (and reading it would
    block); an unreadable one and one that is not UTF-8 are named with the reason."""
    fifo = tmp_path / "recipe.toml"
    os.mkfifo(fifo)
    assert main(["train", str(fifo), "--nproc", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is a named pipe (FIFO), not a regular file" in err
    latin = tmp_path / "latin.toml"
    latin.write_bytes(b"[train]\n# caf\xe9\nsteps = 3\n")
    assert main(["train", str(latin), "--nproc", "2"]) == 2
    err = capsys.readouterr().err
    assert "is not UTF-8 text (byte 0xe9 at offset 13)" in err
    if os.geteuid() != 0:  # root reads anything
        locked = tmp_path / "locked.toml"
        locked.write_text("[train]\n")
        locked.chmod(0)
        assert main(["train", str(locked), "--nproc", "2"]) == 2
        assert "Permission denied" in capsys.readouterr().err


def _jsonl(path: Path, documents: int, words: int = 20) -> Path:
    path.write_text(
        "".join(f'{{"text": "{" ".join(["word"] * words)} {i}"}}\n' for i in range(documents))
    )
    return path


def test_data_too_small_for_a_batch_or_an_evaluation_is_refused_before_any_rank_starts(
    tmp_path: Path, no_ranks: None, capsys: pytest.CaptureFixture[str]
) -> None:
    """These were refused by every rank, each on its own line, after the ranks started; a
    corpus_bytes too small for a window only after rank 0 had prepared the corpus (17 s)."""
    run = ["--set", f"logging.run_dir={tmp_path / 'run'}", "--set", "logging.wandb=disabled"]
    data = _jsonl(tmp_path / "small.jsonl", 8)  # ~8 windows of 65 tokens
    files = ["--set", "data.source=jsonl", "--set", f"data.path={data}", *run]
    assert main(["train", "debug", "--nproc", "2", *files, "--set", "train.batch_size=16"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert (
        err.startswith("DataError: ")
        and "fewer than one global batch of train.batch_size = 16" in err
    )
    data = _jsonl(tmp_path / "held-out.jsonl", 400, words=5)  # 1% held out: about 2 windows
    files = ["--set", "data.source=jsonl", "--set", f"data.path={data}", *run]
    evaluated = [*files, "--set", "data.validation=0.01", "--set", "eval.every=2"]
    assert main(["train", "debug", "--nproc", "4", "--set", "mesh.tp=1", *evaluated]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("RecipeError: ") and "fewer than the 4 data-parallel ranks" in err
    corpus = ["--set", f"data.path={tmp_path / 'corpus'}", "--set", "data.corpus_bytes=10", *run]
    assert main(["train", "debug", "--nproc", "2", *corpus]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("DataError: ") and "gave no text to tokenize" in err
