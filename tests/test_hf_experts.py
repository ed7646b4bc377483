"""Per-expert checkpoints in: what ``save_pretrained`` writes for tiny transformers MoE models
(built locally: one 2-D tensor per expert and projection, Mixtral's under ``block_sparse_moe``)
loads into fused expert weights, into meshtrain's MoE (the same logits as the transformers model
that saved it) and into the transformers models themselves (every tensor equal); on ep 2 each
rank reads only the experts it holds."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from moe_models import mixtral, qwen2_moe, qwen3_moe
from safetensors import safe_open
from safetensors.torch import save_file

import meshtrain as mt
from meshtrain.errors import CheckpointError
from meshtrain.models.moe import build_moe
from meshtrain.models.moe import default_rules as moe_rules
from meshtrain.models.moe_hf import moe_config_from_hf, moe_hf_sources
from meshtrain.train.hf.load import load_hf


def _saved(factory: object, path: Path, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = factory()  # type: ignore[operator]
    model.save_pretrained(path)
    return model


def test_save_pretrained_writes_one_tensor_per_expert(tmp_path: Path) -> None:
    _saved(qwen3_moe, tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as stored:
        names = set(stored.keys())
    assert "model.layers.0.mlp.experts.7.up_proj.weight" in names
    assert not any(name.endswith("gate_up_proj") for name in names)  # what the loader assembles


def _meshtrain_qwen3(path: Path) -> torch.nn.Module:
    hf = _saved(qwen3_moe, path)
    config = moe_config_from_hf(hf.config.to_dict())
    model = build_moe(config, seed=1)  # other weights, all overwritten
    report = load_hf(path, model, sources=moe_hf_sources(config))
    assert report.tensors == len(dict(model.named_parameters()))
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), hf(tokens).logits, rtol=1e-5, atol=1e-5)
    return model


def test_a_qwen3_moe_save_pretrained_directory_loads_into_meshtrains_moe(tmp_path: Path) -> None:
    _meshtrain_qwen3(tmp_path)


@pytest.mark.parametrize("factory", [mixtral, qwen2_moe, qwen3_moe])
def test_transformers_models_load_their_own_per_expert_checkpoints(
    factory: object, tmp_path: Path
) -> None:
    saved = _saved(factory, tmp_path, seed=0)
    torch.manual_seed(1)
    fresh = factory()  # type: ignore[operator]
    load_hf(tmp_path, fresh)  # strict: every tensor of both sides used
    expected = saved.state_dict()
    for name, tensor in fresh.state_dict().items():
        assert torch.equal(tensor, expected[name]), name


def test_a_missing_or_misshaped_expert_is_named(tmp_path: Path) -> None:
    hf = qwen3_moe()
    hf.save_pretrained(tmp_path)
    file = tmp_path / "model.safetensors"
    with safe_open(str(file), "pt") as stored:
        tensors = {name: stored.get_tensor(name) for name in stored.keys()}  # noqa: SIM118
    del tensors["model.layers.1.mlp.experts.5.gate_proj.weight"]
    tensors["model.layers.0.mlp.experts.2.down_proj.weight"] = torch.zeros(32, 8)
    save_file(tensors, str(file), metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as caught:
        load_hf(tmp_path, qwen3_moe())
    message = str(caught.value)
    assert "model.layers.1.mlp.experts.5.gate_proj.weight" in message
    assert "the model lacks" not in message  # the other experts are all used
    assert "'model.layers.0.mlp.experts.2.down_proj.weight' is 32×8 in" in message


def expert_parallel_load(path: str) -> dict[str, object]:
    """On each rank of ep 2: meshtrain's MoE planned with its experts over ep, loaded from the
    per-expert checkpoint; whether its local experts are the checkpoint's experts it holds, and
    the bytes of expert tensors it read."""
    hf_config = moe_config_from_hf(qwen3_moe().config.to_dict())
    model = build_moe(hf_config, seed=1)
    plan = mt.plan(model, mt.make_mesh({"ep": 2}), moe_rules(tp=None, fsdp=(), ep="ep"))
    applied = mt.apply(plan, model)
    report = load_hf(path, applied, sources=moe_hf_sources(hf_config))
    rank = torch.distributed.get_rank()
    held = range(rank * 4, rank * 4 + 4)
    same = True
    with safe_open(str(Path(path) / "model.safetensors"), "pt") as stored:
        for layer in range(hf_config.n_layers):
            experts = applied.get_submodule(f"layers.{layer}.feed_forward.experts")
            gate_up = experts.gate_up_proj.to_local()
            down = experts.down_proj.to_local()
            prefix = f"model.layers.{layer}.mlp.experts"
            for local, expert in enumerate(held):
                parts = [
                    stored.get_tensor(f"{prefix}.{expert}.{p}_proj.weight") for p in ("gate", "up")
                ]
                same &= torch.equal(gate_up[local], torch.cat(parts))
                same &= torch.equal(
                    down[local], stored.get_tensor(f"{prefix}.{expert}.down_proj.weight")
                )
    local = {fqn: param.to_local() for fqn, param in applied.named_parameters()}
    held_bytes = {fqn: t.numel() * t.element_size() for fqn, t in local.items()}
    return {
        "same": same,
        "bytes_read": report.bytes_read,
        "held": sum(held_bytes.values()),
        "held_experts": sum(n for fqn, n in held_bytes.items() if ".experts." in fqn),
    }


@pytest.mark.spmd
def test_each_expert_parallel_rank_reads_only_its_experts(tmp_path: Path) -> None:
    from meshtrain.testing.runner import get_pool

    hf = _saved(qwen3_moe, tmp_path)
    total = sum(t.numel() * t.element_size() for t in hf.state_dict().values())
    experts = sum(
        t.numel() * t.element_size() for n, t in hf.state_dict().items() if ".experts." in n
    )
    for result in get_pool(2).run(expert_parallel_load, str(tmp_path)):
        assert result["same"], result
        # every rank reads exactly what it holds: half the experts (and its FSDP shard of the rest)
        assert result["bytes_read"] == result["held"] < total, result
        assert result["held_experts"] == experts // 2, result


def tensor_parallel_load(path: str) -> bool:
    """On each rank of tp 2: meshtrain's MoE with its experts split inside over tp, loaded from
    the per-expert checkpoint; whether each rank holds its half of every expert's gate rows and
    of its up rows (packed), and its half of the down projection's columns."""
    hf_config = moe_config_from_hf(qwen3_moe().config.to_dict())
    model = build_moe(hf_config, seed=1)
    rules = moe_rules(tp="tp", fsdp=(), expert_tp=True)
    applied = mt.apply(mt.plan(model, mt.make_mesh({"tp": 2}), rules), model)
    load_hf(path, applied, sources=moe_hf_sources(hf_config))
    rank = torch.distributed.get_rank()
    same = True
    with safe_open(str(Path(path) / "model.safetensors"), "pt") as stored:
        for layer in range(hf_config.n_layers):
            experts = applied.get_submodule(f"layers.{layer}.feed_forward.experts")
            gate_up, down = experts.gate_up_proj.to_local(), experts.down_proj.to_local()
            half = down.shape[2]
            mine = slice(rank * half, (rank + 1) * half)
            prefix = f"model.layers.{layer}.mlp.experts"
            for expert in range(hf_config.n_experts):
                gate, up, whole_down = (
                    stored.get_tensor(f"{prefix}.{expert}.{p}_proj.weight")
                    for p in ("gate", "up", "down")
                )
                same &= torch.equal(gate_up[expert], torch.cat([gate[mine], up[mine]]))
                same &= torch.equal(down[expert], whole_down[:, mine])
    return same


@pytest.mark.spmd
def test_experts_split_inside_over_tp_load_their_packed_halves(tmp_path: Path) -> None:
    from meshtrain.testing.runner import get_pool

    _saved(qwen3_moe, tmp_path)
    assert get_pool(2).run(tensor_parallel_load, str(tmp_path)) == [True, True]
