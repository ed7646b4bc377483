"""QLoRA's NF4 base in one process on CPU (torchao): the adapted forward and backward, the
planner's byte count, merging a dequantized base, and the refusals. Skipped without torchao."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import meshtrain as mt
from meshtrain.adapters import lora, merge_lora, nf4_bytes
from meshtrain.adapters.nf4 import is_nf4

pytest.importorskip("torchao")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 128, bias=False), nn.Linear(128, 256, bias=False))


def test_nf4_base_trains_adapters_on_cpu() -> None:
    model = lora(_model(), rank=4, alpha=8, targets=["0", "1"], quantize_base="nf4")
    assert is_nf4(model[0].weight) and not model[0].weight.requires_grad
    assert model[0].lora_A.dtype == torch.float32
    x = torch.randn(3, 256, requires_grad=True)
    model(x).square().sum().backward()
    assert model[0].lora_A.grad is not None and model[1].lora_B.grad is not None
    assert x.grad is not None and model[0].weight.grad is None


def test_nf4_forward_is_the_dequantized_weights_forward() -> None:
    model = lora(_model(), rank=4, alpha=8, targets=["0"], quantize_base="nf4")
    x = torch.randn(3, 256)
    dense = model[0].weight.get_original_weight().float()
    # The NF4 linear multiplies in bf16: x rounded to bf16 (unit roundoff u = 2^-8, 8 significant
    # bits), products summed, the result rounded once more: |error| ≤ 3u · Σ|x_i·w_i| per output
    # element (lora_B is zero).
    bound = 3 * 2.0**-8 * (x.abs() @ dense.abs().T)
    assert ((model[0](x).float() - x @ dense.T).abs() <= bound).all()
    merged = merge_lora(dict(model.state_dict()), alpha=8)
    assert merged["0.weight"].dtype == torch.bfloat16 and torch.equal(
        merged["0.weight"].float(), dense
    )


def test_plan_counts_nf4_storage() -> None:
    model = lora(_model(), rank=4, alpha=8, targets=["0"], quantize_base="nf4")
    plan = mt.plan(model, mt.make_mesh(dp=1, world_size=1, abstract=True), mt.Rules({".*": mt.P()}))
    layout = {p.fqn: p for p in plan.params}["0.weight"]
    assert layout.storage == "nf4" and layout.bytes_at_rest == nf4_bytes(128 * 256)
    assert plan.memory.params == nf4_bytes(128 * 256) + 128 * 256 * 4 + 2 * 4 * (256 + 128) * 4 // 2


def test_weights_smaller_than_an_nf4_block_group_are_refused() -> None:
    with pytest.raises(
        mt.PlanError,
        match=r"cannot store '0\.weight' \(shape \(8, 8\)\) as NF4: .* multiple of 16384",
    ):
        lora(nn.Sequential(nn.Linear(8, 8)), rank=2, alpha=2, targets=["0"], quantize_base="nf4")


def test_a_size_one_tensor_parallel_axis_is_allowed_under_nf4() -> None:
    from meshtrain.models import LlamaConfig, build_llama, default_rules

    model = lora(
        build_llama(
            LlamaConfig(
                dim=256, n_layers=1, n_heads=4, n_kv_heads=4, vocab_size=256, multiple_of=32
            ),
            device="meta",
        ),
        rank=4,
        alpha=8,
        targets=[r"layers\.0\.attention\.wq"],
        quantize_base="nf4",
    )
    plan = mt.plan(model, mt.make_mesh(dp=2, tp=1, world_size=2, abstract=True), default_rules())
    layout = {p.fqn: p for p in plan.params}["layers.0.attention.wq.weight"]
    assert layout.storage == "nf4" and layout.bytes_at_rest == nf4_bytes(128 * 256)
