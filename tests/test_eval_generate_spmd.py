"""``[eval]`` on the run's plan reports the loss one device computes on the same checkpoint and
held-out data; ``meshtrain eval`` and ``meshtrain generate`` read a run trained on 2 ranks on one
process; a planted fault (no reduction over data-parallel ranks) is caught."""

from __future__ import annotations

import json
from pathlib import Path
from unittest import mock

import pytest

from meshtrain.cli import main
from meshtrain.recipes import load_recipe
from meshtrain.recipes.evaluation import evaluate_run, load_run
from meshtrain.recipes.generation import generate
from meshtrain.recipes.run import train
from meshtrain.testing.runner import get_pool
from meshtrain.train.metrics.sinks import read_jsonl

pytestmark = [pytest.mark.spmd, pytest.mark.slow]
STEPS = 4


def _overrides(root: Path, data: Path, run: str) -> list[str]:
    return [
        f"train.steps={STEPS}",
        "train.warmup_steps=1",
        "train.seq_len=32",
        "train.batch_size=4",
        "mesh.tp=1",  # dp = 2 on 2 ranks: the reduction matters
        "data.source=jsonl",
        f"data.path={data}",
        "data.format=instruction",
        "data.validation=0.2",
        "eval.every=2",
        "eval.batches=2",
        f"logging.run_dir={root / run}",
        "logging.console=false",
        "logging.wandb=disabled",
    ]


def run_recipe(overrides: list[str], planted: bool, stop_after: int | None = None) -> dict:
    """On every rank: train, with the planted fault when asked; the losses by step."""
    recipe = load_recipe("debug", overrides)
    if planted:
        with mock.patch("meshtrain.train.evaluate.group_over", return_value=None):
            return train(recipe, stop_after=stop_after).losses
    return train(recipe, stop_after=stop_after).losses


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    root = tmp_path_factory.mktemp("eval")
    data = root / "sft.jsonl"
    rows = [{"prompt": f"Q{i}: {i}+{i}=", "response": f"{2 * i}."} for i in range(300)]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    overrides = _overrides(root, data, "run")
    losses = get_pool(2).run(run_recipe, overrides, False)[0]
    assert sorted(losses) == list(range(1, STEPS + 1))
    (root / "losses.json").write_text(json.dumps(losses))
    return root, overrides


def _val_losses(run_dir: Path) -> dict[int, float]:
    return {
        row["step"]: row["val_loss"]
        for row in read_jsonl(run_dir / "metrics.jsonl")
        if "val_loss" in row
    }


def test_eval_on_the_plan_matches_one_device_on_the_checkpoint(
    trained: tuple[Path, list[str]],
) -> None:
    root, _ = trained
    logged = _val_losses(root / "run")
    assert sorted(logged) == [2, 4]
    run = load_run(root / "run")
    assert run.step == STEPS
    result, what = evaluate_run(run, batches=2)
    assert what == f"the validation split ({root / 'run' / 'data' / 'validation'})"
    # same weights, same batches, fp32: the plan's reduction order is the only difference
    assert result.loss == pytest.approx(logged[STEPS], rel=1e-5)
    last = [row for row in read_jsonl(root / "run" / "metrics.jsonl") if "val_tokens" in row][-1]
    assert last["val_tokens"] == result.tokens  # the same held-out tokens, each once
    rows = [row for row in read_jsonl(root / "run" / "metrics.jsonl") if "val_loss" in row]
    assert all(
        row["val_perplexity"] == pytest.approx(2.718281828 ** row["val_loss"]) for row in rows
    )


def test_planted_missing_data_parallel_reduction_is_caught(
    trained: tuple[Path, list[str]],
) -> None:
    root, overrides = trained
    planted = [*overrides[:-3], f"logging.run_dir={root / 'planted'}", *overrides[-2:]]
    get_pool(2).run(run_recipe, planted, True)
    logged = _val_losses(root / "planted")
    result, _ = evaluate_run(load_run(root / "planted"), batches=2)
    assert result.loss != pytest.approx(logged[STEPS], rel=1e-5)


def test_eval_and_generate_commands_read_the_run(
    trained: tuple[Path, list[str]], capsys: pytest.CaptureFixture[str]
) -> None:
    root, _ = trained
    assert main(["eval", str(root / "run"), "--batches", "2"]) == 0
    assert f"step {STEPS} | val_loss" in capsys.readouterr().out
    prompt = "Q7: 7+7="
    assert (
        main(
            [
                "generate",
                str(root / "run"),
                "--prompt",
                prompt,
                "--max-new-tokens",
                "5",
                "--temperature",
                "0",
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    greedy = generate(load_run(root / "run"), prompt, max_new_tokens=5, temperature=0)
    assert printed == prompt + greedy + "\n"  # greedy: the same continuation each time


def test_an_export_carries_the_tokenizer_transformers_generates_with(
    trained: tuple[Path, list[str]], tmp_path: Path
) -> None:
    transformers = pytest.importorskip("transformers")
    root, _ = trained
    out = tmp_path / "hf"
    assert main(["export", str(root / "run"), "--format", "hf", "--out", str(out)]) == 0
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    prompt = "Q12: 12+12="
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    assert ids[0].tolist() == list(prompt.encode())  # the byte tokenizer's ids exactly
    output = model.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=0, pad_token_id=0)
    ours = generate(load_run(root / "run"), prompt, max_new_tokens=6, temperature=0)
    assert tokenizer.decode(output[0, ids.shape[1] :], skip_special_tokens=True) == ours


def test_a_run_on_packed_files_resumes_at_the_exact_sample(
    trained: tuple[Path, list[str]],
) -> None:
    root, overrides = trained
    straight = {int(k): v for k, v in json.loads((root / "losses.json").read_text()).items()}
    resumed = [*overrides[:-3], f"logging.run_dir={root / 'resumed'}", *overrides[-2:]]
    first = get_pool(2).run(run_recipe, resumed, False, 2)[0]
    second = get_pool(2).run(run_recipe, resumed, False)[0]
    assert first == {step: straight[step] for step in (1, 2)}
    assert second == {step: straight[step] for step in (3, 4)}  # same mesh: bitwise


PIPELINED = ["mesh.pp=2", "mesh.tp=1", "mesh.dp=1", "parallel.pipeline.microbatches=2"]


def test_eval_on_a_pipelined_plan_matches_one_device_on_the_checkpoint(
    trained: tuple[Path, list[str]],
) -> None:
    """Two stages on 2 ranks: ``[eval]`` runs the schedule forward only; the loss over global
    tokens equals what one process computes on the same checkpoint, and a planted fault (the
    last stage's sum not passed to the rank that logs) is caught."""
    root, overrides = trained
    runs = {}
    for name, planted in (("pipelined", False), ("pipelined_planted", True)):
        changed = [*overrides[:-3], f"logging.run_dir={root / name}", *overrides[-2:]]
        changed = [o for o in changed if not o.startswith("mesh.tp")] + PIPELINED
        get_pool(2).run(run_recipe, changed, planted)
        runs[name] = (_val_losses(root / name), evaluate_run(load_run(root / name), batches=2))
    logged, (result, _) = runs["pipelined"]
    assert sorted(logged) == [2, 4]
    assert result.loss == pytest.approx(logged[STEPS], rel=1e-5)
    print(f"pipelined val_loss {logged[STEPS]:.6f} one device {result.loss:.6f}")
    planted_logged, (planted_result, _) = runs["pipelined_planted"]
    assert planted_result.loss != pytest.approx(planted_logged[STEPS], rel=1e-5)


def _forge(run: Path, forged: Path, launched_from: str = "", **sections: dict) -> dict:
    """A copy of ``run`` whose newest checkpoint records a recipe with ``sections`` replaced
    (and the directory it was launched from, when given), re-sealed (a sha256 finds damage,
    not forgery); the recipe as it was."""
    import shutil

    from meshtrain.train.checkpoint import find_resume_point
    from meshtrain.train.checkpoint.integrity import seal_state

    shutil.copytree(run, forged)
    point = find_resume_point(forged / "checkpoints")
    assert point.checkpoint is not None
    state_path = point.checkpoint / "meshtrain.json"
    state = json.loads(state_path.read_text())
    del state["checksum"]
    recipe = state["extra"]["recipe"]
    state["extra"]["recipe"] = {**recipe, "rules": {".*": "P()"}, **sections}
    assert state["extra"]["run"]["launched_from"]  # every run records it
    if launched_from:
        state["extra"]["run"]["launched_from"] = launched_from
    state_path.write_text(seal_state(state))
    return recipe


def test_a_checkpoint_of_another_model_names_the_tensors_that_differ(
    trained: tuple[Path, list[str]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """It ended in ``RuntimeError: Error(s) in loading state_dict``."""
    root, _ = trained
    forged = tmp_path / "forged"
    recipe = _forge(root / "run", forged, model={"preset": "debug", "dim": 128})
    assert recipe["model"].get("dim", 64) == 64
    assert main(["eval", str(forged)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "does not hold the model its recorded recipe builds: " in err
    assert "'tok_embeddings.weight' saved [256, 64], the recipe's model [256, 128]" in err


def test_eval_reads_the_run_it_is_given_from_any_directory(
    trained: tuple[Path, list[str]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A run recorded with a relative run directory (``runs/sft``, as most recipes write it),
    moved or read from elsewhere: eval used to look for the data under the current directory
    ("no prepared token file at 'runs/…/data/train'") or read another run's. It reads the run
    directory it is given, and says which data it read."""
    root, _ = trained
    moved = tmp_path / "moved"
    _forge(root / "run", moved, logging={"run_dir": "runs/sft", "console": False})
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "runs" / "sft").mkdir(parents=True)  # another run's directory, empty
    monkeypatch.chdir(elsewhere)
    assert main(["eval", str(moved), "--batches", "1"]) == 0
    out = capsys.readouterr().out
    assert f"of the validation split ({moved.resolve() / 'data' / 'validation'})" in out


def test_a_run_s_relative_data_path_is_read_from_where_it_was_launched(
    trained: tuple[Path, list[str]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The built-in corpus at its default ``data/corpus`` is relative to where `meshtrain
    train` ran; eval from another directory, of a moved run directory, looked for it under the
    current directory ("no prepared token file at 'data/corpus'")."""
    from meshtrain.train.data import prepare_corpus

    root, _ = trained
    launch = tmp_path / "launch"
    prepare_corpus(launch / "data" / "corpus", limit_bytes=20_000)
    moved = tmp_path / "moved"
    data = {"source": "corpus", "path": "data/corpus", "tokenizer": "byte"}
    _forge(root / "run", moved, launched_from=str(launch), data=data)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert main(["eval", str(moved), "--batches", "1"]) == 0
    assert f"({launch / 'data' / 'corpus'})" in capsys.readouterr().out


def test_eval_and_export_name_a_newer_checkpoint_they_pass_over(
    trained: tuple[Path, list[str]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A torn newest checkpoint fell back to the older one without a word."""
    import shutil

    root, _ = trained
    run = tmp_path / "run"
    shutil.copytree(root / "run", run)
    newest = sorted((run / "checkpoints").glob("step_*"))[-1]
    torn = run / "checkpoints" / f"step_{STEPS + 1:08d}"
    shutil.copytree(newest, torn)
    (torn / ".metadata").write_bytes(b"torn")
    assert main(["eval", str(run), "--batches", "1"]) == 0
    captured = capsys.readouterr()
    assert f"warning: passed over {torn}: damaged (" in captured.err
    assert ".metadata: 4 bytes, expected" in captured.err
    assert f"loaded {newest} (step {STEPS})" in captured.out
    assert main(["export", str(run), "--format", "hf", "--out", str(tmp_path / "hf")]) == 0
    captured = capsys.readouterr()
    assert f"warning: passed over {torn}: damaged" in captured.err
    assert f"safetensors file, from {newest}" in captured.out


PLANTED_FACTORY = """
from pathlib import Path
Path(__file__).with_name("imported.marker").write_text("the checkpoint's factory ran")

def build():
    from meshtrain.models import LlamaConfig, build_llama
    return build_llama(LlamaConfig.preset("debug"), seed=0)
"""


def test_a_factory_recorded_in_a_checkpoint_is_never_imported_unless_named(
    trained: tuple[Path, list[str]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A forged ``meshtrain.json`` (re-sealed: a sha256 finds damage, not forgery) whose recipe
    names ``[model] factory`` in a module beside the user: ``eval`` and ``generate`` used to
    import and run it. Now they refuse in one line naming the factory, and import it only when
    the user names it again with ``--trust-factory``."""
    root, _ = trained
    forged = tmp_path / "forged"
    recipe = _forge(root / "run", forged, model={"factory": "planted_factory:build"})
    model = recipe["model"]
    (tmp_path / "planted_factory.py").write_text(PLANTED_FACTORY)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    marker = tmp_path / "imported.marker"
    for command in (["eval"], ["generate", "--prompt", "Q1:"]):
        assert main([command[0], str(forged), *command[1:]]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("CheckpointError: ")
        assert "records a model built by the factory 'planted_factory:build'" in err
        assert "--trust-factory planted_factory:build" in err
        assert not marker.exists()
    assert main(["eval", str(forged), "--trust-factory", "other:build"]) == 2
    assert "(you named 'other:build')" in capsys.readouterr().err and not marker.exists()
    # named by the user: imported, and the run's tensors load into what it builds
    assert model.get("preset", "debug") == "debug"
    assert (
        main(["eval", str(forged), "--batches", "1", "--trust-factory", "planted_factory:build"])
        == 0
    )
    assert marker.exists() and f"step {STEPS} | val_loss" in capsys.readouterr().out
