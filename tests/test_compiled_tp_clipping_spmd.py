"""A plan that compiles under tensor parallelism keeps the parameters its rules leave whole
plain (tier 2, extended: two gloo ranks, ``aot_eager``).

torch 2.13's limit, shown by forcing it: with those parameters made DTensors replicated over tp
(:mod:`meshtrain.lower.tensor.replicated`, the swap every eager plan gets), compiling the model fails on
the vocab-parallel embedding's cached mask with "Mixing fake modes". So such a plan says in its
notes that PyTorch's clipping does not apply, and ``torch.nn.utils.clip_grad_norm_`` /
``get_total_norm`` raise meshtrain's ``TrainingError`` naming a plain parameter and
``meshtrain.train.clip_grad_norm_``, which clips that plan like one device. When a torch upgrade
lifts the limit, the forced test fails: replicate under compile too and drop the note.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
import torch.nn.functional as F
from helpers import full

import meshtrain as mt
from meshtrain.lower.compute import compile_model
from meshtrain.models import LlamaConfig, build_llama, default_rules
from meshtrain.testing.runner import SPMDTaskError, get_pool

pytestmark = [pytest.mark.spmd, pytest.mark.extended]

COMPILE = {"backend": "aot_eager"}
MAX_NORM = 0.05


def _model() -> torch.nn.Module:
    return build_llama(LlamaConfig.preset("debug", n_layers=1), seed=0)


def _backward(plan: mt.Plan, model: torch.nn.Module) -> None:
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with mt.loss_parallel(plan):
        F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()


def clip_on_a_compiled_plan() -> dict[str, object]:
    """PyTorch's clipping on a compiled tp 2 plan (the error it raises), then meshtrain's
    against one process's ``clip_grad_norm_`` on the same batch."""
    model, reference = _model(), _model()
    plan = mt.plan(model, mt.make_mesh(dp=1, tp=2), default_rules(), compile=COMPILE)
    applied = mt.apply(plan, model)
    _backward(plan, applied)
    with pytest.raises(mt.TrainingError) as torch_clip:
        torch.nn.utils.clip_grad_norm_(applied.parameters(), MAX_NORM)
    grads = [p.grad for p in applied.parameters()]
    with pytest.raises(mt.TrainingError) as total_norm:
        torch.nn.utils.get_total_norm(grads)
    norm = float(mt.train.clip_grad_norm_(list(applied.parameters()), MAX_NORM))
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    F.cross_entropy(reference(tokens).flatten(0, 1), tokens.flatten()).backward()
    ref_norm = float(torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM))
    ref_grads = dict(reference.named_parameters())
    worst = max(
        float((full(p.grad) - ref_grads[fqn].grad).abs().max() / ref_grads[fqn].grad.abs().max())
        for fqn, p in applied.named_parameters()
    )
    return {
        "torch": str(torch_clip.value),
        "total": str(total_norm.value),
        "norm": norm,
        "ref_norm": ref_norm,
        "worst": worst,
        "notes": plan.notes,
    }


def test_torch_clipping_on_a_compiled_tp_plan_names_the_fix() -> None:
    for result in get_pool(2).run(clip_on_a_compiled_plan, _timeout_s=300):
        assert any("clip_grad_norm_" in note for note in result["notes"]), result["notes"]
        for message in (result["torch"], result["total"]):
            assert "meshtrain.train.clip_grad_norm_" in message, message
            assert re.search(r"e\.g\. '[\w.]+'", message), message  # names a plain parameter
        # meshtrain's clipping: the one-process norm and clipped gradients, to summation order
        assert abs(result["norm"] - result["ref_norm"]) <= 1e-5 * result["ref_norm"], result
        assert result["worst"] <= 1e-5, result


def replicated_then_compiled() -> None:
    """The eager plan's replicated parameters (the swap), then the model compiled as the
    compiling plan would: torch 2.13 fails in the vocab-parallel embedding."""
    model = _model()
    plan = mt.plan(model, mt.make_mesh(dp=1, tp=2), default_rules())
    applied = mt.apply(plan, model)  # whole parameters replicated over tp, swapped per forward
    compiled = mt.plan(_model(), mt.make_mesh(dp=1, tp=2), default_rules(), compile=COMPILE)
    assert compiled.compile_scope == "model", compiled.compile_scope
    compile_model(
        dataclasses.replace(plan, options=compiled.options, compile_scope="model"), applied
    )
    _backward(plan, applied)


def test_replicated_parameters_under_compile_mix_fake_modes() -> None:
    with pytest.raises(SPMDTaskError, match="Mixing fake modes"):
        get_pool(2).run(replicated_then_compiled, _timeout_s=300)
