"""The launcher refuses a model that does not match the files it is built or started from, with
one line and exit status 2 before any rank starts: an ``init_from`` of another architecture, a
``[model] hf`` directory of a ``model_type`` transformers does not know, a checkpoint whose
config differs from the recipe's model, and a QLoRA recipe without torchao. Run on the real
command in a subprocess whose rank starter reports any start; the configs are written here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from meshtrain import CheckpointError
from meshtrain.recipes import Recipe, load_recipe
from meshtrain.recipes.model_check import check_model

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
#: ``meshtrain`` with torchrun's agent replaced by a report: any rank start is seen. The first
#: argument "no-torchao" makes torchao unimportable, as after a plain install.
RUNNER = """
import sys
if sys.argv[1] == "no-torchao":
    sys.modules["torchao"] = None
import meshtrain.launch
def started(*args, **kwargs):
    print("a rank was started", flush=True)
    return 99
meshtrain.launch.run_agent = started
from meshtrain.cli import main
sys.exit(main(sys.argv[2:]))
"""


def _train(*args: str, torchao: bool = True) -> tuple[int, str]:
    """``meshtrain train ARGS``: the exit status and everything printed."""
    process = subprocess.run(
        [sys.executable, "-c", RUNNER, "torchao" if torchao else "no-torchao", "train", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    return process.returncode, process.stdout + process.stderr


def _refused(code: int, output: str, kind: str) -> str:
    assert "a rank was started" not in output, output
    assert code == 2, output
    lines = output.splitlines()
    if lines and lines[0].startswith("meshtrain train "):  # what is starting, printed first
        lines = lines[1:]
    assert len(lines) == 1 and lines[0].startswith(f"{kind}: "), output
    return output


def _save(directory: Path, config: object, tensor_name: str) -> Path:
    """A transformers model directory: ``config`` (a transformers config) and one tensor."""
    config.save_pretrained(directory)  # type: ignore[attr-defined]
    save_file({tensor_name: torch.zeros(4, 4)}, str(directory / "model.safetensors"))
    return directory


def _check(recipe: Recipe) -> None:
    """The launcher's model check of ``recipe``, in this process."""
    check_model(recipe.source, recipe.model, init_from=recipe.checkpoint.init_from)


def _debug(tmp_path: Path, *sets: str) -> list[str]:
    """The debug recipe on one rank with synthetic data, its run directory in ``tmp_path``."""
    values = ["mesh.tp=1", "data.source=synthetic", f"logging.run_dir={tmp_path / 'run'}", *sets]
    return ["debug", "--nproc", "1", *(item for value in values for item in ("--set", value))]


@pytest.mark.parametrize(
    ("config", "kind", "tensor"),
    [
        (
            lambda: transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=256),
            "gpt2",
            "transformer.wte.weight",
        ),
        (
            lambda: transformers.MambaConfig(hidden_size=64, num_hidden_layers=2, vocab_size=256),
            "mamba",
            "backbone.embeddings.weight",
        ),
    ],
    ids=["gpt2", "mamba"],
)
def test_init_from_another_architecture_is_refused(
    tmp_path: Path, config: object, kind: str, tensor: str
) -> None:
    start = _save(tmp_path / kind, config(), tensor)  # type: ignore[operator]
    output = _refused(
        *_train(*_debug(tmp_path, f"checkpoint.init_from={start}")), "CheckpointError"
    )
    assert f"'{start / 'config.json'}' describes a {kind} model" in output
    assert "the recipe builds meshtrain's Llama" in output
    assert f"[model] hf = '{start}'" in output and "resume" not in output


def test_an_unknown_model_type_in_model_hf_is_refused(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    config = {"model_type": "llamma", "architectures": ["LlamaForCausalLM"], "hidden_size": 64}
    (model / "config.json").write_text(json.dumps(config))
    recipe = tmp_path / "hf.toml"
    recipe.write_text(
        f'[model]\nhf = "{model}"\n[mesh]\ndp = -1\n[data]\nsource = "synthetic"\n'
        f'[logging]\nrun_dir = "{tmp_path / "run"}"\n'
    )
    output = _refused(*_train(str(recipe), "--nproc", "1"), "RecipeError")
    assert f"[model] hf = '{model}'" in output
    version = transformers.__version__
    assert f"has model_type 'llamma', which transformers {version} does not know" in output
    assert "(close: llama" in output and 'Set "model_type"' in output


def test_a_checkpoint_of_another_config_is_refused_naming_each_key(tmp_path: Path) -> None:
    config = transformers.LlamaConfig(
        hidden_size=128,
        intermediate_size=192,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        rms_norm_eps=1e-6,
    )
    start = _save(tmp_path / "llama", config, "model.embed_tokens.weight")
    output = _refused(
        *_train(*_debug(tmp_path, f"checkpoint.init_from={start}")), "CheckpointError"
    )
    for name, ours, theirs in [("dim", 64, 128), ("n_layers", 2, 3), ("norm_eps", 1e-05, 1e-06)]:
        assert f"{name} = {ours!r} here but {theirs!r} there" in output
        assert f"--set model.{name}={theirs!r}" in output
    assert "n_heads" not in output and "vocab_size" not in output  # what agrees is not named
    assert "or give another init_from" in output


def test_a_qlora_recipe_without_torchao_is_refused_naming_the_extra(tmp_path: Path) -> None:
    recipe = tmp_path / "qlora.toml"
    recipe.write_text(
        '[model]\npreset = "debug"\n[mesh]\ndp = -1\n[data]\nsource = "synthetic"\n'
        f'[lora]\nrank = 4\nalpha = 8\ntargets = ["wq"]\nquantize_base = "nf4"\n'
        f'[logging]\nrun_dir = "{tmp_path / "run"}"\n'
    )
    code, output = _train(str(recipe), "--nproc", "1", torchao=False)
    output = _refused(code, output, "RecipeError")
    assert "[lora] quantize_base = 'nf4' trains an NF4 base with torchao" in output
    assert "`pip install meshtrain[qlora]`" in output


def test_a_model_hf_and_its_init_from_must_agree(tmp_path: Path) -> None:
    small = dict(
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        vocab_size=256,
        architectures=["LlamaForCausalLM"],
    )
    ours = _save(tmp_path / "ours", transformers.LlamaConfig(hidden_size=32, **small), "x")
    theirs = _save(tmp_path / "theirs", transformers.LlamaConfig(hidden_size=64, **small), "x")
    recipe = tmp_path / "hf.toml"
    head = f'[model]\nhf = "{ours}"\n[mesh]\ndp = -1\n[checkpoint]\n'
    recipe.write_text(f'{head}init_from = "{theirs}"\n')
    differ = r"hidden_size = 32 here but 64 there; head_dim = 8 here but 16 there\. Point "
    with pytest.raises(CheckpointError, match=differ):
        _check(load_recipe(str(recipe)))
    recipe.write_text(f'{head}init_from = "{ours}"\n')
    _check(load_recipe(str(recipe)))  # the directory itself
