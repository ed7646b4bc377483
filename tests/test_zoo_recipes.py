"""Recipes for models meshtrain did not write: ``[model] factory = "package.module:function"`` and
``[model] hf = "DIR"`` (a local transformers directory, built from its config), through
``meshtrain plan`` and ``meshtrain check``."""

from __future__ import annotations

from pathlib import Path

import pytest
import zoo

from meshtrain import RecipeError
from meshtrain.cli import main
from meshtrain.recipes import recipe_from_toml

ROOT = Path(__file__).resolve().parents[1]
TINY = """
[mesh]
dp = -1
tp = 2

[train]
batch_size = 8
seq_len = 16
steps = 2
"""


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A local Hugging Face directory holding the tiny Llama's config.json (no weights)."""
    directory = tmp_path_factory.mktemp("tiny-llama")
    config = zoo.llama().config
    config.architectures = ["LlamaForCausalLM"]  # what save_pretrained of the model records
    config.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A local transformers directory of a tiny random Qwen3: config.json and its weights."""
    directory = tmp_path_factory.mktemp("tiny-qwen3")
    model = zoo.qwen3()
    model.config.architectures = ["Qwen3ForCausalLM"]
    model.save_pretrained(directory)
    return directory


def _qwen3_recipe(tmp_path: Path, directory: Path, *, lora: bool) -> str:
    """examples/qwen3_lora.toml on the tiny Qwen3 (its directory, a sequence it can hold), with
    or without its [lora] section."""
    text = (ROOT / "examples" / "qwen3_lora.toml").read_text()
    text = text.replace('"models/qwen3"', f'"{directory}"').replace(
        "seq_len = 1024", "seq_len = 16"
    )
    if not lora:
        text = text[: text.index("\n[lora]")] + text[text.index("\n[train]") :]
    path = tmp_path / ("qwen3_lora.toml" if lora else "qwen3.toml")
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_the_qwen3_recipe_plans_with_the_model_s_own_rules(
    qwen3_dir: Path, tmp_path: Path, lora: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _qwen3_recipe(tmp_path, qwen3_dir, lora=lora)
    recipe = recipe_from_toml(Path(path).read_text(), source=path)
    assert (recipe.lora is not None) == lora and recipe.model.kind == "hf"
    assert type(recipe.build_model("meta")).__name__ == "Qwen3ForCausalLM"
    assert main(["plan", path, "--world", "8", "--device-memory", "1GiB"]) == 0
    assert "mesh {dp: 4, tp: 2}" in capsys.readouterr().out


@pytest.mark.spmd
@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_meshtrain_check_proves_the_qwen3_recipe(
    qwen3_dir: Path, tmp_path: Path, lora: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    """With [lora] the adapters train; without it every parameter does, the per-head q/k norms'
    partial gradients all-reduced over tp."""
    path = _qwen3_recipe(tmp_path, qwen3_dir, lora=lora)
    assert main(["check", path, "--world", "4", "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert ("LoRA rank 16" in out) == lora and "trains like one device" in out


def _write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "recipe.toml"
    path.write_text(text)
    return str(path)


def test_a_hugging_face_directory_plans_with_its_own_rules(
    llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    recipe = recipe_from_toml(f'[model]\nhf = "{llama_dir}"\n{TINY}', source="hf.toml")
    assert recipe.model.kind == "hf"
    model = recipe.build_model("meta")
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.use_cache is False
    rules = recipe.rules()  # the model's base_model_tp_plan
    assert any("q_proj" in pattern for pattern, _ in rules.patterns)
    path = _write(tmp_path, f'[model]\nhf = "{llama_dir}"\n{TINY}')
    assert main(["plan", path, "--world", "8", "--device-memory", "1GiB"]) == 0
    assert "per rank" in capsys.readouterr().out


def test_a_factory_needs_rules_and_then_plans(tmp_path: Path) -> None:
    text = f'[model]\nfactory = "zoo:cnn"\n{TINY.replace("tp = 2", "")}'
    recipe = recipe_from_toml(text, source="cnn.toml")
    assert type(recipe.build_model()).__name__ == "SmallCNN"
    with pytest.raises(RecipeError, match=r"\[model\] factory 'zoo:cnn' needs \[rules\]"):
        recipe.rules()
    with_rules = recipe_from_toml(text + "\n[rules]\n'.*' = \"P()\"\n", source="cnn.toml")
    assert with_rules.rules().patterns[-1][0] == ".*"


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ('factory = "zoo"', r"'zoo' is not 'package\.module:function'"),
        ('factory = "no_such_module:build"', r"cannot import 'no_such_module'"),
        ('factory = "zoo:nothing"', r"module 'zoo' has no callable 'nothing'"),
        ('hf = "/no/such/dir"', r"'/no/such/dir' has no config\.json"),
        ('factory = "zoo:cnn"\nn_layers = 4', r"\[model\] gives \['factory', 'n_layers'\]"),
    ],
)
def test_model_sources_are_checked_when_the_recipe_loads(model: str, message: str) -> None:
    with pytest.raises(RecipeError, match=message):
        recipe_from_toml(f"[model]\n{model}\n{TINY}", source="bad.toml")


@pytest.mark.spmd
def test_meshtrain_check_proves_a_hugging_face_recipe(
    llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _write(tmp_path, f'[model]\nhf = "{llama_dir}"\n{TINY}')
    assert main(["check", path, "--world", "4", "--steps", "2"]) == 0
    assert "trains like one device" in capsys.readouterr().out
