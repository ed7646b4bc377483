"""MoE balancing trains like one device when the batch is split over ranks: meshtrain's MoE
under data parallelism (dp 2, FSDP2) and expert parallelism (ep 2), trained through
``forward_backward`` against a plain one-process PyTorch loop on the whole batch, whose loss is
``cross_entropy + coef · Σ_layers transformers' load_balancing_loss_func`` (code meshtrain did not
write). Gradients are compared every step, before the optimizer moves anything; the loss-free
bias update and ``moe_stats`` against the same loop's counts; and the per-rank-statistics fault
(the count reducer removed, each rank's fractions its own) is caught by the same comparison."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from moe_models import token_batches
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

import meshtrain as mt
from meshtrain.lower.gather import full_tensor
from meshtrain.models.moe import MoEConfig, build_moe, moe_layers, moe_stats
from meshtrain.models.moe import default_rules as moe_rules
from meshtrain.models.moe_experts import Router
from meshtrain.testing.contract import contract_for
from meshtrain.testing.runner import get_pool
from meshtrain.train.batch import Batch
from meshtrain.train.loss import data_parallel_rank
from meshtrain.train.step import forward_backward

pytestmark = pytest.mark.spmd

COEF = 0.5  # large, so a wrong balance gradient shows against the cross-entropy's
SHAPE = dict(dim=32, n_layers=2, vocab_size=64, moe_inter=16, dense_inter=64, aux_loss_coef=COEF)
CASES: dict[str, tuple[dict[str, int], dict[str, Any], str]] = {
    "dp2": ({"dp": 2}, dict(tp=None, fsdp="dp"), "aux_loss"),
    "ep2": ({"ep": 2}, dict(tp=None, fsdp=(), ep="ep"), "aux_loss"),
    "dp2-bias": ({"dp": 2}, dict(tp=None, fsdp="dp"), "bias"),
    "dp2-accumulate": ({"dp": 2}, dict(tp=None, fsdp="dp"), "aux_loss"),
    "dp2-per-rank-statistics": ({"dp": 2}, dict(tp=None, fsdp="dp"), "aux_loss"),
}
MICRO = {"dp2-accumulate": 2}  # micro-batches per step (1 elsewhere)


def _reference_step(
    model: torch.nn.Module, micro: list[tuple[torch.Tensor, torch.Tensor]], balance: str
) -> tuple[float, dict[str, torch.Tensor]]:
    """The plain loop's step on the whole batch, accumulated over its micro-batches: each one's
    summed cross-entropy over the step's tokens plus COEF times the mean over micro-batches of
    each MoE layer's balance loss as transformers computes it from the router logits; the mean
    loss, the gradients and the step's whole-batch balance loss. It tells the model a step starts,
    as a train loop does, so the routers count the step's whole batch."""
    model.begin_step()
    logits_of: list[torch.Tensor] = []
    hooks = [
        module.register_forward_hook(
            lambda m, args, _: logits_of.append(F.linear(args[0], m.weight))
        )
        for module in model.modules()
        if isinstance(module, Router)
    ]
    tokens = sum(targets.numel() for _, targets in micro)
    experts, top_k = model.config.n_experts, model.config.top_k
    total, every = 0.0, []
    for inputs, targets in micro:
        logits_of.clear()
        logits = model(inputs)
        loss = F.cross_entropy(logits.flatten(0, -2), targets.flatten(), reduction="sum") / tokens
        aux = sum(load_balancing_loss_func((layer,), experts, top_k) for layer in logits_of)
        (loss + COEF * aux / len(micro) if balance == "aux_loss" else loss).backward()
        total += float(loss.detach())
        every.append(list(logits_of))
    for hook in hooks:
        hook.remove()
    grads = {fqn: p.grad.clone() for fqn, p in model.named_parameters() if p.grad is not None}
    # the step's whole batch: each layer's router logits of every micro-batch together
    whole = [torch.cat(layer) for layer in zip(*every)]
    aux = sum(load_balancing_loss_func((layer,), experts, top_k) for layer in whole)
    return total, {**grads, "aux": torch.as_tensor(float(aux.detach()))}


def _micro_batches(
    inputs: torch.Tensor, targets: torch.Tensor, ranks: int, micro: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One device's micro-batches of a step: micro-batch ``m`` is every rank's ``m``-th."""
    shares = [
        (x.chunk(micro), y.chunk(micro)) for x, y in zip(inputs.chunk(ranks), targets.chunk(ranks))
    ]
    return [
        (torch.cat([x[m] for x, _ in shares]), torch.cat([y[m] for _, y in shares]))
        for m in range(micro)
    ]


def balance_case(case: str, steps: int) -> dict[str, float]:
    """On every rank: one plan of ``case`` trained by meshtrain's step pieces and the plain loop
    on the whole batch in this process; the worst relative errors of the loss, the gradients
    (the routers' apart), the balance loss and biases, and the routing count mismatches."""
    axes, rule_args, balance = CASES[case]
    torch.manual_seed(0)
    model = build_moe(MoEConfig.debug(**SHAPE, balance=balance), seed=0)
    # the reference's own loop adds the balance loss: its layers must not inject it again
    reference = build_moe(MoEConfig.debug(**SHAPE, balance="bias" if balance == "bias" else "none"))
    micro = MICRO.get(case, 1)
    plan = mt.plan(model, mt.make_mesh(axes), moe_rules(**rule_args), microbatches=micro)
    applied = mt.apply(plan, model)
    if case.endswith("per-rank-statistics"):  # the fault: each rank's fractions its own
        for ffn in moe_layers(applied).values():
            ffn.set_count_reducer(None)
    optimizer = torch.optim.SGD(applied.parameters(), lr=0.5)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    index, ranks = data_parallel_rank(plan)
    worst = dict.fromkeys(("loss", "grad", "router_grad", "aux", "bias", "routing"), 0.0)
    for step in range(steps):
        inputs, targets = token_batches(step)
        rows = slice(index * inputs.shape[0] // ranks, (index + 1) * inputs.shape[0] // ranks)
        loss, _ = forward_backward(plan, applied, Batch(inputs[rows], targets[rows]))
        batches = _micro_batches(inputs, targets, ranks, micro)
        ref_loss, ref_grads = _reference_step(reference, batches, balance)
        worst["loss"] = max(worst["loss"], abs(loss - ref_loss) / ref_loss)
        for fqn, param in applied.named_parameters():
            grad, ref = full_tensor(param.grad), ref_grads[fqn]
            error = float((grad - ref).abs().max() / ref.abs().max())
            key = "router_grad" if fqn.endswith("router.weight") else "grad"
            worst[key] = max(worst[key], error)
        stats = moe_stats(applied)  # every rank: the whole batch's routing
        ref_stats = moe_stats(reference)
        for name, counts in ref_stats.items():
            if name.startswith("moe/tokens_per_expert/"):
                worst["routing"] += sum(abs(a - b) for a, b in zip(stats[name], counts))
        ref_aux = float(ref_grads["aux"])
        if balance == "aux_loss":
            worst["aux"] = max(worst["aux"], abs(stats["moe/balance_loss"] - ref_aux) / ref_aux)
        optimizer.step()
        applied.after_optimizer_step()  # what the train step calls: the biases move
        optimizer.zero_grad()
        ref_optimizer.step()
        if balance == "bias":  # the plain loop's loss-free step: its whole batch's counts
            reference.update_expert_bias(reference.expert_load())
        ref_optimizer.zero_grad()
    for ffn, ref_ffn in zip(moe_layers(applied).values(), moe_layers(reference).values()):
        if ffn.router.expert_bias is not None:
            moved = ffn.router.expert_bias - ref_ffn.router.expert_bias
            worst["bias"] = max(worst["bias"], float(moved.abs().max()))
            worst["bias_moved"] = float(ref_ffn.router.expert_bias.abs().max())
    worst["tolerance"] = contract_for(plan).tolerance
    return worst


def balance_cases(steps: int) -> dict[str, dict[str, float]]:
    return {case: balance_case(case, steps) for case in CASES}


def test_balance_trains_like_one_device_under_data_and_expert_parallelism() -> None:
    results = get_pool(2).run(balance_cases, 2)
    for rank in results:
        for case in ("dp2", "ep2", "dp2-bias", "dp2-accumulate"):
            worst = rank[case]
            bound = worst["tolerance"]
            assert worst["routing"] == 0, (case, worst)  # the same tokens, the same experts
            assert worst["grad"] <= bound and worst["router_grad"] <= bound, (case, worst)
            assert worst["loss"] <= 2 * bound and worst["aux"] <= 2 * bound, (case, worst)
        bias = rank["dp2-bias"]
        assert bias["bias"] == 0 and bias["bias_moved"] > 0, bias  # moved, and exactly alike
        planted = rank["dp2-per-rank-statistics"]
        assert planted["router_grad"] > 100 * planted["tolerance"], planted  # the fault shows
