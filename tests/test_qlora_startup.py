"""QLoRA starts on the meta device: the NF4 base is quantized shard by shard (initialised or read
from a checkpoint, each rank its slices) and holds exactly the bytes of the base quantized whole
and then sharded by FSDP2, so training is bit for bit the same. Real gloo ranks, against models
built the ordinary way on the CPU. Skipped without torchao."""

from __future__ import annotations

import tempfile
from pathlib import Path

import lora_models
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

import meshtrain as mt
from meshtrain.adapters import LoRALinear, lora
from meshtrain.adapters.nf4 import is_nf4, quantize_weight
from meshtrain.lower.materialise import held, initialise
from meshtrain.models import Llama, LlamaConfig, build_llama, default_rules
from meshtrain.recipes.pretrained import load_pretrained
from meshtrain.testing.runner import get_pool

pytest.importorskip("torchao")
pytestmark = pytest.mark.spmd

NF4_PARTS = ("quantized_scalers", "quantization_factor", "quantized_data", "scaler_mean", "nf4")
FSDP = mt.Rules({r".*": mt.P()}, fsdp="dp")
CONFIG = LlamaConfig(
    dim=256, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=512, multiple_of=256, max_seq_len=64
)


def llama(device: str) -> nn.Module:
    return build_llama(CONFIG, device=device)


def hf_llama(device: str) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        max_position_embeddings=64,
    )
    with torch.device(device):
        return transformers.LlamaForCausalLM(config)


BUILDERS = {
    "llama": (llama, lora_models.LLAMA_TARGETS),
    "hf-llama": (hf_llama, lora_models.HF_TARGETS),
}


def quantized_on_cpu(name: str, seed: int) -> nn.Module:
    """The ordinary way: the full model on the CPU, initialised, adapters added, every base
    weight quantized whole."""
    build, targets = BUILDERS[name]
    model = lora(build("cpu"), rank=4, alpha=8, targets=targets)
    initialise(model, seed=seed)
    for fqn, module in model.named_modules():
        if isinstance(module, LoRALinear):
            quantize_weight(module, fqn)
    return model


def quantized_on_meta(name: str) -> nn.Module:
    build, targets = BUILDERS[name]
    return lora(build("meta"), rank=4, alpha=8, targets=targets, quantize_base="nf4")


def applied(model: nn.Module) -> tuple[mt.Plan, nn.Module]:
    """FSDP (ZeRO-3) over every rank."""
    rules = default_rules(tp=None) if isinstance(model, Llama) else FSDP
    plan = mt.plan(model, mt.make_mesh(dp=dist.get_world_size()), rules, zero=3)
    return plan, mt.apply(plan, model)


def differences(a: nn.Module, b: nn.Module) -> list[str]:
    """Names of the tensors whose local shards differ (an NF4 weight part by part)."""
    different = []
    for (fqn, p), (_, q) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        mine, theirs = held(p), held(q)
        if is_nf4(mine) != is_nf4(theirs):
            different.append(f"{fqn} (storage)")
        elif is_nf4(mine):
            different += [
                f"{fqn}.{part}"
                for part in NF4_PARTS
                if not torch.equal(getattr(mine, part), getattr(theirs, part))
            ]
        elif not torch.equal(mine, theirs):
            different.append(fqn)
    return different


def losses(plan: mt.Plan, model: nn.Module) -> list[float]:
    tokens = torch.randint(
        0, 512, (2, 33), generator=torch.Generator().manual_seed(dist.get_rank())
    )
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    values = []
    for _ in range(2):
        with mt.micro_batch(plan, model, last=True):
            out = model(tokens[:, :-1])
            logits = out if isinstance(out, torch.Tensor) else out.logits
            loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        values.append(loss.item())
    return values


def materialised_like_cpu(name: str) -> tuple[list[str], list[float], list[float], bool]:
    """On each rank: the meta start (NF4 quantized shard by shard as it is initialised) against
    the ordinary start; the shards that differ, both runs' losses, and whether bases are NF4."""
    ordinary_plan, ordinary = applied(quantized_on_cpu(name, seed=0))
    meta_plan, meta = applied(quantized_on_meta(name))
    mt.materialise(meta, seed=0)
    nf4 = any(is_nf4(held(p)) for p in meta.parameters())
    different = differences(ordinary, meta)
    return different, losses(ordinary_plan, ordinary), losses(meta_plan, meta), nf4


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_meta_start_quantizes_each_shard_as_the_whole_base(name: str) -> None:
    for different, ordinary, meta, nf4 in get_pool(2).run(materialised_like_cpu, name):
        assert nf4 and different == []
        assert meta == ordinary


def loaded_like_cpu() -> tuple[list[str], int, int]:
    """On each rank: a checkpoint (other weights than the initialiser's) read into the meta-started
    QLoRA model, slice by slice, against the full model loaded on the CPU and quantized whole."""
    directory = Path(tempfile.gettempdir()) / f"meshtrain-qlora-load-{dist.get_world_size()}"
    source = llama("cpu")
    initialise(source, seed=7)
    if dist.get_rank() == 0:
        directory.mkdir(exist_ok=True)
        save_file(
            {
                k: v.contiguous()
                for k, v in source.state_dict().items()
                if not k.endswith(("rope_cos", "rope_sin"))
            },
            str(directory / "model.safetensors"),
        )
    dist.barrier()
    ordinary = lora(llama("cpu"), rank=4, alpha=8, targets=lora_models.LLAMA_TARGETS)
    load_pretrained(directory, ordinary)
    for fqn, module in ordinary.named_modules():
        if isinstance(module, LoRALinear):
            quantize_weight(module, fqn)
    _, ordinary = applied(ordinary)
    _, meta = applied(quantized_on_meta("llama"))
    mt.materialise(meta, seed=0)
    report = load_pretrained(directory, meta)
    different = [fqn for fqn in differences(ordinary, meta) if "lora_" not in fqn]
    dist.barrier()
    return different, report.bytes_read, report.checkpoint_bytes


def test_a_checkpoint_loads_into_nf4_shards_each_rank_reading_its_slices() -> None:
    for different, read, total in get_pool(2).run(loaded_like_cpu):
        assert different == []
        assert read * 2 == total  # FSDP over 2: each rank reads half of every tensor


def test_nf4_under_replicated_data_parallelism_is_refused_at_plan_time() -> None:
    mesh = mt.make_mesh(dp=2, world_size=2, abstract=True)
    with pytest.raises(
        mt.PlanError, match=r"'layers\.0\.attention\.wq\.weight' is an NF4 .*\(zero=0\)"
    ):
        mt.plan(quantized_on_meta("llama"), mesh, default_rules(tp=None), zero=0)


def test_nf4_shards_that_split_a_scale_group_are_refused_at_plan_time() -> None:
    mesh = mt.make_mesh(dp=8, world_size=8, abstract=True)
    with pytest.raises(
        mt.PlanError, match=r"'layers\.0\.attention\.wq\.weight' \(256×256\) .* 8 ways"
    ):
        mt.plan(quantized_on_meta("llama"), mesh, default_rules(tp=None), zero=3)
