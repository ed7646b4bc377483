"""Every data/tensor-parallel plan trains like one device (tier 2: real gloo ranks).

Contract (fp32, reduction order only), relative to each tensor's largest magnitude: loss per
step, the global gradient norm and SGD parameters within 1e-6; clipped gradients, momentum and
Adam's first moment within 2e-6 (clipping multiplies by max_norm/‖g‖, adding the norm's 1e-6);
Adam's second moment within 4e-6 (it is quadratic in the gradient). With
AdamW, loss, gradients and both moment estimates are held to the same bound at every step, and
each step's parameter update to 2·lr (the reference then continues from the plan's parameters):
Adam's per-element update is at most ~lr in size, and a reduction-order difference in a
near-zero gradient can flip its sign — an lr-sized difference, never more.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import (
    GroupedLM,
    TiedMLP,
    attention_rowwise_only_rules,
    full,
    grouped_rules,
    mesh_for,
    mlp_rules,
    rel,
    world_size,
    worst_grad_error,
)
from torch import nn

import meshtrain as mt
from meshtrain import P, Rules
from meshtrain.lower import device_mesh
from meshtrain.models import LlamaConfig, build_llama, default_rules
from meshtrain.testing.runner import get_pool
from meshtrain.train import clip_grad_norm_, global_token_count

pytestmark = pytest.mark.spmd

LR = 1e-3
STEPS = 3
TIGHT = 1e-6
MAX_NORM = 0.5  # below every step's gradient norm here, so clipping is exercised (asserted)


@dataclass(frozen=True)
class Case:
    axes: tuple[tuple[str, int], ...]
    rules: str
    zero: int = 3
    optimizer: str = "sgd"
    microbatches: int = 2
    offload: bool = False
    model: str = "llama"

    @property
    def world(self) -> int:
        return world_size(self.axes)


def _build(case: Case) -> tuple[nn.Module, Rules, int]:
    if case.model == "mlp":
        torch.manual_seed(0)
        return TiedMLP(), mlp_rules(("dp",) if "dp" in dict(case.axes) else ()), 32
    if case.model == "grouped":
        torch.manual_seed(0)
        data = ("dp",) if "dp" in dict(case.axes) else ()
        return GroupedLM(), grouped_rules(data, sequence_parallel=case.rules == "tp-sp"), 256
    model = build_llama(LlamaConfig.debug(), seed=0)
    data = tuple(name for name, _ in case.axes if name in ("rep", "dp"))
    if case.rules == "tp":
        return model, Rules(logical=default_rules().logical, fsdp=data), 256
    if case.rules == "tp-sp":
        return model, Rules(logical=default_rules(sequence_parallel=True).logical, fsdp=data), 256
    if case.rules == "replicated":
        return model, Rules({r".*": P()}, fsdp=data), 256
    if case.rules == "rowwise-only-attention":
        return model, attention_rowwise_only_rules(data), 256
    raise ValueError(case.rules)


def _optimizer(case: Case, params: object) -> torch.optim.Optimizer:
    if case.optimizer == "sgd":
        return torch.optim.SGD(params, lr=LR * 100, momentum=0.9)  # type: ignore[arg-type]
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.1)  # type: ignore[arg-type]


def train_both(case: Case) -> dict[str, float]:
    """Runs on every rank: the plan and a one-device reference, same weights, data and optimizer."""
    mesh = mesh_for(case.axes)
    model, rules, vocab = _build(case)
    reference = copy.deepcopy(model)
    plan = mt.plan(
        model,
        mesh,
        rules,
        zero=case.zero,
        microbatches=case.microbatches,
        offload=case.offload,
        optimizer="sgd" if case.optimizer == "sgd" else "adamw",
        grad_reduction="sum",  # the loop divides the summed loss by the global token count
    )
    mt.apply(plan, model)
    optimizer, ref_optimizer = (
        _optimizer(case, model.parameters()),
        _optimizer(case, reference.parameters()),
    )
    coords = mesh.coordinates(dist.get_rank())
    dp_ranks, dp_index = 1, 0
    for axis in plan.data_axes:
        dp_index = dp_index * mesh.size(axis) + coords[axis]
        dp_ranks *= mesh.size(axis)
    worst = {"loss": 0.0, "norm": 0.0, "grads": 0.0, "params": 0.0, "states": 0.0, "clipped": 0.0}
    generator = torch.Generator().manual_seed(1234)
    per_rank = case.microbatches * 2
    for _ in range(STEPS):
        tokens = torch.randint(0, vocab, (dp_ranks * per_rank, 17), generator=generator)
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        # Reference: the whole global batch at once, mean over every token.
        ref_loss = F.cross_entropy(reference(inputs).flatten(0, 1), targets.flatten())
        ref_loss.backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm=MAX_NORM)
        worst["clipped"] = max(worst["clipped"], float(ref_norm > MAX_NORM))
        # Plan: this rank's slice, in micro-batches, summed loss over global tokens.
        mine = slice(dp_index * per_rank, (dp_index + 1) * per_rank)
        micro_inputs, micro_targets = (
            inputs[mine].chunk(case.microbatches),
            targets[mine].chunk(case.microbatches),
        )
        total_tokens = global_token_count(plan, [t.numel() for t in micro_targets])
        loss_sum = torch.zeros(())
        for i, (x, y) in enumerate(zip(micro_inputs, micro_targets)):
            with (
                mt.micro_batch(plan, model, last=i == case.microbatches - 1),
                mt.loss_parallel(plan),
            ):
                loss = (
                    F.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="sum")
                    / total_tokens
                )
                loss.backward()
            loss_sum += full(loss.detach())
        for axis in plan.data_axes:
            dist.all_reduce(loss_sum, group=device_mesh(mesh).get_group(axis))
        norm = clip_grad_norm_(model.parameters(), max_norm=MAX_NORM)
        worst["norm"] = max(worst["norm"], abs(norm.item() - ref_norm.item()) / ref_norm.item())
        worst["loss"] = max(
            worst["loss"], abs(loss_sum.item() - ref_loss.item()) / abs(ref_loss.item())
        )
        worst["grads"] = max(worst["grads"], worst_grad_error(model, reference))
        optimizer.step()
        ref_optimizer.step()
        optimizer.zero_grad()
        ref_optimizer.zero_grad()
        if case.optimizer == "adamw":
            # Measure this step's update difference, then continue both runs from the plan's
            # parameters so every step's gradients are compared at the same point.
            with torch.no_grad():
                ref_params = dict(reference.named_parameters())
                for fqn, param in model.named_parameters():
                    planned = full(param.detach())
                    step_diff = float((planned.double() - ref_params[fqn].double()).abs().max())
                    worst["params"] = max(worst["params"], step_diff)
                    ref_params[fqn].copy_(planned)
    ref_params = dict(reference.named_parameters())
    for fqn, param in model.named_parameters():
        if case.optimizer == "sgd":
            worst["params"] = max(
                worst["params"], rel(full(param.detach()), ref_params[fqn].detach())
            )
        state, ref_state = optimizer.state[param], ref_optimizer.state[ref_params[fqn]]
        for key, order in (("momentum_buffer", 1), ("exp_avg", 1), ("exp_avg_sq", 2)):
            if key in ref_state:
                # exp_avg_sq is quadratic in the gradient: its relative error doubles.
                error = rel(full(state[key]), ref_state[key]) / order
                worst["states"] = max(worst["states"], error)
    return worst


CASES = {
    "ddp": Case((("dp", 2),), "replicated", zero=0),
    "zero1": Case((("dp", 2),), "replicated", zero=1),
    "zero2": Case((("dp", 2),), "replicated", zero=2),
    "zero3": Case((("dp", 2),), "replicated", zero=3),
    "tp": Case((("tp", 2),), "tp"),
    "zero3-adamw": Case((("dp", 2),), "replicated", zero=3, optimizer="adamw"),
    "fsdp-tp": Case((("dp", 2), ("tp", 2)), "tp"),
    "fsdp-tp-adamw": Case((("dp", 2), ("tp", 2)), "tp", optimizer="adamw"),
    "hsdp": Case((("rep", 2), ("dp", 2)), "replicated"),
    "offload": Case((("dp", 4),), "replicated", offload=True),
    "ddp-tp": Case((("dp", 2), ("tp", 2)), "tp", zero=0),
    "mlp-fsdp-tp": Case((("dp", 2), ("tp", 2)), "mlp", model="mlp"),
    "hsdp-tp": Case((("rep", 2), ("dp", 2), ("tp", 2)), "tp"),
    "fsdp4-tp2-adamw": Case((("dp", 4), ("tp", 2)), "tp", optimizer="adamw", microbatches=1),
    "fsdp-tp-unpaired-rowwise": Case((("dp", 2), ("tp", 2)), "rowwise-only-attention"),
    "tp-sp": Case((("tp", 2),), "tp-sp"),
    "tp-sp-adamw": Case((("tp", 2),), "tp-sp", optimizer="adamw"),
    "fsdp-tp-sp": Case((("dp", 2), ("tp", 2)), "tp-sp"),
    "zero1-tp-sp-adamw": Case((("dp", 2), ("tp", 2)), "tp-sp", zero=1, optimizer="adamw"),
    "hsdp-tp-sp": Case((("rep", 2), ("dp", 2), ("tp", 2)), "tp-sp"),
    "grouped-fsdp-tp-adamw": Case((("dp", 2), ("tp", 2)), "tp", optimizer="adamw", model="grouped"),
    "grouped-tp-sp": Case((("tp", 2),), "tp-sp", model="grouped"),
}


# The MLP's FSDP units end in a row-wise Linear whose local output is a view; FSDP2 warns that an
# in-place op on it would skip the pre-backward hook. The model adds out of place (h = h + ...).
@pytest.mark.filterwarnings("ignore:.*FSDP2-wrapped module .* returned a view tensor")
@pytest.mark.parametrize("name", list(CASES))
def test_plan_trains_like_one_device(name: str) -> None:
    case = CASES[name]
    results = get_pool(case.world).run(train_both, case, _timeout_s=300.0)
    worst = {key: max(r[key] for r in results) for key in results[0]}
    param_bound = 2 * LR if case.optimizer == "adamw" else TIGHT  # AdamW: per step
    assert worst["clipped"] == 1.0, f"clipping never triggered: {worst}"
    assert worst["loss"] <= TIGHT, worst
    assert worst["norm"] <= TIGHT, worst
    # Clipped gradients carry the norm's relative error on top of their own: 2·TIGHT.
    assert worst["grads"] <= 2 * TIGHT, worst
    assert worst["states"] <= 2 * TIGHT, worst
    assert worst["params"] <= param_bound, worst
