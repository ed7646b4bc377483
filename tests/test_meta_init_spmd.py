"""The meta-device path for large models: build on meta, plan, apply, materialise, initialise —
the same weights, bit for bit, as a model built and initialised on one CPU."""

from __future__ import annotations

import pytest
import torch
from helpers import full, mesh_for
from torch.distributed.tensor import DTensor

import meshtrain as mt
from meshtrain.models import LlamaConfig, build_llama, default_rules
from meshtrain.testing.runner import get_pool

pytestmark = pytest.mark.spmd


def meta_init_matches(axes: tuple[tuple[str, int], ...], zero: int, sp: bool) -> list[str]:
    """Runs on every rank; returns the FQNs whose weights differ from the CPU-built model."""
    mesh = mesh_for(axes)
    config = LlamaConfig.debug()
    reference = build_llama(config, seed=0)
    model = build_llama(config, device="meta")
    data = tuple(name for name, _ in axes if name in ("rep", "dp"))
    plan = mt.plan(model, mesh, default_rules(fsdp=data, sequence_parallel=sp), zero=zero)
    mt.apply(plan, model)
    model.to_empty(device="cpu")
    model.init_weights(torch.Generator().manual_seed(0))
    assert all(isinstance(p, DTensor) for p in model.parameters())
    ref = dict(reference.named_parameters())
    differ = [
        fqn
        for fqn, param in model.named_parameters()
        if not torch.equal(param.full_tensor(), ref[fqn].detach())
    ]
    tokens = torch.randint(0, config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(3))
    with mt.loss_parallel(plan):
        logits = model(tokens)
        logits = full(logits)
    if not torch.allclose(logits, reference(tokens), rtol=1e-5, atol=1e-6):
        differ.append("<logits>")
    for name in ("rope_cos", "rope_sin"):
        if not torch.equal(getattr(model, name), getattr(reference, name)):
            differ.append(name)
    return differ


@pytest.mark.parametrize(
    ("axes", "zero", "sp"),
    [
        ((("dp", 2), ("tp", 1)), 3, False),
        ((("dp", 2), ("tp", 2)), 3, True),
        ((("dp", 2), ("tp", 2)), 0, False),
    ],
    ids=["fsdp", "fsdp-tp-sp", "ddp-tp"],
)
def test_meta_build_then_init_equals_a_cpu_build(
    axes: tuple[tuple[str, int], ...], zero: int, sp: bool
) -> None:
    world = 1
    for _, size in axes:
        world *= size
    for differ in get_pool(world).run(meta_init_matches, axes, zero, sp):
        assert differ == []


def pipelined_meta_init_matches(axes: tuple[tuple[str, int], ...]) -> list[str]:
    """Each pipeline stage built on meta and initialised after apply equals the CPU build's
    slice of the model (stage modules keep the full model's FQNs and per-FQN seeds)."""
    mesh = mesh_for(axes)
    config = LlamaConfig.preset("debug", n_layers=4)
    reference = build_llama(config, seed=0)
    model = build_llama(config, device="meta")
    rules = default_rules(fsdp=("dp",), sequence_parallel=True)
    plan = mt.plan(model, mesh, rules, zero=2, pipeline=mt.Pipeline(microbatches=2))
    pipelined = mt.apply(plan, model)
    ref = dict(reference.named_parameters())
    differ = []
    for stage in pipelined.modules:
        stage.to_empty(device="cpu")
        stage.init_weights(torch.Generator().manual_seed(0))
        differ += [
            fqn
            for fqn, param in stage.named_parameters()
            if not torch.equal(param.full_tensor(), ref[fqn].detach())
        ]
    return differ


def test_meta_build_of_pipeline_stages_equals_a_cpu_build() -> None:
    for differ in get_pool(8).run(pipelined_meta_init_matches, (("pp", 2), ("dp", 2), ("tp", 2))):
        assert differ == []
