"""The collectives a training step really issues equal those the plan predicts (kind, axis, count)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import GroupedLM, attention_rowwise_only_rules, grouped_rules, mesh_for

import meshtrain as mt
from meshtrain import P, Rules
from meshtrain.models import LlamaConfig, build_llama, default_rules
from meshtrain.testing.comms import CollectiveCounter
from meshtrain.testing.runner import get_pool
from meshtrain.train import Batch, forward_backward

pytestmark = pytest.mark.spmd


def measure(
    axes: tuple[tuple[str, int], ...], rules_kind: str, zero: int, micro: int, loss_parallel: bool
) -> tuple[dict, dict]:
    """Runs on every rank: one warm-up step, then one counted step of ``micro`` micro-batches."""
    mesh = mesh_for(axes)
    data = tuple(name for name, _ in axes if name in ("rep", "dp"))
    if rules_kind.startswith("grouped"):
        torch.manual_seed(0)
        model: torch.nn.Module = GroupedLM()
    else:
        model = build_llama(LlamaConfig.debug(), seed=0)
    rules = {
        "tp": Rules(logical=default_rules().logical, fsdp=data),
        "tp-sp": Rules(logical=default_rules(sequence_parallel=True).logical, fsdp=data),
        "replicated": Rules({r".*": P()}, fsdp=data),
        "rowwise-only-attention": attention_rowwise_only_rules(data),
        "grouped": grouped_rules(data),
        "grouped-sp": grouped_rules(data, sequence_parallel=True),
    }[rules_kind]
    plan = mt.plan(
        model,
        mesh,
        rules,
        zero=zero,
        microbatches=micro,
        loss_parallel=loss_parallel,
        batch_size=2,
        seq_len=8,
    )
    mt.apply(plan, model)
    tokens = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))

    def step() -> None:
        for i in range(micro):
            with mt.micro_batch(plan, model, last=i == micro - 1), mt.loss_parallel(plan):
                logits = model(tokens[:, :-1])
                F.cross_entropy(
                    logits.flatten(0, 1), tokens[:, 1:].flatten(), reduction="sum"
                ).backward()

    step()  # lazy initialisation issues its own collectives
    model.zero_grad()
    counter = CollectiveCounter(mesh)
    with counter:
        step()
    predicted, predicted_bytes = _predicted(plan)
    return {
        "counts": (dict(counter.counts), predicted),
        "bytes": (dict(counter.bytes), predicted_bytes),
    }


def _predicted(plan: mt.Plan) -> tuple[dict, dict]:
    """The plan's collectives per (kind, axis): counts, then payload bytes."""
    totals = plan.collective_totals()
    return {k: n for k, (n, _) in totals.items()}, {k: b for k, (_, b) in totals.items()}


CASES = {
    "ddp": ((("dp", 2),), "replicated", 0, 2, True),
    "zero1": ((("dp", 2),), "replicated", 1, 2, True),
    "zero2": ((("dp", 2),), "replicated", 2, 2, True),
    "zero3": ((("dp", 2),), "replicated", 3, 2, True),
    "hsdp": ((("rep", 2), ("dp", 2)), "replicated", 3, 1, True),
    "tp": ((("tp", 2),), "tp", 3, 2, True),
    "tp-gathered-head": ((("tp", 2),), "tp", 3, 1, False),
    "fsdp-tp": ((("dp", 2), ("tp", 2)), "tp", 3, 2, True),
    "tp-unpaired-rowwise": ((("tp", 2),), "rowwise-only-attention", 3, 1, True),
    "tp-sp": ((("tp", 2),), "tp-sp", 3, 2, True),
    "tp-sp-gathered-head": ((("tp", 2),), "tp-sp", 3, 1, False),
    "fsdp-tp-sp-zero3": ((("dp", 2), ("tp", 2)), "tp-sp", 3, 2, True),
    "fsdp-tp-sp-zero1": ((("dp", 2), ("tp", 2)), "tp-sp", 1, 2, True),
    # column-wise Linears inside a projection module, paired with the row-wise one beside it
    "fsdp-tp-grouped": ((("dp", 2), ("tp", 2)), "grouped", 3, 2, True),
    "tp-sp-grouped": ((("tp", 2),), "grouped-sp", 3, 1, True),
}


@pytest.mark.parametrize("name", list(CASES))
def test_step_issues_exactly_the_predicted_collectives(name: str) -> None:
    axes, rules_kind, zero, micro, loss_parallel = CASES[name]
    world = 1
    for _, size in axes:
        world *= size
    results = get_pool(world).run(measure, axes, rules_kind, zero, micro, loss_parallel)
    for result in results:
        measured, predicted = result["counts"]
        assert measured == predicted
        measured_bytes, predicted_bytes = result["bytes"]
        assert measured_bytes == predicted_bytes


def measure_pipelined(zero: int, tp: bool) -> tuple[tuple[dict, dict], tuple[dict, dict]] | None:
    """Runs on every rank of pp 2 × dp 2 (× tp 2): one warm-up step, one counted step; on the
    busiest pipeline rank (the one ``plan.collectives`` describes) returns every collective and
    point-to-point transfer counted and predicted (counts, then payload bytes): the schedule's
    sends, the data- and tensor-parallel collectives, and the step's two scalar sums."""
    import re

    import torch.distributed as dist

    axes = (("pp", 2), ("dp", 2), ("tp", 2)) if tp else (("pp", 2), ("dp", 2))
    mesh = mesh_for(axes)
    model = build_llama(LlamaConfig.preset("debug", n_layers=4), seed=0)
    rules = (
        Rules(logical=default_rules().logical, fsdp="dp") if tp else Rules({r".*": P()}, fsdp="dp")
    )
    plan = mt.plan(
        model,
        mesh,
        rules,
        zero=zero,
        pipeline=mt.Pipeline(microbatches=4),
        global_batch=8,
        seq_len=8,
    )
    pipelined = mt.apply(plan, model)
    tokens = torch.randint(
        0, 256, (4, 9), generator=torch.Generator().manual_seed(0)
    )  # per dp rank
    batch = Batch(tokens[:, :-1], tokens[:, 1:])
    forward_backward(plan, pipelined, batch)  # lazy initialisation issues its own
    counter = CollectiveCounter(mesh)
    with counter:
        forward_backward(plan, pipelined, batch)
    (busiest,) = (
        int(match.group(1))
        for note in plan.notes
        if (match := re.search(r"busiest pipeline rank's \(pp rank (\d+)\)", note))
    )
    if mesh.coordinates(dist.get_rank())["pp"] != busiest:
        return None
    measured, measured_bytes = dict(counter.counts), dict(counter.bytes)
    return (measured, measured_bytes), _predicted(plan)


@pytest.mark.parametrize(("zero", "tp"), [(2, False), (3, False), (2, True)])
def test_pipelined_step_issues_the_predicted_sends_and_collectives(zero: int, tp: bool) -> None:
    results = [r for r in get_pool(8 if tp else 4).run(measure_pipelined, zero, tp) if r]
    assert results
    for measured, predicted in results:
        assert ("send/recv", "pp") in measured[0]  # activations and their gradients are counted
        assert measured[0][("all_reduce", "pp+dp")] == 1  # the loss, over pp and dp at once
        assert measured == predicted
