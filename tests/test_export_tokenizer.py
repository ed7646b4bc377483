"""An export always carries the tokenizer the run trained with: a transformers Qwen2 directory
that holds its own (different) tokenizer, fine-tuned on the byte tokenizer, exports the byte
tokenizer — not the directory's, which would encode other ids than the weights learned — and a
run whose tokenizer files are gone is refused before any weight is written."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from meshtrain.errors import CheckpointError
from meshtrain.recipes.pretrained import export_run
from meshtrain.train.checkpoint import CheckpointConfig, Checkpointer

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")


def _model_directory(root: Path) -> Path:
    """A tiny Qwen2 with its own word-level tokenizer.json (ids unrelated to bytes)."""
    config = transformers.Qwen2Config(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        architectures=["Qwen2ForCausalLM"],
    )
    directory = root / "qwen2"
    config.save_pretrained(directory)
    words = {"[UNK]": 0, "hello": 1, "world": 2}
    own = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab=words, unk_token="[UNK]"))
    own.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    own.save(str(directory / "tokenizer.json"))
    config_file = {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "[UNK]"}
    (directory / "tokenizer_config.json").write_text(json.dumps(config_file))
    (directory / "generation_config.json").write_text(json.dumps({"max_new_tokens": 7}))
    return directory


def _run(root: Path, directory: Path, tokenizer: str) -> Path:
    """A run directory whose one checkpoint holds the model's weights and records its recipe."""
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(transformers.AutoConfig.from_pretrained(directory))
    recipe: dict[str, Any] = {
        "model": {"hf": str(directory)},
        "data": {"source": "synthetic", "tokenizer": tokenizer},
    }
    checkpoints = root / "run" / "checkpoints"
    Checkpointer(CheckpointConfig(checkpoints)).save(
        1, dict(model.state_dict()), None, {"step": 1, "recipe": recipe}
    )
    return root / "run"


def test_a_hf_model_trained_on_bytes_exports_the_byte_tokenizer_not_its_directorys(
    tmp_path: Path,
) -> None:
    directory = _model_directory(tmp_path)
    out = tmp_path / "export"
    export_run(_run(tmp_path, directory, "byte"), out)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert tokenizer("héllo world").input_ids == list("héllo world".encode())
    assert json.loads((out / "generation_config.json").read_text())["max_new_tokens"] == 7
    assert transformers.AutoModelForCausalLM.from_pretrained(out).config.vocab_size == 256


def test_a_run_on_its_model_directorys_tokenizer_exports_that_tokenizer(tmp_path: Path) -> None:
    directory = _model_directory(tmp_path)
    out = tmp_path / "export"
    export_run(_run(tmp_path, directory, "model"), out)
    assert (out / "tokenizer.json").read_bytes() == (directory / "tokenizer.json").read_bytes()
    exported = tokenizers.Tokenizer.from_file(str(out / "tokenizer.json"))
    assert exported.encode("hello world").ids == [1, 2]


@pytest.mark.parametrize("tokenizer", ["model", "missing"])
def test_an_export_whose_tokenizer_files_are_gone_is_refused_before_writing(
    tmp_path: Path, tokenizer: str
) -> None:
    directory = _model_directory(tmp_path)
    run = _run(
        tmp_path, directory, str(tmp_path / "gone.json") if tokenizer == "missing" else tokenizer
    )
    (directory / "tokenizer.json").unlink()
    out = tmp_path / "export"
    with pytest.raises(CheckpointError, match="would carry no tokenizer") as refused:
        export_run(run, out)
    assert "\n" not in refused.value.message
    assert not out.exists()


def test_building_a_hf_model_prints_no_third_party_load_noise(tmp_path: Path) -> None:
    """Every ``[model] hf`` run used to print torchao's "Failed to load … .so" lines and torch's
    pytree notices on each rank (transformers imports torchao when it is installed)."""
    import subprocess
    import sys

    directory = _model_directory(tmp_path)
    code = (
        "from meshtrain.recipes import recipe_from_toml\n"
        f"recipe = recipe_from_toml('[model]\\nhf = \"{directory}\"\\n[mesh]\\ndp = 1\\n')\n"
        "model = recipe.build_model(device='cpu', seed=0)\n"
        "print(type(model).__name__)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "Qwen2ForCausalLM"
    assert done.stderr == "", done.stderr[-2000:]
