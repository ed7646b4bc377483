"""meshtrain's MoE routers hold the whole batch's token counts when the batch is split over ranks.

Under data and expert parallelism each rank routes its own rows; the routers' count buffers
(``tokens_per_expert``, ``pending_tokens``) are summed over the token ranks by the count reducer
lowering installs, once per forward (not again when activation checkpointing recomputes it), so
they equal one device's exactly (integer counts). Checked two ways on dp 2 × ep 2: against a
plain one-process PyTorch loop on the whole batch (its routing read off the routers' outputs, its
balance loss transformers' ``load_balancing_loss_func``, code meshtrain did not write), and by
``assert_equivalent``, which compares every buffer after every step.

Contract: counts bitwise; the reported balance loss (``router_metrics``, any ``balance``) within
fp32 summation's bound ``T · 2⁻²⁴`` relative (``T`` the tokens of the batch: the probabilities are
summed over them in a different order than transformers' mean).
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from moe_models import token_batches
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

import meshtrain as mt
from meshtrain.models.moe import MoEConfig, build_moe, moe_layers
from meshtrain.models.moe import default_rules as moe_rules
from meshtrain.models.moe_experts import Router
from meshtrain.recipes.router_stats import router_metrics
from meshtrain.testing import assert_equivalent
from meshtrain.testing.runner import get_pool
from meshtrain.train.batch import Batch
from meshtrain.train.loss import data_parallel_rank
from meshtrain.train.step import forward_backward

pytestmark = pytest.mark.spmd

SHAPE = dict(dim=32, n_layers=2, vocab_size=64, moe_inter=16, dense_inter=64)
MOE_LAYERS = 1  # the first of the 2 layers is dense
MESH = {"dp": 2, "ep": 2}
RULES = moe_rules(tp=None, fsdp="dp", ep="ep")


def _routing(model: torch.nn.Module, inputs: torch.Tensor) -> tuple[list[Any], list[Any]]:
    """The plain model's forward on the whole batch: each router's logits and chosen experts."""
    logits, chosen = [], []

    def hook(module: torch.nn.Module, args: Any, out: Any) -> None:
        logits.append(F.linear(args[0], module.weight).detach())
        chosen.append(out[0].detach())

    hooks = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, Router)]
    with torch.no_grad():
        model(inputs)
    for handle in hooks:
        handle.remove()
    return logits, chosen


def counts_case(balance: str, steps: int = 2) -> dict[str, float]:
    """On every rank: meshtrain's MoE on dp 2 × ep 2 (full activation checkpointing) beside the
    plain model on the whole batch; the count mismatches and the balance loss's relative error."""
    config = MoEConfig.debug(**SHAPE, balance=balance)
    model, reference = build_moe(config, seed=0), build_moe(config, seed=0)
    plan = mt.plan(model, mt.make_mesh(MESH), RULES, activation_checkpointing="full")
    applied = mt.apply(plan, model)
    metrics = router_metrics(applied)
    assert metrics is not None
    index, ranks = data_parallel_rank(plan)
    worst = {"counts": 0.0, "pending": 0.0, "loss": 0.0}
    pending = [torch.zeros(config.n_experts, dtype=torch.long) for _ in moe_layers(reference)]
    for step in range(steps):
        inputs, targets = token_batches(step)
        inputs, targets = inputs % config.vocab_size, targets % config.vocab_size
        rows = slice(index * inputs.shape[0] // ranks, (index + 1) * inputs.shape[0] // ranks)
        forward_backward(plan, applied, Batch(inputs[rows], targets[rows]))
        logits, chosen = _routing(reference, inputs)
        layers = list(moe_layers(applied).values())
        for ffn, experts, total in zip(layers, chosen, pending):
            counts = torch.bincount(experts.flatten(), minlength=config.n_experts)
            total += counts
            worst["counts"] += float((ffn.router.tokens_per_expert - counts).abs().sum())
            worst["pending"] += float((ffn.router.pending_tokens - total).abs().sum())
        expected = sum(
            float(load_balancing_loss_func((layer,), config.n_experts, config.top_k))
            for layer in logits
        )
        reported = metrics()["moe/balance_loss"]
        worst["loss"] = max(worst["loss"], abs(reported - expected) / expected)
    worst["bound"] = inputs.numel() * 2.0**-24
    return worst


def counts_cases() -> dict[str, dict[str, float]]:
    """Two steps with the balance loss training (its counts reused from the router's), one
    without it under the other balance modes (the reported loss is the same whole-batch one)."""
    return {
        "aux_loss": counts_case("aux_loss", 2),
        "bias": counts_case("bias", 1),
        "none": counts_case("none", 1),
    }


def test_router_counts_and_balance_loss_are_the_whole_batch_s_on_dp2_ep2() -> None:
    for rank in get_pool(4).run(counts_cases):
        for balance, worst in rank.items():
            assert worst["counts"] == 0 and worst["pending"] == 0, (balance, worst)
            assert worst["loss"] <= worst["bound"], (balance, worst)


def _buffer_comparisons(report: Any, name: str) -> list[Any]:
    return [c for c in report.comparisons if c.quantity == "buffer" and c.fqn.endswith(name)]


def _assert_counts_compared(report: Any, steps: int) -> None:
    """The report compared both count buffers of both MoE layers at every step, bitwise."""
    for name in ("router.tokens_per_expert", "router.pending_tokens"):
        found = _buffer_comparisons(report, name)
        assert len(found) == MOE_LAYERS * steps, (name, found)
        assert all(c.abs_error == 0 and c.ratio == 0 for c in found), found


def test_meshtrain_moe_trains_like_one_device_on_dp2_ep2() -> None:
    """FSDP2 over dp × ep for the dense weights, experts over ep, full activation checkpointing
    (the recomputed forward neither counts nor reduces again): every buffer equals one device's."""
    config = MoEConfig.debug(**SHAPE, balance="aux_loss")
    report = assert_equivalent(
        functools.partial(build_moe, config, seed=0),
        MESH,
        {"rules": RULES, "activation_checkpointing": "full"},
        steps=2,
        optimizer="adamw",
    )
    assert report.passed
    _assert_counts_compared(report, steps=2)


@pytest.mark.extended
def test_meshtrain_moe_with_bias_balancing_trains_like_one_device_on_ep2() -> None:
    """Loss-free balancing on ep 2: the biases move after each optimizer step from the whole
    batch's counts, on the plan's ranks and on one device alike (compared as buffers)."""
    config = MoEConfig.debug(**SHAPE, balance="bias", bias_update_rate=0.01)
    report = assert_equivalent(
        functools.partial(build_moe, config, seed=0),
        {"ep": 2},
        {"rules": moe_rules(tp=None, fsdp=(), ep="ep")},
        steps=3,
        optimizer="adamw",
    )
    assert report.passed
    _assert_counts_compared(report, steps=3)
    biases = _buffer_comparisons(report, "router.expert_bias")
    assert len(biases) == MOE_LAYERS * 3 and all(c.abs_error == 0 for c in biases), biases
