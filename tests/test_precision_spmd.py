"""Mixed precision under FSDP2, TP and pipelines, against one device (tier 2: gloo ranks).

The policy (docs/compute.md): parameters cast to the compute dtype per FSDP2 unit, compute in it,
fp32 master weights and optimizer, gradients cast to fp32 and reduced in fp32; fp16 adds dynamic
loss scaling. References, on every rank, over the global batch: *same policy* — one device running
FSDP2's ``MixedPrecisionPolicy`` on a one-rank mesh; *fp32* — the plain model.

The ``approximate`` contract (:func:`bounds`), with u the compute dtype's unit roundoff (bf16 2⁻⁸,
fp16 2⁻¹¹): a *site* is a place where the plan rounds a partial result to the compute dtype that
one device rounds only as a whole — the data-parallel gradient sum (each rank's gradient is
rounded before the fp32 reduction), the tensor-parallel partial products (rounded before their
all-reduce) and a pipeline's last stage (the loss is taken from low-precision logits). Rounding
``a`` and ``b`` separately instead of ``a + b`` differs by at most 2u of the magnitudes involved,
so against the same policy gradients are within 2u per site of each tensor's largest magnitude,
the loss within 2u per forward site (TP, pipeline) plus fp32 reduction-order noise (1e-6), and
parameters after ``steps`` SGD steps of clipped gradients (norm ≤ 1) within lr·steps·(gradient
bound) absolutely. Against fp32 the policy itself rounds every activation and weight: 2u per
layer the signal passes (blocks + embedding + head) replaces the sites.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import full, mesh_for, rel, world_size
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import meshtrain as mt
from meshtrain import Rules
from meshtrain.lower import device_mesh
from meshtrain.models import LlamaConfig, build_llama, default_rules
from meshtrain.testing.runner import get_pool
from meshtrain.train import Batch, LossScaler, clip_grad_norm_, forward_backward

pytestmark = pytest.mark.spmd

STEPS = 3
LR = 1e-2
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
UNIT_ROUNDOFF = {"bf16": 2.0**-8, "fp16": 2.0**-11}


@dataclass(frozen=True)
class Case:
    axes: tuple[tuple[str, int], ...]  # pp first, then dp, tp (size-1 axes allowed)
    precision: str = "bf16"
    sequence_parallel: bool = False
    pipeline: str | None = None

    @property
    def world(self) -> int:
        return world_size(self.axes)


def _model() -> nn.Module:
    return build_llama(LlamaConfig.preset("debug", n_layers=4), seed=0)


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(7)
    batches = []
    for _ in range(STEPS):
        tokens = torch.randint(0, 256, (4, 33), generator=generator)
        batches.append((tokens[:, :-1], tokens[:, 1:]))
    return batches


def _mean_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def _run_reference(model: nn.Module, scaler: LossScaler | None) -> dict[str, object]:
    """One device: the global batch at once, mean loss, clipping, SGD."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses, grads = [], {}
    for step, (inputs, targets) in enumerate(_batches()):
        loss = _mean_loss(model(inputs), targets)
        (scaler.scale(loss) if scaler else loss).backward()
        finite = scaler.unscale_(model.parameters()) if scaler else True
        if step == 0:
            grads = {f: full(p.grad).detach().clone() for f, p in model.named_parameters()}
        if finite:
            clip_grad_norm_(list(model.parameters()), 1.0)
            optimizer.step()
        if scaler:
            scaler.update()
        optimizer.zero_grad()
        losses.append(loss.item())
    params = {f: full(p.detach()).clone() for f, p in model.named_parameters()}
    return {"losses": losses, "grads": grads, "params": params}


def _same_policy_reference(case: Case) -> dict[str, object]:
    """FSDP2's MixedPrecisionPolicy on a one-rank mesh: one device, same precision policy."""
    model = _model()
    one = init_device_mesh("cpu", (case.world, 1), mesh_dim_names=("ref", "one"))["one"]
    policy = MixedPrecisionPolicy(param_dtype=DTYPES[case.precision], reduce_dtype=torch.float32)
    for block in model.layers.values():
        fully_shard(block, mesh=one, mp_policy=policy)
    fully_shard(model, mesh=one, mp_policy=policy)
    return _run_reference(model, LossScaler() if case.precision == "fp16" else None)


def _run_plan(case: Case) -> dict[str, object]:
    model = _model()
    data = ("dp",)
    rules = Rules(
        logical=default_rules(sequence_parallel=case.sequence_parallel).logical, fsdp=data
    )
    pipeline = mt.Pipeline(schedule=case.pipeline, microbatches=2) if case.pipeline else None
    plan = mt.plan(
        model,
        mesh_for(case.axes),
        rules,
        zero=2 if pipeline else 3,
        precision=case.precision,  # type: ignore[arg-type]
        pipeline=pipeline,
        grad_reduction="sum",  # the loop divides the summed loss by the global token count
    )
    applied = mt.apply(plan, model)
    params = list(applied.parameters())
    optimizer = torch.optim.SGD(params, lr=LR)
    scaler = LossScaler() if case.precision == "fp16" else None
    coords = plan.mesh.coordinates(dist.get_rank())
    dp = plan.mesh.size("dp")
    mine = slice(coords["dp"] * 4 // dp, (coords["dp"] + 1) * 4 // dp)
    losses, grads = [], {}
    for step, (inputs, targets) in enumerate(_batches()):
        scale = scaler.scale_value if scaler else 1.0
        if pipeline is not None:
            batch = Batch(inputs[mine], targets[mine])
            loss = torch.tensor(forward_backward(plan, applied, batch, loss_scale=scale)[0])
        else:
            with mt.loss_parallel(plan):
                summed = F.cross_entropy(
                    applied(inputs[mine]).flatten(0, 1).float(),
                    targets[mine].flatten(),
                    reduction="sum",
                )
                (summed * (scale / targets.numel())).backward()
            loss = full(summed.detach()).clone() / targets.numel()
            if dp > 1:
                dist.all_reduce(loss, group=device_mesh(plan.mesh).get_group("dp"))
        finite = scaler.unscale_(params) if scaler else True
        if step == 0:
            grads = {f: full(p.grad).detach().clone() for f, p in applied.named_parameters()}
        if finite:
            clip_grad_norm_(params, 1.0, plan=plan)
            optimizer.step()
        if scaler:
            scaler.update()
        optimizer.zero_grad()
        losses.append(loss.item())
    final = {f: full(p.detach()).clone() for f, p in applied.named_parameters()}
    return {"losses": losses, "grads": grads, "params": final}


def _errors(run: dict, reference: dict) -> dict[str, float]:
    return {
        "loss": max(abs(a - b) / abs(b) for a, b in zip(run["losses"], reference["losses"])),
        "grads": max(rel(g, reference["grads"][f]) for f, g in run["grads"].items()),
        "params": max(
            float((p - reference["params"][f]).abs().max()) for f, p in run["params"].items()
        ),
    }


def bounds(case: Case, reference: str) -> dict[str, float]:
    """The contract's bounds for ``case`` against the 'same_policy' or 'fp32' reference."""
    u = UNIT_ROUNDOFF[case.precision]
    axes = dict(case.axes)
    tp, pp = axes.get("tp", 1) > 1, case.pipeline is not None
    if reference == "same_policy":
        forward_sites = int(tp) + int(pp)
        gradient_sites = int(axes.get("dp", 1) > 1) + forward_sites
    else:
        forward_sites = gradient_sites = 4 + 2  # blocks, embedding and head
    grads = 2 * u * gradient_sites
    return {"loss": 2 * u * forward_sites + 1e-6, "grads": grads, "params": LR * STEPS * grads}


def compare_precision(case: Case) -> dict[str, dict[str, float]]:
    run = _run_plan(case)
    same = _same_policy_reference(case)
    fp32 = _run_reference(_model(), None)
    return {"same_policy": _errors(run, same), "fp32": _errors(run, fp32)}


CASES = {
    "bf16-fsdp": Case((("dp", 2), ("tp", 1))),
    "bf16-fsdp-tp-sp": Case((("dp", 2), ("tp", 2)), sequence_parallel=True),
    "bf16-one-device": Case((("dp", 1), ("tp", 1))),
    "bf16-pp-fsdp": Case((("pp", 2), ("dp", 2), ("tp", 1)), pipeline="1F1B"),
    "fp16-fsdp": Case((("dp", 2), ("tp", 1)), precision="fp16"),
    "fp16-fsdp-tp": Case((("dp", 2), ("tp", 2)), precision="fp16"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_low_precision_matches_one_device(name: str) -> None:
    case = CASES[name]
    results = get_pool(case.world).run(compare_precision, case, _timeout_s=300.0)
    for reference in ("same_policy", "fp32"):
        bound = bounds(case, reference)
        for key, limit in bound.items():
            worst = max(r[reference][key] for r in results)
            assert worst <= limit, f"{reference} {key}: {worst:.3g} > {limit:.3g} ({results[0]})"


def overflow_is_skipped_everywhere() -> dict[str, object]:
    """An fp16 step whose gradients overflow on some rank only is skipped on every rank."""
    model = build_llama(LlamaConfig.preset("debug", n_layers=2), seed=0)
    plan = mt.plan(
        model,
        mesh_for((("dp", 2), ("tp", 1))),
        Rules(logical=default_rules().logical, fsdp="dp"),
        precision="fp16",
    )
    mt.apply(plan, model)
    before = {f: full(p.detach()).clone() for f, p in model.named_parameters()}
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    scaler = LossScaler(init_scale=2.0**10)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))
    loss = F.cross_entropy(model(tokens).flatten(0, 1).float(), tokens.flatten())
    # rank 1 alone blows its loss up past fp16's range: its shard of the gradients overflows
    factor = 1e30 if dist.get_rank() == 1 else 1.0
    scaler.scale(loss * factor).backward()
    stepped = scaler.unscale_(model.parameters())
    if stepped:
        optimizer.step()
    scaler.update()
    after = {f: full(p.detach()) for f, p in model.named_parameters()}
    return {
        "stepped": stepped,
        "scale": scaler.scale_value,
        "unchanged": all(torch.equal(after[f], before[f]) for f in before),
    }


def test_fp16_overflow_skips_the_step_on_every_rank() -> None:
    results = get_pool(2).run(overflow_is_skipped_everywhere, _timeout_s=120.0)
    assert [r["stepped"] for r in results] == [False, False], results
    assert [r["scale"] for r in results] == [2.0**9, 2.0**9], results
    assert all(r["unchanged"] for r in results), results
