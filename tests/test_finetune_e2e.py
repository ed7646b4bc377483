"""Fine-tuning end to end on CPU ranks, through the CLI as a user runs it: pretrain the debug
model, export it as a transformers directory, load that with ``from_pretrained``, fine-tune it
with LoRA from the directory (``recipes/debug_lora.toml``), export the result with the adapters
merged, and load that too."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from meshtrain.train.hf.export import CheckpointTensors

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]


def _meshtrain(args: list[str], tmp_path: Path) -> str:
    env = {key: value for key, value in os.environ.items() if not key.startswith("WANDB_")}
    env.update(WANDB_DIR=str(tmp_path), OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, "-m", "meshtrain", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return done.stdout


def _sets(**values: object) -> list[str]:
    return [item for key, value in values.items() for item in ("--set", f"{key}={value}")]


def test_pretrain_export_finetune_with_lora_and_export_merged(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    data = _sets(**{"data.source": "synthetic", "data.samples": 256})
    pre, base, tuned = tmp_path / "pre", tmp_path / "debug-hf", tmp_path / "tuned"
    _meshtrain(
        [
            "train",
            "debug",
            "--nproc",
            "2",
            *data,
            *_sets(
                **{
                    "train.steps": 4,
                    "train.warmup_steps": 1,
                    "logging.run_dir": pre,
                    "checkpoint.interval": 0,
                    "logging.wandb": "disabled",
                }
            ),
        ],
        tmp_path,
    )
    _meshtrain(["export", str(pre), "--format", "hf", "--out", str(base)], tmp_path)
    pretrained = transformers.AutoModelForCausalLM.from_pretrained(base)
    tokens = torch.randint(
        0, pretrained.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0)
    )
    before = pretrained(tokens).logits
    assert torch.isfinite(before).all()

    run = tmp_path / "lora"
    out = _meshtrain(
        [
            "train",
            "debug_lora",
            "--nproc",
            "2",
            *data,
            *_sets(
                **{
                    "checkpoint.init_from": base,
                    "logging.run_dir": run,
                    "train.steps": 6,
                    "checkpoint.interval": 0,
                    "logging.wandb": "disabled",
                }
            ),
        ],
        tmp_path,
    )
    assert "trained to step 6" in out
    _meshtrain(["export", str(run), "--format", "hf", "--out", str(tuned)], tmp_path)
    merged = transformers.AutoModelForCausalLM.from_pretrained(tuned)
    assert not [name for name in merged.state_dict() if "lora" in name]

    # The base stayed frozen: every weight without adapters is the pretrained one, bit for bit;
    # the adapted ones are the pretrained weight plus (alpha / r)·B·A from the run's checkpoint.
    original, after = pretrained.state_dict(), merged.state_dict()
    adapted = {name for name in after if name.endswith(("q_proj.weight", "v_proj.weight"))}
    assert adapted and all(torch.equal(after[n], original[n]) for n in after if n not in adapted)
    checkpoint = CheckpointTensors(sorted((run / "checkpoints").glob("step_*"))[-1])
    a, b = checkpoint["layers.0.attention.wq.lora_A"], checkpoint["layers.0.attention.wq.lora_B"]
    assert b.abs().max() > 0  # the adapters trained
    delta = (
        after["model.layers.0.self_attn.q_proj.weight"]
        - original["model.layers.0.self_attn.q_proj.weight"]
    )
    assert delta.abs().max() > 0
    assert torch.allclose(delta.abs().sum(), ((8 / 4) * (b @ a)).abs().sum(), rtol=1e-4)
    assert torch.isfinite(merged(tokens).logits).all()


QLORA_RECIPE = """
[model]
preset = "debug"
dim = 256
n_layers = 2
n_heads = 4
n_kv_heads = 2
vocab_size = 512
multiple_of = 256

[mesh]
dp = 2
tp = 1

[parallel]
zero = 3
fsdp = ["dp"]

[lora]
rank = 4
alpha = 8
targets = ['layers\\.\\d+\\.attention\\.w[qkvo]', 'layers\\.\\d+\\.feed_forward\\.w[123]']
quantize_base = "nf4"

[train]
batch_size = 4
seq_len = 32
optimizer = "adamw"
lr = 1e-2
min_lr = 1e-2  # a constant rate after warm-up: stopping at step 4 changes no step's rate
warmup_steps = 1
steps = 6

[data]
source = "synthetic"
samples = 256

[checkpoint]
interval = 2

[logging]
wandb = "disabled"
"""


def _losses(run: Path) -> list[float]:
    import json

    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [row["loss"] for row in rows]


@pytest.mark.extended  # three launches and an export: ~70 s on 2 cores
def test_qlora_resumes_bit_for_bit_and_exports_the_merged_nf4_base(tmp_path: Path) -> None:
    """A QLoRA run from a dense checkpoint: stopped at step 4 and resumed, it trains exactly as
    an uninterrupted run (the NF4 shards come back whole, scale mean included); its export is
    the dequantized NF4 base plus (alpha / r)·B·A, the frozen dense weights bit for bit."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("torchao")
    from safetensors.torch import save_file

    from meshtrain.adapters.nf4 import quantize
    from meshtrain.recipes.recipe import recipe_from_toml

    base = recipe_from_toml(QLORA_RECIPE).build_model(device="cpu", seed=3, adapters=False)
    initial = {
        name: tensor.contiguous()
        for name, tensor in base.state_dict().items()
        if not name.endswith(("rope_cos", "rope_sin"))
    }
    save_file(initial, str(tmp_path / "base.safetensors"))
    recipe = tmp_path / "qlora.toml"
    recipe.write_text(
        QLORA_RECIPE.replace(
            "[checkpoint]\n", f'[checkpoint]\ninit_from = "{tmp_path / "base.safetensors"}"\n'
        )
    )
    stopped, whole = tmp_path / "stopped", tmp_path / "whole"
    _meshtrain(
        [
            "train",
            str(recipe),
            "--nproc",
            "2",
            *_sets(**{"logging.run_dir": stopped, "train.steps": 4}),
        ],
        tmp_path,
    )
    out = _meshtrain(
        ["train", str(recipe), "--nproc", "2", *_sets(**{"logging.run_dir": stopped})], tmp_path
    )
    assert "resumed from step 4" in out
    _meshtrain(
        ["train", str(recipe), "--nproc", "2", *_sets(**{"logging.run_dir": whole})], tmp_path
    )
    assert _losses(stopped) == _losses(whole) and len(_losses(whole)) == 6

    exported = tmp_path / "tuned"
    _meshtrain(["export", str(stopped), "--format", "hf", "--out", str(exported)], tmp_path)
    after = transformers.AutoModelForCausalLM.from_pretrained(exported).state_dict()
    assert not [name for name in after if "lora" in name]
    assert torch.equal(after["model.embed_tokens.weight"], initial["tok_embeddings.weight"])
    assert torch.equal(after["model.norm.weight"], initial["norm.weight"])
    checkpoint = CheckpointTensors(sorted((stopped / "checkpoints").glob("step_*"))[-1])
    for ours, theirs in (
        ("attention.wv", "self_attn.v_proj"),
        ("feed_forward.w2", "mlp.down_proj"),
    ):
        fqn = f"layers.1.{ours}"
        a, b = checkpoint[f"{fqn}.lora_A"], checkpoint[f"{fqn}.lora_B"]
        assert b.abs().max() > 0  # the adapters trained
        dequantized = quantize(initial[f"{fqn}.weight"].to(torch.bfloat16)).get_original_weight()
        expected = dequantized.float() + (8 / 4) * (b @ a)
        merged = after[f"model.layers.1.{theirs}.weight"].float()
        # the merged weight keeps the NF4 base's bf16: one rounding, bf16's unit roundoff 2^-8
        assert ((merged - expected).abs() <= 2.0**-8 * expected.abs()).all(), fqn
