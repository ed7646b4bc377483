"""Hugging Face checkpoints in one process: transformers directories and single files (fp32,
bf16, fp16) load into meshtrain's Llama and into the transformers model, every way they can be
wrong is a CheckpointError naming the keys and the file, and a checkpoint exports as a directory
``from_pretrained`` loads — shard by shard, through the transform hook.

Logits of meshtrain's Llama against transformers' are compared within 1e-5 · (1 + max |logit|)
(see tests/test_hf_checkpoint_spmd.py for why); the weights themselves compare exactly.
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from meshtrain.cli import main
from meshtrain.errors import CheckpointError
from meshtrain.models.llama import LlamaConfig, build_llama
from meshtrain.models.llama_hf import (
    hf_config_from_llama,
    hf_sources,
    llama_config_from_hf,
    llama_to_hf,
    rotary_rows,
)
from meshtrain.recipes.pretrained import export_run, load_pretrained
from meshtrain.train.checkpoint import CheckpointConfig, Checkpointer
from meshtrain.train.hf.export import export_hf
from meshtrain.train.hf.files import read_config
from meshtrain.train.hf.load import load_hf

transformers = pytest.importorskip("transformers")

HF_SHAPES = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
}


def _hf_model(**overrides: Any) -> Any:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        **{
            **HF_SHAPES,
            "rope_theta": 5000.0,
            "initializer_range": 0.1,
            "use_cache": False,
            **overrides,
        }
    )
    return transformers.LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("hf") / "llama"
    _hf_model().save_pretrained(directory, max_shard_size="100KB")
    return directory


def _tokens() -> torch.Tensor:
    return torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))


def _llama_for(directory: Path) -> nn.Module:
    return build_llama(llama_config_from_hf(read_config(directory) or {}), seed=3)


def _close(ours: torch.Tensor, theirs: torch.Tensor) -> bool:
    return (ours - theirs).abs().max().item() <= 1e-5 * (1 + theirs.abs().max().item())


# ---------------------------------------------------------------- in


def test_rotary_rows_turn_halves_into_adjacent_pairs() -> None:
    """transformers rotates x[i] with x[i + d/2]; meshtrain x[2i] with x[2i+1]: row 2i + c of a
    meshtrain head is row c·d/2 + i of the transformers head."""
    assert rotary_rows(2, 4).tolist() == [0, 2, 1, 3, 4, 6, 5, 7]
    weight = torch.randn(8, 3)
    config = LlamaConfig(dim=8, n_layers=1, n_heads=2, n_kv_heads=2, vocab_size=4)
    ((_, back),) = llama_to_hf(config, "layers.0.attention.wq.weight", weight[rotary_rows(2, 4)])
    assert torch.equal(back, weight)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_llama_loads_a_sharded_transformers_directory(dtype: torch.dtype, tmp_path: Path) -> None:
    _hf_model().to(dtype).save_pretrained(tmp_path, max_shard_size="100KB")
    assert json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    assert {t.dtype for t in load_file(next(tmp_path.glob("model-*.safetensors"))).values()} == {
        dtype
    }
    # the stored values, computed in fp32 (casting a model would round its rotary buffer too)
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    model = _llama_for(tmp_path)
    report = load_pretrained(tmp_path, model)
    assert report.tensors == len(dict(model.named_parameters())) == 21
    assert report.bytes_read == report.checkpoint_bytes  # one process holds every tensor
    assert model.norm.weight.dtype == torch.float32
    assert torch.equal(model.norm.weight, reference.model.norm.weight)
    with torch.no_grad():
        assert _close(model(_tokens()), reference(_tokens()).logits)


def test_a_tied_checkpoint_fills_the_untied_head_and_the_hf_model_loads_one_to_one(
    tmp_path: Path,
) -> None:
    tied = _hf_model(tie_word_embeddings=True)
    tied.save_pretrained(tmp_path)
    assert "lm_head.weight" not in load_file(tmp_path / "model.safetensors")
    model = _llama_for(tmp_path)
    load_pretrained(tmp_path, model)
    assert torch.equal(model.output.weight, tied.model.embed_tokens.weight)
    with torch.no_grad():
        assert _close(model(_tokens()), tied(_tokens()).logits)
    torch.manual_seed(5)
    again = transformers.LlamaForCausalLM(tied.config).eval()
    assert load_pretrained(tmp_path, again).tensors == 20  # lm_head is the embedding
    with torch.no_grad():
        assert torch.equal(again(_tokens()).logits, tied(_tokens()).logits)


def test_a_single_file_loads_with_transformers_or_meshtrain_names(
    hf_dir: Path, tmp_path: Path
) -> None:
    reference = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    file = tmp_path / "weights.safetensors"
    save_file({k: v.contiguous() for k, v in reference.state_dict().items()}, str(file))
    model = _llama_for(hf_dir)
    load_pretrained(file, model)
    with torch.no_grad():
        assert _close(model(_tokens()), reference(_tokens()).logits)
    own = tmp_path / "own.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(own))
    fresh = _llama_for(hf_dir)
    load_pretrained(own, fresh)
    assert all(
        torch.equal(a, b) for a, b in zip(fresh.parameters(), model.parameters(), strict=True)
    )


def _broken_copy(hf_dir: Path, tmp_path: Path, change: dict[str, torch.Tensor | None]) -> Path:
    """One file holding the directory's tensors with ``change`` applied (None removes)."""
    tensors = {}
    for file in hf_dir.glob("model-*.safetensors"):
        tensors.update(load_file(file))
    for name, tensor in change.items():
        if tensor is None:
            tensors.pop(name)
        else:
            tensors[name] = tensor
    out = tmp_path / "broken"
    out.mkdir(parents=True)
    (out / "config.json").write_text((hf_dir / "config.json").read_text())
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def test_missing_unexpected_and_misshaped_keys_name_the_keys_and_the_file(
    hf_dir: Path, tmp_path: Path
) -> None:
    layers = [f"model.layers.{i}.mlp.up_proj.weight" for i in range(2)]
    change: dict[str, torch.Tensor | None] = {name: None for name in layers}
    change["model.norm.weight"] = torch.ones(32)
    change.update({f"extra.{i}": torch.zeros(1) for i in range(8)})
    broken = _broken_copy(hf_dir, tmp_path, change)
    model = _llama_for(hf_dir)
    before = [p.clone() for p in model.parameters()]
    with pytest.raises(CheckpointError) as raised:
        load_pretrained(broken, model)
    message = raised.value.message
    assert message.startswith(f"cannot load '{broken}' into Llama:")
    assert (
        "2 tensor(s) the model needs are not in the checkpoint (model.safetensors): "
        "'model.layers.0.mlp.up_proj.weight', 'model.layers.1.mlp.up_proj.weight'"
    ) in message
    assert (
        "8 tensor(s) in the checkpoint that the model lacks: 'extra.0', 'extra.1', 'extra.2', "
        "'extra.3', 'extra.4', 'extra.5' and 2 more (in model.safetensors)"
    ) in message
    assert "'model.norm.weight' is 32 in model.safetensors but 'norm.weight' is 64" in message
    assert "Build the model from the checkpoint's own config.json" in message
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_strict_false_skips_missing_and_extra_names_but_never_a_wrong_shape(
    hf_dir: Path, tmp_path: Path
) -> None:
    broken = _broken_copy(hf_dir, tmp_path, {"model.norm.weight": None, "extra": torch.zeros(1)})
    config = llama_config_from_hf(read_config(hf_dir) or {})
    model = _llama_for(hf_dir)
    norm = model.norm.weight.detach().clone()
    report = load_hf(broken, model, sources=hf_sources(config), strict=False)
    assert report.tensors == 20 and torch.equal(model.norm.weight, norm)
    reference = load_file(broken / "model.safetensors")["model.layers.1.mlp.down_proj.weight"]
    assert torch.equal(model.layers["1"].feed_forward.w2.weight, reference)
    wrong = _broken_copy(hf_dir, tmp_path / "w", {"model.norm.weight": torch.ones(3)})
    with pytest.raises(CheckpointError, match=r"'model\.norm\.weight' is 3 in model\.safetensors"):
        load_hf(wrong, model, sources=hf_sources(config), strict=False)


def test_a_model_on_the_meta_device_is_refused(hf_dir: Path) -> None:
    model = build_llama(llama_config_from_hf(read_config(hf_dir) or {}), device="meta")
    with pytest.raises(
        CheckpointError,
        match="'tok_embeddings.weight' is on the meta device: "
        r"materialise the model first",
    ):
        load_pretrained(hf_dir, model)


def test_paths_that_hold_no_checkpoint_are_refused(hf_dir: Path, tmp_path: Path) -> None:
    model = _llama_for(hf_dir)
    with pytest.raises(CheckpointError, match="does not exist: give a transformers model"):
        load_hf(tmp_path / "nowhere", model)
    (tmp_path / "empty").mkdir()
    with pytest.raises(
        CheckpointError, match=r"has neither model\.safetensors nor model\.safetensors"
    ):
        load_hf(tmp_path / "empty", model)
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(CheckpointError, match=r"is not a \.safetensors file"):
        load_hf(tmp_path / "weights.bin", model)
    partial_copy = tmp_path / "partial"
    partial_copy.mkdir()
    for file in [
        hf_dir / "config.json",
        hf_dir / "model.safetensors.index.json",
        *sorted(hf_dir.glob("model-*.safetensors"))[1:],
    ]:
        (partial_copy / file.name).write_bytes(file.read_bytes())
    with pytest.raises(
        CheckpointError,
        match=r"lists 'model-00001-of-00005.safetensors', which is "
        r"not in .*: the download or copy is incomplete",
    ):
        load_hf(partial_copy, model)


def test_a_llama_that_differs_from_config_json_is_refused(hf_dir: Path) -> None:
    config = llama_config_from_hf(read_config(hf_dir) or {})
    other = build_llama(LlamaConfig(**{**config.__dict__, "rope_theta": 10000.0}))
    with pytest.raises(
        CheckpointError,
        match=r"rope_theta = 10000.0 here but 5000.0 there.*"
        r"Set \[model\] rope_theta to match",
    ):
        load_pretrained(hf_dir, other)
    with pytest.raises(
        CheckpointError,
        match=r"cannot compute this model the same way \(rope "
        r"type differ",
    ):
        llama_config_from_hf({**HF_SHAPES, "rope_parameters": {"rope_type": "llama3"}})


# ---------------------------------------------------------------- out


def _save_checkpoint(model: nn.Module, directory: Path, **extra_tensors: torch.Tensor) -> Path:
    params: dict[str, torch.Tensor] = dict(model.named_parameters())
    params.update(extra_tensors)
    return Checkpointer(CheckpointConfig(directory)).save(1, params, None, {"step": 1})


def test_export_streams_shards_that_from_pretrained_loads(hf_dir: Path, tmp_path: Path) -> None:
    reference = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    model = _llama_for(hf_dir)
    load_pretrained(hf_dir, model)
    config = model.config
    checkpoint = _save_checkpoint(model, tmp_path / "ckpt")
    report = export_hf(
        checkpoint,
        tmp_path / "out",
        config=hf_config_from_llama(config),
        rename=partial(llama_to_hf, config),
        max_shard_size="50KB",
    )
    files = sorted((tmp_path / "out").glob("model-*.safetensors"))
    assert len(files) == len(report.files) > 1
    largest_tensor = 256 * 64 * 4  # the embedding: 64 KiB, more than a shard
    assert all(f.stat().st_size <= max(50_000, largest_tensor) + 1024 for f in files)
    assert (
        report.largest_read_bytes <= largest_tensor
    )  # one shard's worth (or one tensor) at a time
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert all(torch.equal(v, reference.state_dict()[k]) for k, v in exported.state_dict().items())
    with torch.no_grad():
        assert torch.equal(exported(_tokens()).logits, reference(_tokens()).logits)


def test_the_transform_hook_sees_every_tensor_and_can_read_its_companions(
    hf_dir: Path, tmp_path: Path
) -> None:
    """A LoRA-style merge through the hook: W + B·A into wq, the adapters dropped."""
    model = _llama_for(hf_dir)
    lora_a, lora_b = torch.randn(4, 64), torch.randn(64, 4)
    checkpoint = _save_checkpoint(
        model,
        tmp_path / "ckpt",
        **{
            "layers.0.attention.wq.lora_A.weight": lora_a,
            "layers.0.attention.wq.lora_B.weight": lora_b,
        },
    )
    seen = []

    def merge(fqn: str, tensor: torch.Tensor, checkpoint: Any) -> list[tuple[str, torch.Tensor]]:
        seen.append(fqn)
        if ".lora_" in fqn:
            return []
        adapter = fqn.removesuffix(".weight") + ".lora_{}.weight"
        if adapter.format("A") in checkpoint:
            tensor = tensor + checkpoint[adapter.format("B")] @ checkpoint[adapter.format("A")]
        return [(fqn, tensor)]

    config = model.config
    export_hf(
        checkpoint,
        tmp_path / "out",
        config=hf_config_from_llama(config),
        transform=merge,
        rename=partial(llama_to_hf, config),
        dtype=torch.bfloat16,
    )
    assert len(seen) == 23
    written = load_file(tmp_path / "out" / "model.safetensors")
    assert len(written) == 21 and all(t.dtype == torch.bfloat16 for t in written.values())
    merged = model.layers["0"].attention.wq.weight.detach() + lora_b @ lora_a
    ((_, expected),) = llama_to_hf(config, "layers.0.attention.wq.weight", merged)
    assert torch.equal(written["model.layers.0.self_attn.q_proj.weight"], expected.bfloat16())
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "bfloat16"


def test_export_refuses_an_existing_output_and_a_run_without_checkpoints(
    hf_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = _llama_for(hf_dir)
    checkpoint = _save_checkpoint(model, tmp_path / "ckpt")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "file").touch()
    with pytest.raises(CheckpointError, match="already exists and is not an empty directory"):
        export_hf(checkpoint, tmp_path / "taken", config={})
    with pytest.raises(CheckpointError, match="is not a size"):
        export_hf(checkpoint, tmp_path / "new", config={}, max_shard_size="big")
    (tmp_path / "run").mkdir()
    assert main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err == (
        f"CheckpointError: no intact checkpoint in '{tmp_path / 'run'}': nothing to export. "
        "Train the run first (`meshtrain checkpoints DIR` lists what is there).\n"
    )
    assert main(["export", str(tmp_path), "--format", "gguf", "--out", str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err == (
        "CheckpointError: unknown export format 'gguf': meshtrain export writes 'hf' (a "
        "transformers directory).\n"
    )
    with pytest.raises(CheckpointError, match="does not record the recipe that trained it"):
        export_run(tmp_path / "ckpt", tmp_path / "o")
    assert not (tmp_path / "o").exists()


def test_a_run_of_an_hf_model_exports_its_own_config_and_files(
    hf_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``[model] hf`` runs export under the model's own names, with the source directory's
    config.json (dtype set to what was written) and the generation config beside it; the
    tokenizer is the one the run trained with (the byte tokenizer here, not the directory's own
    tokenizer_config.json: tests/test_export_tokenizer.py)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    (hf_dir / "tokenizer_config.json").write_text("{}")
    recipe = {"model": {"hf": str(hf_dir)}, "mesh": {"dp": 1}}
    params = dict(model.named_parameters())
    Checkpointer(CheckpointConfig(tmp_path / "run" / "checkpoints")).save(
        4, params, None, {"step": 4, "recipe": recipe}
    )
    report = export_run(tmp_path / "run", tmp_path / "out", dtype=torch.bfloat16)
    assert report.files == ("model.safetensors",) and report.tensors == 21
    names = sorted(path.name for path in (tmp_path / "out").iterdir())
    assert names == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    written = json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())
    assert written["tokenizer_class"] == "PreTrainedTokenizerFast"  # the byte tokenizer's, not {}
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config == {**json.loads((hf_dir / "config.json").read_text()), "dtype": "bfloat16"}
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert all(
        torch.equal(v, model.state_dict()[k].bfloat16()) for k, v in exported.state_dict().items()
    )
    capsys.readouterr()  # transformers' progress bars
    assert main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == (
        f"CheckpointError: '{tmp_path / 'out'}' already exists and is not an empty directory; "
        "nothing was written. Choose a new --out directory or remove that one.\n"
    )


def test_damaged_indexes_headers_and_configs_are_refused(hf_dir: Path, tmp_path: Path) -> None:
    model = _llama_for(hf_dir)
    copy = tmp_path / "copy"
    copy.mkdir()
    for file in hf_dir.iterdir():
        (copy / file.name).write_bytes(file.read_bytes())
    index = copy / "model.safetensors.index.json"
    weight_map = json.loads(index.read_text())["weight_map"]
    first, second = sorted(set(weight_map.values()))[:2]
    moved = next(name for name, file in weight_map.items() if file == first)
    index.write_text(json.dumps({"weight_map": {**weight_map, moved: second}}))
    with pytest.raises(
        CheckpointError, match=f"places '{moved}' in '{second}', which does not hold it"
    ):
        load_hf(copy, model)
    index.write_text("{not json")
    with pytest.raises(CheckpointError, match=r"cannot read .*index\.json.*weight_map"):
        load_hf(copy, model)
    index.unlink()
    (copy / "model.safetensors").write_bytes(b"\x00" * 16)
    with pytest.raises(CheckpointError, match=r"cannot read the safetensors header of .*damaged"):
        load_hf(copy, model)
    (copy / "config.json").write_text("[1]")
    with pytest.raises(CheckpointError, match=r"config\.json' is not a JSON object"):
        read_config(copy)


def test_export_refuses_names_written_twice_and_runs_it_cannot_describe(
    hf_dir: Path, tmp_path: Path
) -> None:
    model = _llama_for(hf_dir)
    checkpoint = _save_checkpoint(model, tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match="writes 'same' twice"):
        export_hf(checkpoint, tmp_path / "out", config={}, rename=lambda fqn, t: [("same", t)])
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob("out.tmp-*"))
    recipe = {"model": {"factory": "torch.nn:Identity"}, "mesh": {"dp": 1}}
    params = dict(model.named_parameters())
    Checkpointer(CheckpointConfig(tmp_path / "run")).save(1, params, None, {"recipe": recipe})
    with pytest.raises(CheckpointError, match=r"is a factory .* Export it from Python"):
        export_run(tmp_path / "run", tmp_path / "out")
