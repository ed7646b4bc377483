"""LoRA on a sharded base, on real gloo ranks against one device (tier 2): meshtrain's Llama and
a Hugging Face Llama with adapters under data × tensor (and sequence) parallelism, FSDP × tensor
parallelism and a pipeline, through ``assert_equivalent``; a plain PyTorch LoRA loop written the
ordinary way on one process against the same loop under a plan; and every collective of a step
against the plan's prediction."""

from __future__ import annotations

import copy
import math

import lora_models
import pytest
import torch
import torch.nn.functional as F
import zoo
from helpers import full

import meshtrain as mt
from meshtrain.models import default_rules
from meshtrain.testing import assert_equivalent
from meshtrain.testing.contract import contract_for
from meshtrain.testing.runner import get_pool
from meshtrain.train.loss import data_parallel_rank

pytestmark = pytest.mark.spmd

TP = {"dp": 2, "tp": 2}
PP = {"pp": 2, "dp": 2}

CASES = {
    "llama-tp": (lora_models.llama_lora, {"tp": 2}, {"rules": default_rules(fsdp=())}),
    "llama-tp-sp": (
        lora_models.llama_lora,
        {"tp": 2},
        {"rules": default_rules(fsdp=(), sequence_parallel=True)},
    ),
    "llama-dp-tp": (lora_models.llama_lora, TP, {"rules": default_rules(), "zero": 0}),
    "llama-fsdp-tp": (lora_models.llama_lora, TP, {"rules": default_rules(), "zero": 3}),
    "llama-pp-fsdp": (
        lora_models.llama_lora,
        PP,
        {"rules": default_rules(tp=None), "zero": 2, "pipeline": mt.Pipeline(microbatches=2)},
    ),
    "hf-llama-fsdp-tp": (
        lora_models.hf_llama_lora,
        TP,
        {"rules": zoo.hf_rules(zoo.llama()), "zero": 3},
    ),
    "hf-llama-pp-fsdp": (
        lora_models.hf_llama_lora,
        PP,
        {"rules": zoo.REPLICATED, "zero": 3, "pipeline": mt.Pipeline(microbatches=2)},
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_lora_trains_like_one_device(name: str) -> None:
    factory, mesh, options = CASES[name]
    batches = zoo.token_batches if factory is lora_models.hf_llama_lora else None
    report = assert_equivalent(factory, mesh, options, batches=batches, steps=2, optimizer="adamw")
    assert report.passed
    held = {c.fqn for c in report.comparisons if c.quantity == "param"}
    assert held and all("lora_" in fqn for fqn in held), sorted(held)[:5]


# ------------------------------------------------------- a plain PyTorch loop, and collectives


def plain_lora_loop(steps: int) -> dict[str, float]:
    """On every rank: the Hugging Face Llama with adapters under FSDP × TP, trained the way one
    writes a DDP loop (each rank's mean loss on its slice, backward, SGD over the trainable
    parameters), against the same model trained in one process the ordinary way."""
    torch.manual_seed(0)
    model = lora_models.hf_llama_lora()
    reference = copy.deepcopy(model)
    plan = mt.plan(model, mt.make_mesh(TP), zoo.hf_rules(zoo.llama()))
    applied = mt.apply(plan, model)
    frozen = {
        fqn: full(p.detach()).clone()
        for fqn, p in applied.named_parameters()
        if not p.requires_grad
    }
    trainable = [p for p in applied.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(trainable, lr=0.1, momentum=0.9)
    ref_trainable = [p for p in reference.parameters() if p.requires_grad]
    ref_optimizer = torch.optim.SGD(ref_trainable, lr=0.1, momentum=0.9)
    index, ranks = data_parallel_rank(plan)
    worst = {"loss": 0.0, "param": 0.0, "frozen changed": 0.0}
    for step in range(steps):
        inputs, targets = zoo.token_batches(step)
        rows = inputs.shape[0] // ranks
        mine = slice(index * rows, (index + 1) * rows)
        loss = F.cross_entropy(applied(inputs[mine]).logits.flatten(0, 1), targets[mine].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        ref_loss = F.cross_entropy(reference(inputs).logits.flatten(0, 1), targets.flatten())
        ref_loss.backward()
        ref_optimizer.step()
        ref_optimizer.zero_grad()
        global_loss = full(loss.detach()).clone()
        torch.distributed.all_reduce(global_loss)
        global_loss /= torch.distributed.get_world_size()
        ref_value = float(ref_loss.detach())
        error = abs(float(global_loss) - ref_value) / ref_value
        worst["loss"] = max(worst["loss"], error)
    ref_params = dict(reference.named_parameters())
    for fqn, param in applied.named_parameters():
        ref = ref_params[fqn].detach()
        error = float((full(param.detach()) - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
        worst["param"] = max(worst["param"], error)
        if fqn in frozen:
            changed = float((full(param.detach()) - frozen[fqn]).abs().max())
            worst["frozen changed"] = max(worst["frozen changed"], changed)
    worst["tolerance"] = contract_for(plan).tolerance
    return worst


@pytest.mark.filterwarnings("ignore:.*FSDP2-wrapped module .* returned a view tensor")
def test_a_plain_lora_loop_trains_like_one_process() -> None:
    for worst in get_pool(4).run(plain_lora_loop, steps=3):
        assert worst["frozen changed"] == 0.0, worst
        assert worst["loss"] <= 3 * worst["tolerance"], worst
        assert worst["param"] <= worst["tolerance"], worst


COLLECTIVE_CASES = {
    "hf-llama-fsdp-tp": (lora_models.hf_llama_lora, TP, zoo.hf_rules(zoo.llama()), {"zero": 3}),
    "hf-llama-fsdp-tp-sp": (
        lora_models.hf_llama_lora,
        TP,
        zoo.hf_rules(zoo.llama(), sequence_parallel=True),
        {"zero": 3},
    ),
    "llama-tp": (lora_models.llama_lora, {"tp": 2}, default_rules(fsdp=()), {"microbatches": 2}),
    "llama-tp-sp": (
        lora_models.llama_lora,
        {"tp": 2},
        default_rules(fsdp=(), sequence_parallel=True),
        {"microbatches": 2},
    ),
    "llama-dp-tp": (lora_models.llama_lora, TP, default_rules(), {"zero": 0, "microbatches": 2}),
    "llama-fsdp-tp": (lora_models.llama_lora, TP, default_rules(), {"zero": 3, "microbatches": 2}),
    # gradients accumulated over micro-batches are reduced in the reduce dtype (fp32), not bf16
    "llama-zero1-tp-bf16": (
        lora_models.llama_lora,
        TP,
        default_rules(),
        {"zero": 1, "microbatches": 2, "precision": "bf16"},
    ),
}


def lora_collectives(name: str) -> tuple[dict, dict, dict, dict]:
    """On every rank: one counted step of a plan of :data:`COLLECTIVE_CASES` (after a warm-up
    step) against the plan's prediction, counts and payload bytes by (kind, axis)."""
    factory, axes, rules, options = COLLECTIVE_CASES[name]
    torch.manual_seed(0)
    return zoo.counted_step(factory(), rules, axes, **options)


@pytest.mark.filterwarnings("ignore:.*FSDP2-wrapped module .* returned a view tensor")
def test_frozen_parameters_issue_no_gradient_collectives() -> None:
    """The Hugging Face Llama with adapters on dp 2 × tp 2: every collective is the plan's. Over
    dp every unit's parameters are gathered and only the adapters' gradients reduce-scattered.
    Over tp the replicated adapters' partial gradients are all-reduced (7 per block), and the
    first block's attention input gradient is never computed (nothing before it trains)."""
    for counts, predicted, payload, predicted_payload in get_pool(4).run(
        lora_collectives, "hf-llama-fsdp-tp"
    ):
        assert counts == predicted
        assert payload == predicted_payload
        assert predicted[("reduce_scatter", "dp")] == 2  # two blocks; the root has no adapters
        assert predicted[("all_reduce", "tp")] == 5 + 4 + 2 * 7  # forward, inputs, adapters


@pytest.mark.parametrize("name", [name for name in COLLECTIVE_CASES if name != "hf-llama-fsdp-tp"])
@pytest.mark.filterwarnings("ignore:.*FSDP2-wrapped module .* returned a view tensor")
def test_lora_steps_issue_exactly_the_predicted_collectives(name: str) -> None:
    """Tensor and data parallel, with and without sequence parallelism and FSDP, one and two
    micro-batches: the adapters' partial gradients are reduced once per gradient sync (every
    micro-batch under zero 3, once per step under zero 0 and 1 and without a data axis)."""
    axes = COLLECTIVE_CASES[name][1]
    for counts, predicted, payload, predicted_payload in get_pool(math.prod(axes.values())).run(
        lora_collectives, name
    ):
        assert counts == predicted
        assert payload == predicted_payload


# --------------------------------------------------------------- a pipeline with a frozen stage

LATER = [r"layers\.[1-9]\d*\.attention\.w[qv]"]  # layers.1 and on: stage 1 of the debug Llama
PIPELINED_CASES = {  # mesh, adapter targets, sends per step (4 micro-batches, one boundary)
    "frozen-first-stage-tp": ({"pp": 2, "tp": 2}, LATER, 4),
    "frozen-first-stage-fsdp": ({"pp": 2, "dp": 2}, LATER, 4),
    "first-stage-trains-tp": ({"pp": 2, "tp": 2}, [r"layers\.\d+\.attention\.w[qv]"], 8),
}


def pipelined_lora_collectives(name: str) -> dict:
    """On every rank of a :data:`PIPELINED_CASES` plan (the debug Llama's two layers on two
    stages: embedding and layers.0, then layers.1 and the head): one warm-up step, then one
    counted step; returns what was counted, whether this is the busiest pipeline rank (the one
    ``plan.collectives`` describes), the plan's prediction, and the trainable parameters left
    without a gradient."""
    import re

    from meshtrain.adapters import lora
    from meshtrain.models import LlamaConfig, build_llama
    from meshtrain.testing.comms import CollectiveCounter
    from meshtrain.train import Batch, forward_backward

    axes, targets, _ = PIPELINED_CASES[name]
    mesh = mt.make_mesh(axes)
    model = lora(build_llama(LlamaConfig.debug(), seed=0), rank=4, alpha=8, targets=targets)
    rules = default_rules(fsdp=()) if "tp" in axes else default_rules(tp=None)
    plan = mt.plan(
        model,
        mesh,
        rules,
        zero=2,
        pipeline=mt.Pipeline(microbatches=4),
        global_batch=4 * axes.get("dp", 1),
        seq_len=8,
    )
    pipelined = mt.apply(plan, model)
    tokens = torch.randint(0, 256, (4, 9), generator=torch.Generator().manual_seed(0))
    batch = Batch(tokens[:, :-1], tokens[:, 1:])
    forward_backward(plan, pipelined, batch)  # lazy initialisation issues its own
    for param in pipelined.parameters():
        param.grad = None
    with CollectiveCounter(mesh) as counter:
        forward_backward(plan, pipelined, batch)
    (busiest,) = (
        int(match.group(1))
        for note in plan.notes
        if (match := re.search(r"busiest pipeline rank's \(pp rank (\d+)\)", note))
    )
    totals = plan.collective_totals()
    return {
        "counts": dict(counter.counts),
        "bytes": dict(counter.bytes),
        "busiest": mesh.coordinates(torch.distributed.get_rank())["pp"] == busiest,
        "predicted": {k: n for k, (n, _) in totals.items()},
        "predicted bytes": {k: b for k, (_, b) in totals.items()},
        "no grad": [
            fqn for fqn, p in pipelined.named_parameters() if p.requires_grad and p.grad is None
        ],
    }


@pytest.mark.parametrize("name", list(PIPELINED_CASES))
def test_a_frozen_first_stage_receives_no_gradient(name: str) -> None:
    """Adapters only past the first stage: autograd computes no gradient of the activation the
    second stage receives, so the pipeline sends activations forward and nothing back (4 sends
    of 4 micro-batches, not 8); with adapters on the first stage too, both ways. Every
    collective of the busiest pipeline rank, and every rank's sends, are the plan's."""
    axes, _, sends = PIPELINED_CASES[name]
    results = get_pool(math.prod(axes.values())).run(pipelined_lora_collectives, name)
    assert sum(r["busiest"] for r in results) == len(results) // 2
    for r in results:
        assert r["no grad"] == []
        key = ("send/recv", "pp")
        assert r["predicted"][key] == r["counts"][key] == sends
        assert r["predicted bytes"][key] == r["bytes"][key] == sends * 8 * 64 * 4  # 1 × 8 × 64 fp32
        if r["busiest"]:  # a frozen stage's row of no reduce-scatters counts as none issued
            issued = [k for k, n in r["predicted"].items() if n]
            assert r["counts"] == {k: r["predicted"][k] for k in issued}
            assert r["bytes"] == {k: r["predicted bytes"][k] for k in issued}
