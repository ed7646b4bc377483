"""Activation checkpointing, torch.compile and precision under every parallelism (gloo ranks).

Contracts (docs/compute.md):
- checkpointing on vs off, fp32: bitwise identical losses and gradients (the recomputation runs
  the same kernels on the same inputs);
- compile on vs off: ``aot_eager`` bitwise identical; ``inductor`` within 1e-5 relative (it fuses
  the pointwise and reduction ops of RMSNorm, SiLU·mul, RoPE and the softmax of the loss, which
  changes their summation order and skips intermediate roundings; matmuls stay the same kernels);
- bf16/fp16 against one device running the same precision policy, and against fp32: the bounds
  of ``precision_bound`` (see its docstring).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import full, mesh_for, rel, world_size
from torch import nn

import meshtrain as mt
from meshtrain import Rules
from meshtrain.lower import compile_report, device_mesh
from meshtrain.models import LlamaConfig, build_llama, default_rules
from meshtrain.testing.runner import get_pool
from meshtrain.train import Batch, clip_grad_norm_, forward_backward

pytestmark = pytest.mark.spmd

STEPS = 3
LR = 1e-2


@dataclass(frozen=True)
class Case:
    axes: tuple[tuple[str, int], ...]
    sequence_parallel: bool = False
    zero: int = 3
    pipeline: str | None = None
    options: dict[str, Any] = field(default_factory=dict)  # the variant's extra plan options

    @property
    def world(self) -> int:
        return world_size(self.axes)


def _model() -> nn.Module:
    return build_llama(LlamaConfig.preset("debug", n_layers=4), seed=0)


def _rules(case: Case) -> Rules:
    data = ("dp",)
    return Rules(logical=default_rules(sequence_parallel=case.sequence_parallel).logical, fsdp=data)


def _plan(case: Case, model: nn.Module, **options: Any) -> mt.Plan:
    pipeline = (
        mt.Pipeline(
            schedule=case.pipeline,
            microbatches=2,
            stages_per_rank=1 if case.pipeline in ("GPipe", "1F1B") else 2,
        )
        if case.pipeline
        else None
    )
    zero = 2 if case.pipeline and case.zero == 3 else case.zero
    given = dict(case.axes)
    axes = tuple(
        (axis, given.get(axis, 1)) for axis in ("pp", "dp", "tp") if axis in given or axis != "pp"
    )
    return mt.plan(model, mesh_for(axes), _rules(case), zero=zero, pipeline=pipeline, **options)


def _data_slice(plan: mt.Plan, batch: int) -> slice:
    mesh = plan.mesh
    coords = mesh.coordinates(dist.get_rank())
    ranks, index = 1, 0
    for axis in plan.data_axes:
        index = index * mesh.size(axis) + coords[axis]
        ranks *= mesh.size(axis)
    per_rank = batch // ranks
    return slice(index * per_rank, (index + 1) * per_rank)


def _train(case: Case, plan: mt.Plan, model: nn.Module, steps: int = STEPS) -> dict[str, Any]:
    """Runs the plan for ``steps`` SGD steps; returns losses and the first step's full grads."""
    applied = mt.apply(plan, model)
    params = list(applied.parameters())
    optimizer = torch.optim.SGD(params, lr=LR)
    generator = torch.Generator().manual_seed(7)
    losses, grads = [], {}
    for step in range(steps):
        tokens = torch.randint(0, 256, (4, 33), generator=generator)
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        mine = _data_slice(plan, tokens.shape[0])
        if plan.pipeline is not None:
            loss = torch.tensor(
                forward_backward(plan, applied, Batch(inputs[mine], targets[mine]))[0]
            )
        else:
            with mt.loss_parallel(plan):
                loss_sum = F.cross_entropy(
                    applied(inputs[mine]).flatten(0, 1).float(),
                    targets[mine].flatten(),
                    reduction="sum",
                )
                loss = loss_sum / targets.numel()
                loss.backward()
            loss = full(loss.detach()).clone()
            for axis in plan.data_axes:
                dist.all_reduce(loss, group=device_mesh(plan.mesh).get_group(axis))
        losses.append(loss.item())
        if step == 0:
            grads = {fqn: full(p.grad).detach().clone() for fqn, p in applied.named_parameters()}
        clip_grad_norm_(params, 1.0, plan=plan)
        optimizer.step()
        optimizer.zero_grad()
    return {"losses": losses, "grads": grads, "model": applied}


def compare_variant(case: Case) -> dict[str, Any]:
    """The same plan with and without ``case.options``: losses and gradients side by side."""
    base_model, variant_model = _model(), _model()
    base = _train(case, _plan(case, base_model), base_model)
    variant = _train(case, _plan(case, variant_model, **case.options), variant_model)
    bitwise = base["losses"] == variant["losses"] and all(
        torch.equal(variant["grads"][fqn], grad) for fqn, grad in base["grads"].items()
    )
    report = compile_report(variant["model"]) if not case.pipeline else None
    return {
        "bitwise": bitwise,
        "loss": max(abs(a - b) / abs(b) for a, b in zip(variant["losses"], base["losses"])),
        "grads": max(rel(variant["grads"][f], g) for f, g in base["grads"].items()),
        "graph_breaks": report.graph_breaks if report else 0,
    }


AC_CASES = {
    "full-fsdp": Case((("dp", 2),), options={"activation_checkpointing": "full"}),
    "selective-fsdp-tp": Case(
        (("dp", 2), ("tp", 2)), options={"activation_checkpointing": "selective"}
    ),
    "every2-tp-sp": Case(
        (("tp", 2),), sequence_parallel=True, options={"activation_checkpointing": {"every": 2}}
    ),
    "selective-pp-fsdp": Case(
        (("pp", 2), ("dp", 2)), pipeline="1F1B", options={"activation_checkpointing": "selective"}
    ),
    "full-pp-tp-zbv": Case(
        (("pp", 2), ("tp", 2)),
        pipeline="ZBVZeroBubble",
        options={"activation_checkpointing": "full"},
    ),
}


@pytest.mark.parametrize("name", list(AC_CASES))
def test_checkpointing_is_bitwise_identical(name: str) -> None:
    case = AC_CASES[name]
    results = get_pool(case.world).run(compare_variant, case, _timeout_s=300.0)
    assert all(r["bitwise"] for r in results), results


AOT_EAGER = {"backend": "aot_eager"}
COMPILE_CASES = {
    "block-fsdp": Case((("dp", 2),), options={"compile": AOT_EAGER}),
    "block-ddp-full": Case(
        (("dp", 2),), zero=0, options={"compile": AOT_EAGER, "activation_checkpointing": "full"}
    ),
    "model-tp-selective": Case(
        (("tp", 2),), options={"compile": AOT_EAGER, "activation_checkpointing": "selective"}
    ),
    "model-tp-sp": Case((("tp", 2),), sequence_parallel=True, options={"compile": AOT_EAGER}),
    "block-pp-fsdp": Case((("pp", 2), ("dp", 2)), pipeline="1F1B", options={"compile": AOT_EAGER}),
    "model-pp-tp-sp": Case(
        (("pp", 2), ("tp", 2)),
        sequence_parallel=True,
        pipeline="Interleaved1F1B",
        options={"compile": AOT_EAGER, "activation_checkpointing": "selective"},
    ),
}


# Compiled pipelines are the extended tier (the slowest compiles; docs/testing.md, "Tiers").
EXTENDED_COMPILE = {"block-pp-fsdp", "model-pp-tp-sp"}


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(name, marks=pytest.mark.extended if name in EXTENDED_COMPILE else ())
        for name in COMPILE_CASES
    ],
)
def test_aot_eager_compile_is_bitwise_identical(name: str) -> None:
    case = COMPILE_CASES[name]
    results = get_pool(case.world).run(compare_variant, case, _timeout_s=300.0)
    assert all(r["bitwise"] for r in results), results
    assert all(r["graph_breaks"] == 0 for r in results), results


# inductor's CPU code path imports a torch module that uses the deprecated torch.jit API
@pytest.mark.filterwarnings("ignore:.*torch.jit.script_method. is deprecated:DeprecationWarning")
def test_inductor_compile_within_its_bound() -> None:
    case = Case((("dp", 2),), options={"compile": True, "activation_checkpointing": "selective"})
    results = get_pool(case.world).run(compare_variant, case, _timeout_s=400.0)
    for r in results:
        assert r["loss"] <= 1e-5 and r["grads"] <= 1e-5, r
        assert r["graph_breaks"] == 0, r


class _Breaking(nn.Module):
    """A block whose forward has a graph break (data-dependent Python control flow)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        if y.sum().item() > 1e9:  # .item() leaves the graph
            return y * 2
        return y


def _breaking_run() -> tuple[int, list[str]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.ModuleList([_Breaking(), _Breaking()]))
    model.forward = lambda x: model[0][1](model[0][0](x))  # type: ignore[method-assign]
    plan = mt.plan(
        model,
        mesh_for((("dp", 1),)),
        Rules({r".*": mt.P()}, fsdp="dp"),
        compile={"backend": "aot_eager"},
    )
    mt.apply(plan, model)
    model(torch.ones(2, 8)).sum().backward()
    report = compile_report(model)
    return report.graph_breaks, list(report.reasons)


def test_graph_breaks_are_reported() -> None:
    """A graph break is reported after the first forward: count and reason, as a warning."""
    with pytest.warns(mt.GraphBreakWarning, match=r"more graphs 2 time.*item\(\)"):
        [(count, reasons)] = get_pool(1).run(_breaking_run, _timeout_s=120.0)
    assert count >= 2 and any("item" in reason for reason in reasons), reasons


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_checkpointed_batch_norms_update_their_statistics_once(mode: str) -> None:
    """A checkpointed block's BatchNorm sees, when backward recomputes it, the running
    statistics its forward saw, and keeps what the forward left: torch's checkpoint replays the
    forward's side effects, which moved the statistics twice and doubled
    ``num_batches_tracked`` (on one rank as on two) until the lowering restored them."""
    import zoo

    from meshtrain.testing import assert_equivalent

    options = {"rules": zoo.REPLICATED, "activation_checkpointing": mode}
    report = assert_equivalent(zoo.cnn, {"dp": 2}, options, batches=zoo.image_batches, steps=2)
    counts = [c for c in report.comparisons if c.fqn.endswith("num_batches_tracked")]
    assert counts and all(c.abs_error == 0.0 for c in counts)
    statistics = [c for c in report.comparisons if c.fqn.endswith("running_var")]
    assert statistics and all(c.ok for c in statistics)
