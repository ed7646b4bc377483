"""Hugging Face checkpoints in and out on real gloo ranks (FSDP × TP on 4 ranks): a sharded
transformers directory loads into meshtrain's Llama and into the transformers model itself,
each rank reading only its slices; a checkpoint of the planned model exported back gives a
directory ``from_pretrained`` loads with the original's weights bit for bit, so its logits equal
the original's exactly.

Bound for meshtrain's Llama against transformers' (same weights, different code), and for the
transformers model under tensor parallelism against itself in one process: both differ only in
the order of fp32 operations (RMSNorm's reduction, rotary on pairs vs halves, tensor-parallel
partial sums), each rounding at 2⁻²⁴ relative and compounding through the layers. We assert
1e-5 · (1 + max |logit|), about 100 ulps of the largest logit; measured: ≤ 2.2e-6 at logits up
to 3.5 (bound 4.5e-5). Loading without the rotary permutation moves the logits by 2.0.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import full, mesh_for
from torch.distributed.tensor import DTensor

import meshtrain as mt
from meshtrain.errors import CheckpointError
from meshtrain.models.llama import build_llama, default_rules
from meshtrain.models.llama_hf import hf_config_from_llama, llama_config_from_hf, llama_to_hf
from meshtrain.recipes.pretrained import load_pretrained
from meshtrain.testing.runner import get_pool
from meshtrain.train.checkpoint import CheckpointConfig, Checkpointer, latest_checkpoint
from meshtrain.train.hf.export import export_hf
from meshtrain.train.hf.files import read_config

pytestmark = pytest.mark.spmd

transformers = pytest.importorskip("transformers")
MESH = (("dp", 2), ("tp", 2))


def _hf_model(tied: bool) -> Any:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=250,
        rope_theta=5000.0,
        initializer_range=0.1,
        tie_word_embeddings=tied,
        max_position_embeddings=64,
        use_cache=False,
    )
    return transformers.LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def hf_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama saved by transformers in 5 shards (vocab 250: uneven FSDP shards)."""
    directory = tmp_path_factory.mktemp("hf") / "llama"
    _hf_model(request.param).save_pretrained(directory, max_shard_size="100KB")
    assert len(list(directory.glob("model-*-of-*.safetensors"))) > 1
    return directory


def _tokens() -> torch.Tensor:
    return torch.randint(0, 250, (2, 16), generator=torch.Generator().manual_seed(1))


def _logits(output: Any) -> torch.Tensor:
    logits = output if isinstance(output, torch.Tensor) else output.logits
    return full(logits)


class _CountingSlices:
    """Wraps ``safe_open`` to record every slice a rank reads: its shape and bytes."""

    def __init__(self, original: Any) -> None:
        self.original = original
        self.read: list[tuple[str, tuple[int, ...], int]] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        counter = self

        class Handle:
            def __init__(self, handle: Any) -> None:
                self.handle = handle

            def __enter__(self) -> Handle:
                self.handle = self.handle.__enter__()
                return self

            def __exit__(self, *exc: object) -> None:
                self.handle.__exit__(*exc)

            def get_slice(self, name: str) -> Any:
                stored = self.handle.get_slice(name)

                class Slice:
                    def get_shape(self) -> Any:
                        return stored.get_shape()

                    def __getitem__(self, key: Any) -> torch.Tensor:
                        block = stored[key]
                        counter.read.append(
                            (name, tuple(block.shape), block.numel() * block.element_size())
                        )
                        return block

                return Slice()

        return Handle(self.original(*args, **kwargs))


def load_into_planned(
    directory: str, checkpoint_dir: str, kind: str, tokens: torch.Tensor
) -> dict[str, Any]:
    """On every rank: build the model (meshtrain's Llama or the transformers model, other random
    weights), plan FSDP × TP (``llama-pp``: a 2-stage pipeline × FSDP), apply, load the directory
    through a slice counter, run the tokens, save a checkpoint."""
    import meshtrain.train.hf.load as hf_load

    axes, options = MESH, {}
    if kind.startswith("llama"):
        model = build_llama(llama_config_from_hf(read_config(directory) or {}), seed=7)
        rules = default_rules()
        if kind == "llama-pp":
            axes, rules = (("pp", 2), ("dp", 2)), default_rules(tp=None)
            options = {"pipeline": mt.Pipeline(schedule="1F1B", microbatches=2)}
    else:
        torch.manual_seed(7)
        config = transformers.AutoConfig.from_pretrained(directory)
        model = transformers.LlamaForCausalLM(config).eval()
        rules = mt.Rules.from_hf(model, fsdp="dp")
    applied = mt.apply(mt.plan(model, mesh_for(axes), rules, **options), model)
    counter = _CountingSlices(hf_load.safe_open)
    hf_load.safe_open = counter
    try:
        report = load_pretrained(directory, applied)
    finally:
        hf_load.safe_open = counter.original
    local_bytes = sum(
        (p.to_local() if isinstance(p, DTensor) else p).numel() * 4 for p in applied.parameters()
    )
    logits = None
    if kind != "llama-pp":  # a pipeline runs through its schedule; its weights are checked below
        with torch.no_grad():
            logits = _logits(applied(tokens))
    params = dict(applied.named_parameters())
    Checkpointer(CheckpointConfig(checkpoint_dir)).save(1, params, None, {"step": 1})
    return {"logits": logits, "report": report, "slices": counter.read, "local_bytes": local_bytes}


def load_with_problems(directory: str) -> str:
    """On every rank: load a directory that does not fit the model; the error's text."""
    model = build_llama(llama_config_from_hf(read_config(directory) or {}), seed=7)
    applied = mt.apply(mt.plan(model, mesh_for(MESH), default_rules()), model)
    try:
        load_pretrained(directory, applied)
    except CheckpointError as err:
        return err.message
    return "loaded"


@pytest.mark.parametrize("kind", ["llama", "llama-pp", "hf"])
def test_round_trip_through_a_planned_model_gives_the_original_logits(
    hf_dir: Path, kind: str, tmp_path: Path
) -> None:
    original = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    tokens = _tokens()
    with torch.no_grad():
        expected = original(tokens).logits
    results = get_pool(4).run(load_into_planned, str(hf_dir), str(tmp_path / "ckpt"), kind, tokens)

    bound = 1e-5 * (1 + expected.abs().max().item())
    for result in results:
        if result["logits"] is not None:
            difference = (result["logits"] - expected).abs().max().item()
            assert difference <= bound, (difference, bound)
        # each rank read exactly the bytes of its local shards, from slices, never whole files
        report = result["report"]
        assert report.bytes_read == result["local_bytes"] == sum(b for *_, b in result["slices"])
        assert report.bytes_read < report.checkpoint_bytes / 2

    checkpoint = latest_checkpoint(tmp_path / "ckpt")
    assert checkpoint is not None
    out = tmp_path / "exported"
    if kind.startswith("llama"):
        config = llama_config_from_hf(read_config(hf_dir) or {})
        export_hf(
            checkpoint,
            out,
            config=hf_config_from_llama(config),
            max_shard_size="60KB",
            rename=lambda fqn, tensor: llama_to_hf(config, fqn, tensor),
        )
    else:
        export_hf(checkpoint, out, config=read_config(hf_dir) or {}, max_shard_size="60KB")
    assert (out / "model.safetensors.index.json").is_file()
    exported = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ours, theirs = exported.state_dict(), original.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[name], theirs[name]) for name in theirs)
    with torch.no_grad():
        assert torch.equal(exported(tokens).logits, expected)


def test_a_directory_that_does_not_fit_is_refused_alike_on_every_rank(
    hf_dir: Path, tmp_path: Path
) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    for file in hf_dir.iterdir():
        (broken / file.name).write_bytes(file.read_bytes())
    index = broken / "model.safetensors.index.json"
    text = index.read_text().replace('"model.norm.weight"', '"model.final_norm.weight"')
    index.write_text(text)  # the index now names a tensor no shard holds under that name
    from safetensors.torch import load_file, save_file

    holder = next(
        f for f in broken.glob("model-*.safetensors") if "model.norm.weight" in load_file(f)
    )
    tensors = load_file(holder)
    tensors["model.final_norm.weight"] = tensors.pop("model.norm.weight")
    save_file(tensors, str(holder), metadata={"format": "pt"})
    messages = get_pool(4).run(load_with_problems, str(broken))
    assert len(set(messages)) == 1
    assert (
        "1 tensor(s) the model needs are not in the checkpoint (model.safetensors.index.json): "
        "'model.norm.weight'" in messages[0]
    )
    assert (
        "1 tensor(s) in the checkpoint that the model lacks: 'model.final_norm.weight'"
        in messages[0]
    )


def run_recipe(overrides: list[str]) -> dict[str, Any]:
    """On every rank: train the debug recipe with ``overrides``."""
    from meshtrain.recipes import load_recipe
    from meshtrain.recipes.run import train

    result = train(load_recipe("debug", overrides))
    return {"losses": result.losses, "resumed_from": result.resumed_from}


@pytest.mark.slow
def test_a_recipe_starts_from_a_transformers_directory_exports_one_and_resumes_without_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from meshtrain.cli import main
    from meshtrain.recipes import load_recipe
    from meshtrain.train.data import DistributedBatches, SyntheticTokens
    from meshtrain.train.hf.export import CheckpointTensors
    from meshtrain.train.loss import summed_cross_entropy

    torch.manual_seed(0)
    pretrained = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(  # the debug preset's shapes
            hidden_size=64,
            intermediate_size=192,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=256,
            rms_norm_eps=1e-5,
            rope_theta=10000.0,
            max_position_embeddings=64,
            initializer_range=0.1,
            use_cache=False,
        )
    ).eval()
    pretrained.save_pretrained(tmp_path / "hf", max_shard_size="100KB")
    run = tmp_path / "run"
    overrides = [
        "train.steps=2",
        "train.seq_len=16",
        "train.warmup_steps=0",
        "data.source=synthetic",
        "data.samples=64",
        f"logging.run_dir={run}",
        "logging.console=false",
        "logging.wandb=disabled",
        "checkpoint.interval=0",
        f"checkpoint.init_from={tmp_path / 'hf'}",
    ]
    first = get_pool(4).run(run_recipe, overrides)[0]

    # step 1's loss is the pretrained model's on the first global batch: every weight came from
    # the directory (the recipe's seed would give another loss)
    recipe = load_recipe("debug", overrides)
    data = SyntheticTokens(256, 16, 64, recipe.data.seed)
    loader = DistributedBatches(data, recipe.train.batch_size, 0, 1, seed=recipe.data.seed)
    batch = next(iter(loader.batches()))
    with torch.no_grad():
        logits = pretrained(batch.inputs).logits
    expected = float(summed_cross_entropy(logits, batch.targets)) / batch.targets.numel()
    assert abs(first["losses"][1] - expected) <= 1e-5 * abs(expected)

    out = tmp_path / "exported"
    command = ["export", str(run), "--format", "hf", "--out", str(out), "--max-shard-size", "100KB"]
    assert main(command) == 0
    assert capsys.readouterr().out.startswith(f"wrote {out}: 21 tensors, ")
    exported = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    trained = build_llama(llama_config_from_hf(read_config(out) or {}), seed=9)
    load_pretrained(out, trained)  # back to meshtrain's layout: equal to the checkpoint's tensors
    checkpoint = latest_checkpoint(run / "checkpoints")
    assert checkpoint is not None
    saved = CheckpointTensors(checkpoint)
    assert all(torch.equal(param, saved[fqn]) for fqn, param in trained.named_parameters())
    with torch.no_grad():
        difference = (trained(batch.inputs) - exported(batch.inputs).logits).abs().max().item()
    assert difference <= 1e-5 * (1 + logits.abs().max().item())

    # a resumed run never reads init_from: its weights are gone, and it resumes all the same
    for file in (tmp_path / "hf").glob("*.safetensors"):
        file.unlink()
    again = get_pool(4).run(run_recipe, [*overrides, "train.steps=3"])[0]
    assert again["resumed_from"] == 2 and sorted(again["losses"]) == [3]
