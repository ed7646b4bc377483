"""Start-up never holds more than a rank's share: ``meshtrain train``'s model start-up
(``start_model``: build on the meta device, plan, apply, materialise the local shards) measured in
fresh torchrun ranks, for a model whose full copy would not fit the bound.

Bound per rank: the plan's parameter bytes at rest + the largest single tensor of the model (the
materialiser initialises one module's full tensors at a time, then keeps only its shard) + 96 MiB
for what a process allocates besides tensors (gloo's buffers, the allocator's arenas). A full copy
of either model is larger than that bound, so building it on every rank would fail the test.

QLoRA (an NF4 base under adapters) the same way: its share at rest is the NF4 shards, the dense
embedding and head shards and the adapters; the largest unit is one weight drawn in fp32. Started
from a checkpoint (``init_from``), the process's anonymous resident memory is what is bounded: the
memory-mapped checkpoint pages each rank reads are the page cache's, not the rank's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
SLACK = 96 * 2**20

# A Llama of ~170M parameters (~680 MB in fp32): FSDP over 2 ranks holds half each.
LLAMA = """
[model]
preset = "debug"
dim = 1024
n_layers = 8
n_heads = 16
n_kv_heads = 8
vocab_size = 32000
"""


def _hf_directory(tmp_path: Path) -> Path:
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen2Config(
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=8,
        vocab_size=32000,
        tie_word_embeddings=False,
        architectures=["Qwen2ForCausalLM"],
    )
    directory = tmp_path / "qwen2"
    config.save_pretrained(directory)
    return directory


QLORA = """
[lora]
rank = 8
alpha = 16
targets = ['layers\\.\\d+\\.attention\\.w[qkvo]', 'layers\\.\\d+\\.feed_forward\\.w[123]']
quantize_base = "nf4"
"""


def _run(tmp_path: Path, model_section: str, extra: str = "") -> list[dict[str, object]]:
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(
        f"{model_section}\n[mesh]\ndp = 2\ntp = 1\n\n[parallel]\nzero = 3\n"
        f'\n[logging]\nrun_dir = "{tmp_path / "run"}"\n{extra}'
    )
    out = tmp_path / "out"
    out.mkdir()
    # glibc keeps freed blocks below its (self-raising) mmap threshold in the heap, where they
    # stay resident; a fixed threshold returns every large block, so the resident peak counts
    # live tensors only.
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(ROOT),
        "MALLOC_MMAP_THRESHOLD_": "65536",
    }
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        str(ROOT / "tests/ranks/startup_peak.py"),
        str(recipe),
        str(out),
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]


def _check(reports: list[dict[str, object]], grown_key: str = "grown") -> None:
    for report in reports:
        grown, at_rest = int(report[grown_key]), int(report["at_rest"])  # type: ignore[call-overload]
        largest, full = int(report["largest"]), int(report["full"])  # type: ignore[call-overload]
        bound = at_rest + largest + SLACK
        assert report["finite"], report
        assert report["local"] == at_rest, report
        assert full > bound, f"the model is too small to tell: full {full} ≤ bound {bound}"
        assert grown <= bound, (
            f"rank {report['rank']} grew by {grown / 2**20:.0f} MiB during start-up; its share "
            f"at rest is {at_rest / 2**20:.0f} MiB, the largest tensor {largest / 2**20:.0f} MiB "
            f"(bound {bound / 2**20:.0f} MiB, a full copy {full / 2**20:.0f} MiB)"
        )


def test_llama_starts_within_its_share(tmp_path: Path) -> None:
    _check(_run(tmp_path, LLAMA))


def test_hf_model_starts_within_its_share(tmp_path: Path) -> None:
    directory = _hf_directory(tmp_path)
    _check(_run(tmp_path, f'[model]\nhf = "{directory}"\n'))


def test_qlora_starts_within_its_share(tmp_path: Path) -> None:
    pytest.importorskip("torchao")
    reports = _run(tmp_path, LLAMA, QLORA)
    assert all(report["nf4"] == 8 * 7 for report in reports)  # every projection of 8 blocks
    _check(reports)


@pytest.mark.extended
def test_qlora_from_a_checkpoint_starts_within_its_share(tmp_path: Path) -> None:
    pytest.importorskip("torchao")
    import torch
    from safetensors.torch import save_file

    from meshtrain.recipes.recipe import recipe_from_toml

    model = recipe_from_toml(LLAMA + "[mesh]\ndp = 1\n").build_model(device="cpu", seed=3)
    weights = {
        name: tensor.to(torch.bfloat16).contiguous()
        for name, tensor in model.state_dict().items()
        if not name.endswith(("rope_cos", "rope_sin"))
    }
    save_file(weights, str(tmp_path / "base.safetensors"))
    del model, weights
    extra = f'{QLORA}\n[checkpoint]\ninit_from = "{tmp_path / "base.safetensors"}"\n'
    reports = _run(tmp_path, LLAMA, extra)
    _check(reports, "grown_anonymous")
