"""torch 2.13 limitations the compile-scope choice works around — one regression test each.

Each test forces the refused combination past the planner (the plan is built without compile,
then given the scope the planner refuses) and asserts torch still fails the way
``meshtrain/plan/policies.py`` says. When a torch upgrade fixes one, its test fails: lift the
restriction in ``resolve_compile_scope`` and turn the case into an equivalence test.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers import full, mesh_for, rel

import meshtrain as mt
from meshtrain import Rules
from meshtrain.models import LlamaConfig, build_llama, default_rules
from meshtrain.testing.runner import SPMDTaskError, get_pool
from meshtrain.train import Batch, forward_backward

# The extended tier: each guards a refusal the planner makes; CI runs them with tests_extended.
pytestmark = [pytest.mark.spmd, pytest.mark.extended]


def _forced(
    axes: tuple[tuple[str, int], ...],
    scope: str,
    *,
    fullgraph: bool = False,
    checkpointing: str = "none",
) -> dict[str, float]:
    """Train one step with compile forced to ``scope``; return the worst gradient error."""
    model = build_llama(LlamaConfig.preset("debug", n_layers=2), seed=0)
    reference = build_llama(LlamaConfig.preset("debug", n_layers=2), seed=0)
    plan = mt.plan(
        model,
        mesh_for(axes),
        Rules(logical=default_rules().logical, fsdp="dp"),
        activation_checkpointing=checkpointing,
        grad_reduction="sum",  # every data-parallel rank runs the same batch: the sum is dp×
    )
    options = dataclasses.replace(
        plan.options, compile=True, compile_backend="aot_eager", compile_fullgraph=fullgraph
    )
    plan = dataclasses.replace(plan, options=options, compile_scope=scope)
    mt.apply(plan, model)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with mt.loss_parallel(plan):
        F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
    # every data-parallel rank runs the same batch and FSDP sums their gradients
    dp = plan.mesh.size("dp")
    (dp * F.cross_entropy(reference(tokens).flatten(0, 1), tokens.flatten())).backward()
    ref_grads = dict(reference.named_parameters())
    return {
        fqn: rel(full(p.grad), ref_grads[fqn].grad)  # type: ignore[arg-type]
        for fqn, p in model.named_parameters()
    }


def _run(axes: tuple[tuple[str, int], ...], scope: str, **kwargs: Any) -> list[dict[str, float]]:
    world = 1
    for _, size in axes:
        world *= size
    return get_pool(world).run(_forced, axes, scope, **kwargs, _timeout_s=300.0)


def test_block_compile_under_tensor_parallel_fails_in_backward() -> None:
    with pytest.raises(SPMDTaskError, match="_local_tensor"):
        _run((("dp", 1), ("tp", 2)), "block")


def test_block_compile_under_fsdp_and_tensor_parallel_gives_a_wrong_embedding_gradient() -> None:
    # every other gradient agrees with one device; the vocab-parallel embedding's does not
    [errors, *_] = _run((("dp", 2), ("tp", 2)), "block")
    assert errors["tok_embeddings.weight"] > 0.5, errors
    assert max(e for f, e in errors.items() if f != "tok_embeddings.weight") < 1e-5, errors


def test_model_compile_under_fsdp_and_tensor_parallel_fails() -> None:
    with pytest.raises(SPMDTaskError, match="Mixing fake modes"):
        _run((("dp", 2), ("tp", 2)), "model")


def test_model_fullgraph_compile_under_fsdp_fails() -> None:
    with pytest.raises(SPMDTaskError, match="marked as skipped"):
        _run((("dp", 2), ("tp", 1)), "model", fullgraph=True)


def test_model_compile_under_tensor_parallel_with_full_checkpointing_fails() -> None:
    with pytest.raises(SPMDTaskError, match="tensors_saved_with_vc_check"):
        _run((("dp", 1), ("tp", 2)), "model", checkpointing="full")


def _forced_split_backward(axes: tuple[tuple[str, int], ...]) -> None:
    """One step of a zero-bubble pipeline whose stages are compiled past the planner."""
    model = build_llama(LlamaConfig.preset("debug", n_layers=4), seed=0)
    pipeline = mt.Pipeline(schedule="ZBVZeroBubble", microbatches=2, stages_per_rank=2)
    plan = mt.plan(
        model,
        mesh_for(axes),
        Rules(logical=default_rules().logical, fsdp="dp"),
        zero=2,
        pipeline=pipeline,
    )
    options = dataclasses.replace(plan.options, compile=True, compile_backend="aot_eager")
    plan = dataclasses.replace(plan, options=options, compile_scope="model")
    tokens = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(0))
    forward_backward(plan, mt.apply(plan, model), Batch(tokens, tokens))


@pytest.mark.parametrize(
    ("axes", "failure"),
    [
        ((("pp", 2), ("dp", 2), ("tp", 1)), "donated buffers"),
        ((("pp", 2), ("dp", 1), ("tp", 2)), "donated buffers"),
    ],
    ids=["fsdp", "tp"],
)
def test_compiled_split_backward_pipeline_fails(
    axes: tuple[tuple[str, int], ...], failure: str
) -> None:
    with pytest.raises(SPMDTaskError, match=failure):
        get_pool(4).run(_forced_split_backward, axes, _timeout_s=300.0)
