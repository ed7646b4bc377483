"""QLoRA on a GPU: torchao's NF4 base under LoRA adapters on CUDA, alone and planned and applied
on one NCCL rank (several data-parallel ranks need several GPUs: NCCL refuses two ranks on one).
Skipped without CUDA or torchao; ``python tests/test_qlora_cuda.py`` runs the same checks on
the CPU (gloo) where no GPU is at hand."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import meshtrain as mt
from meshtrain.adapters import lora
from meshtrain.adapters.nf4 import is_nf4, quantize_weight
from meshtrain.models import LlamaConfig, build_llama, default_rules

pytest.importorskip("torchao")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
BF16_U = 2.0**-8  # bf16's unit roundoff (8 significant bits)
TARGETS = [r"layers\.\d+\.attention\.w[qkvo]", r"layers\.\d+\.feed_forward\.w[123]"]


def check_nf4_linear(device: torch.device) -> None:
    """Forward = the dequantized weight's product within bf16 rounding; the adapters' gradients
    = an fp32 reference on the dequantized weight within the same rounding."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 256, bias=False)).to(device)
    model = lora(model, rank=8, alpha=16, targets=["0"], quantize_base="nf4")
    layer = model[0]
    assert is_nf4(layer.weight) and layer.weight.device.type == device.type
    with torch.no_grad():
        layer.lora_B.normal_()  # a non-zero update, so both paths are checked
    x = torch.randn(16, 512, device=device)
    out = layer(x)
    dense = layer.weight.get_original_weight().float()
    A, B = (
        layer.lora_A.detach().clone().requires_grad_(True),
        layer.lora_B.detach().clone().requires_grad_(True),
    )
    reference = x @ dense.T + layer.scale * (x @ A.T) @ B.T
    bound = 3 * BF16_U * (x.abs() @ dense.abs().T) + 1e-5 * reference.abs() + 1e-6
    assert ((out.float() - reference).abs() <= bound).all()
    grad = torch.randn_like(reference)
    out.backward(grad)
    reference.backward(grad)
    for mine, theirs in ((layer.lora_A.grad, A.grad), (layer.lora_B.grad, B.grad)):
        assert mine is not None and theirs is not None
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-5)
    assert layer.weight.grad is None


def qlora_llama(device: torch.device) -> nn.Module:
    config = LlamaConfig(
        dim=256, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=512, multiple_of=64, max_seq_len=64
    )
    model = build_llama(config, seed=0).to(device)
    return lora(
        model,
        rank=8,
        alpha=16,
        targets=TARGETS,
        quantize_base="nf4",
        generator=torch.Generator().manual_seed(1),
    )


def train(model: nn.Module, plan: mt.Plan | None, tokens: torch.Tensor, steps: int) -> list[float]:
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    losses = []
    for _ in range(steps):
        if plan is None:
            logits = model(tokens[:, :-1])
        else:
            with mt.micro_batch(plan, model, last=True):
                logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses


def check_fsdp_qlora(device: torch.device) -> None:
    """Three AdamW steps of a QLoRA Llama planned (ZeRO-3 rules) and applied on one rank against
    the same model trained with no plan at all: the first loss equal, the rest within the
    rounding of the steps."""
    mt.init_distributed()
    tokens = torch.randint(0, 512, (4, 65), generator=torch.Generator().manual_seed(2))
    tokens = tokens.to(device)
    reference = train(qlora_llama(device), None, tokens, 3)
    model = qlora_llama(device)
    mesh = mt.make_mesh(dp=1, device_type=device.type)
    plan = mt.plan(model, mesh, default_rules(tp=None), zero=3)
    mt.apply(plan, model)
    weights = [p for n, p in model.named_parameters() if n.endswith("wq.weight")]
    assert weights and all(is_nf4(getattr(p, "_local_tensor", p)) for p in weights)
    losses = train(model, plan, tokens, 3)
    assert losses[0] == pytest.approx(reference[0], rel=1e-5)
    for mine, theirs in zip(losses, reference, strict=True):
        assert mine == pytest.approx(theirs, rel=1e-3)
    assert losses[-1] < losses[0]


def check_meta_start(device: torch.device) -> None:
    """A QLoRA Llama built on the meta device and materialised on ``device`` (each NF4 weight
    quantized there as it is initialised) holds the same NF4 bytes as the model built on the CPU,
    moved to ``device`` and quantized there, and trains the same."""
    from meshtrain.lower.materialise import initialise

    mt.init_distributed()
    mesh = mt.make_mesh(dp=1, device_type=device.type)
    config = LlamaConfig(
        dim=256,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        vocab_size=512,
        multiple_of=256,
        max_seq_len=64,
    )
    ordinary = lora(build_llama(config), rank=8, alpha=16, targets=TARGETS)
    initialise(ordinary, seed=0)
    ordinary = ordinary.to(device)
    for fqn, module in ordinary.named_modules():
        if hasattr(module, "lora_A"):
            quantize_weight(module, fqn)
    meta = lora(
        build_llama(config, device="meta"), rank=8, alpha=16, targets=TARGETS, quantize_base="nf4"
    )
    plans = []
    for model in (ordinary, meta):
        plan = mt.plan(model, mesh, default_rules(tp=None), zero=3)
        mt.apply(plan, model)
        plans.append(plan)
    mt.materialise(meta, device=device, seed=0)
    for (fqn, a), (_, b) in zip(ordinary.named_parameters(), meta.named_parameters(), strict=True):
        a, b = getattr(a, "_local_tensor", a), getattr(b, "_local_tensor", b)
        assert a.device.type == b.device.type == device.type, fqn
        if is_nf4(a):
            assert is_nf4(b), fqn
            for part in (
                "quantized_scalers",
                "quantization_factor",
                "quantized_data",
                "scaler_mean",
            ):
                assert torch.equal(getattr(a, part), getattr(b, part)), (fqn, part)
        else:
            assert torch.equal(a, b), fqn
    tokens = torch.randint(0, 512, (4, 65), generator=torch.Generator().manual_seed(2)).to(device)
    assert train(ordinary, plans[0], tokens, 2) == train(meta, plans[1], tokens, 2)


@needs_cuda
def test_nf4_lora_linear_on_cuda() -> None:
    check_nf4_linear(torch.device("cuda"))


@needs_cuda
def test_planned_qlora_on_one_gpu() -> None:
    check_fsdp_qlora(torch.device("cuda"))


@needs_cuda
def test_qlora_starts_on_the_meta_device_on_a_gpu() -> None:
    check_meta_start(torch.device("cuda"))


if __name__ == "__main__":  # the same checks on whatever device there is
    where = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    check_nf4_linear(where)
    check_fsdp_qlora(where)
    check_meta_start(where)
    print(f"QLoRA checks passed on {where}", file=sys.stderr)
