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

from meshtrain.train.hf_export import CheckpointTensors

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]


def _meshtrain(args: list[str], tmp_path: Path) -> str:
    env = {key: value for key, value in os.environ.items() if not key.startswith("WANDB_")}
    env.update(WANDB_DIR=str(tmp_path), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "meshtrain", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=400)  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return done.stdout


def _sets(**values: object) -> list[str]:
    return [item for key, value in values.items() for item in ("--set", f"{key}={value}")]


def test_pretrain_export_finetune_with_lora_and_export_merged(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    data = _sets(**{"data.source": "synthetic", "data.samples": 256})
    pre, base, tuned = tmp_path / "pre", tmp_path / "debug-hf", tmp_path / "tuned"
    _meshtrain(["train", "debug", "--nproc", "2", *data,
                *_sets(**{"train.steps": 4, "train.warmup_steps": 1, "logging.run_dir": pre,
                          "checkpoint.interval": 0, "logging.wandb": "disabled"})], tmp_path)  # fmt: skip
    _meshtrain(["export", str(pre), "--format", "hf", "--out", str(base)], tmp_path)
    pretrained = transformers.AutoModelForCausalLM.from_pretrained(base)
    tokens = torch.randint(
        0, pretrained.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0)
    )
    before = pretrained(tokens).logits
    assert torch.isfinite(before).all()

    run = tmp_path / "lora"
    out = _meshtrain(["train", "debug_lora", "--nproc", "2", *data,
                      *_sets(**{"checkpoint.init_from": base, "logging.run_dir": run,
                                "train.steps": 6, "checkpoint.interval": 0,
                                "logging.wandb": "disabled"})], tmp_path)  # fmt: skip
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
