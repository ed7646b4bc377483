"""The planner's at-rest memory per rank is what real tensors hold after a training step (tier 2).

On real gloo ranks each case plans the debug Llama, applies the plan, runs one forward/backward
and one ``AdamW`` step (gradients kept), then sums the local bytes (``to_local()`` of a DTensor)
of this rank's parameters, their gradients and the optimizer's state tensors (``exp_avg`` and
``exp_avg_sq``; the scalar ``step`` is not a per-parameter state). These must equal
``plan.memory.params``, ``.grads`` and ``.optimizer_states`` byte for byte on every rank: the
at-rest rows of ``meshtrain.plan.cost``'s table (local tensor-parallel shard under zero 0, the
data-parallel shard under zero >= 1, master parameters in fp32 whatever the compute precision).
Under a pipeline ``plan.memory`` is the busiest pipeline rank's, so every rank is checked against
the ``param_bytes`` of the stages it runs (gradients as many bytes, AdamW's states twice), and the
busiest rank against ``plan.memory`` too. Transient bytes (gathered copies, unsharded gradients,
activations) are not checked here.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import mesh_for, world_size
from torch.distributed.tensor import DTensor

import meshtrain as mt
from meshtrain.models import LlamaConfig, build_llama, default_rules
from meshtrain.testing.runner import get_pool
from meshtrain.train import Batch, forward_backward

pytestmark = pytest.mark.spmd

BATCH, SEQ = 4, 8  # sequences per data-parallel rank, tokens per sequence


@dataclass(frozen=True)
class Case:
    axes: tuple[tuple[str, int], ...]
    zero: int
    precision: str = "fp32"
    microbatches: int = 0  # > 0: a pipeline over the "pp" axis with this many micro-batches
    n_layers: int = 2


def _local_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes this rank holds for ``tensors`` (a DTensor's local shard, a plain tensor whole)."""
    total = 0
    for tensor in tensors:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        total += local.numel() * local.element_size()
    return total


def measure(case: Case) -> dict[str, object]:
    """Runs on every rank: one real step, then this rank's real and planned byte triples
    (parameters, gradients, optimizer states), ``plan.memory``'s triple and whether ``plan.memory``
    describes this rank (always, unless pipelined: then only on the busiest pipeline rank)."""
    mesh = mesh_for(case.axes)
    model = build_llama(LlamaConfig.preset("debug", n_layers=case.n_layers), seed=0)
    pipeline = mt.Pipeline(microbatches=case.microbatches) if case.microbatches else None
    plan = mt.plan(
        model,
        mesh,
        default_rules(),
        zero=case.zero,
        precision=case.precision,  # type: ignore[arg-type]
        pipeline=pipeline,
    )
    applied = mt.apply(plan, model)
    params = list(applied.parameters())
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    tokens = torch.randint(0, 256, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    if plan.pipeline is None:
        with mt.micro_batch(plan, model, last=True), mt.loss_parallel(plan):
            logits = model(inputs)
            F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum").backward()
    else:
        forward_backward(plan, applied, Batch(inputs, targets))
    optimizer.step()  # gradients are kept: they are part of what a rank holds at rest

    grads = [p.grad for p in params if p.grad is not None]
    assert len(grads) == len(params), "a parameter has no gradient after backward"
    states = [
        value
        for p in params
        for value in optimizer.state[p].values()
        if isinstance(value, torch.Tensor) and value.numel() > 1
    ]
    real = (_local_bytes(params), _local_bytes(grads), _local_bytes(states))
    memory = plan.memory
    whole = (memory.params, memory.grads, memory.optimizer_states)
    if plan.pipeline is None:
        return {"real": real, "planned": whole, "plan_memory": whole, "busiest": True}
    pp_rank = mesh.coordinates(dist.get_rank())[plan.pipeline.axis]
    stage_bytes = sum(stage.param_bytes for stage in plan.pipeline.local_stages(pp_rank))
    (busiest,) = (
        int(match.group(1))
        for note in plan.notes
        if (match := re.search(r"busiest pipeline rank's \(\w+ rank (\d+)\)", note))
    )
    return {
        "real": real,
        "planned": (stage_bytes, stage_bytes, 2 * stage_bytes),
        "plan_memory": whole,
        "busiest": pp_rank == busiest,
    }


CASES = {
    **{f"dp4-zero{zero}": Case((("dp", 4), ("tp", 1)), zero) for zero in range(4)},
    "dp2-tp2-zero3": Case((("dp", 2), ("tp", 2)), 3),
    "dp2-tp2-zero3-bf16": Case((("dp", 2), ("tp", 2)), 3, precision="bf16"),
    "pp2-dp2-zero2": Case((("pp", 2), ("dp", 2), ("tp", 1)), 2, microbatches=2, n_layers=4),
}


@pytest.mark.parametrize("name", list(CASES))
def test_planned_bytes_at_rest_equal_real_tensor_bytes(name: str) -> None:
    case = CASES[name]
    results = get_pool(world_size(case.axes)).run(measure, case, _timeout_s=300.0)
    for rank, result in enumerate(results):
        real = result["real"]
        assert real == result["planned"], (
            f"rank {rank}: real (params, grads, optimizer states) {real} != planned "
            f"{result['planned']}"
        )
        if result["busiest"]:
            assert real == result["plan_memory"], (rank, real, result["plan_memory"])
    assert any(result["busiest"] for result in results)
