"""Expert parallelism trains like one device on gloo ranks: transformers' MoE families (tiny,
built locally) under ``assert_equivalent``, and a plain PyTorch loop written the ordinary way
(each rank's mean loss, ``backward``, ``SGD.step``) against the same loop on one process, on
Qwen3-MoE and on meshtrain's own MoE, with routing compared expert by expert (the same tokens
reach the same experts)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from moe_models import ep_rules, mixtral, qwen2_moe, qwen3_moe, token_batches
from precision_cases import Case

import meshtrain as mt
from meshtrain.lower.experts.parallel import router_metrics, tokens_per_expert
from meshtrain.lower.gather import full_tensor
from meshtrain.models.moe import MoEConfig, build_moe
from meshtrain.models.moe import default_rules as moe_rules
from meshtrain.testing import assert_equivalent
from meshtrain.testing.contract import contract_for
from meshtrain.testing.runner import get_pool
from meshtrain.train.loss import data_parallel_rank

pytestmark = pytest.mark.spmd


def test_qwen2_moe_with_a_shared_expert_trains_like_one_device_on_dp2_ep2() -> None:
    """FSDP2 over dp × ep for the dense weights and the shared expert, experts over ep and
    FSDP2 over dp: every gradient averaged over the 4 batch ranks."""
    report = assert_equivalent(
        qwen2_moe,
        {"dp": 2, "ep": 2},
        {"rules": ep_rules()},
        batches=token_batches,
        steps=2,
        optimizer="adamw",
    )
    assert report.passed


@pytest.mark.extended
def test_qwen3_moe_trains_like_one_device_on_ep4() -> None:
    """8 experts, 2 per rank; FSDP2 over ep for the rest, no data axis."""
    report = assert_equivalent(
        qwen3_moe,
        {"ep": 4},
        {"rules": ep_rules(fsdp=())},
        batches=token_batches,
        steps=2,
        optimizer="adamw",
    )
    assert report.passed


@pytest.mark.extended
def test_mixtral_trains_like_one_device_on_pp2_ep2_in_bf16() -> None:
    """A 1F1B pipeline whose stages dispatch their own layers' tokens over ep, with full
    activation checkpointing, in bf16."""
    report = assert_equivalent(
        mixtral,
        {"pp": 2, "ep": 2},
        {
            "rules": ep_rules(fsdp=()),
            "precision": "bf16",
            "activation_checkpointing": "full",
            "pipeline": mt.Pipeline(axis="pp", microbatches=2),
        },
        batches=token_batches,
        steps=2,
        optimizer="adamw",
    )
    assert report.passed and report.contract.level == "approximate"


def meshtrain_moe() -> torch.nn.Module:
    """meshtrain's own MoE: a dense first layer, then 8 grouped experts (top-2) and a shared one."""
    config = MoEConfig.debug(dim=32, n_layers=2, vocab_size=64, moe_inter=16, dense_inter=64)
    return build_moe(config)


LOOPS = {
    "qwen3-moe": (qwen3_moe, lambda: ep_rules(fsdp=())),
    "meshtrain-moe": (meshtrain_moe, lambda: moe_rules(tp=None, fsdp=(), ep="ep")),
}


def plain_loop(name: str, steps: int) -> dict[str, float]:
    """On every rank of ep 2: the plan trained by a loop written for DDP, and the same loop on
    the whole batch in this process; the worst relative errors and routing mismatches."""
    factory, rules = LOOPS[name]
    torch.manual_seed(0)
    model = factory()
    reference = copy.deepcopy(model)
    plan = mt.plan(model, mt.make_mesh({"ep": 2}), rules())
    applied = mt.apply(plan, model)
    optimizer = torch.optim.SGD(applied.parameters(), lr=0.1, momentum=0.9)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    routed: dict[str, torch.Tensor] = {}
    for group in plan.experts:
        reference.get_submodule(group.fqn).register_forward_hook(
            lambda module, args, _, fqn=group.fqn: routed.__setitem__(
                fqn, torch.bincount(args[1].flatten(), minlength=module.num_experts)
            )
        )
    index, ranks = data_parallel_rank(plan)
    worst = {"loss": 0.0, "param": 0.0, "routing": 0.0}
    for step in range(steps):
        inputs, targets = token_batches(step)
        rows = inputs.shape[0] // ranks
        mine = slice(index * rows, (index + 1) * rows)
        logits = _logits(applied(inputs[mine]))
        loss = F.cross_entropy(logits.flatten(0, -2), targets[mine].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        ref_loss = F.cross_entropy(_logits(reference(inputs)).flatten(0, -2), targets.flatten())
        ref_loss.backward()
        ref_optimizer.step()
        ref_optimizer.zero_grad()
        for fqn, counts in tokens_per_expert(plan, applied).items():
            worst["routing"] += float((counts - routed[fqn]).abs().sum())
        stats = router_metrics(plan, applied)
        expected = torch.stack([routed[g.fqn] for g in plan.experts]).double()
        worst["routing"] += abs(stats["moe/tokens_per_expert_max"] - float(expected.max()))
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)
        ref_value = float(ref_loss.detach())
        error = abs(float(global_loss) / ranks - ref_value) / ref_value
        worst["loss"] = max(worst["loss"], error)
    ref_params = dict(reference.named_parameters())
    for fqn, param in applied.named_parameters():
        ref = ref_params[fqn].detach()
        error = float((full_tensor(param.detach()) - ref).abs().max() / ref.abs().max())
        worst["param"] = max(worst["param"], error)
    worst["tolerance"] = contract_for(plan).tolerance
    return worst


def _logits(output: object) -> torch.Tensor:
    logits = getattr(output, "logits", output)
    assert isinstance(logits, torch.Tensor)
    return logits


@pytest.mark.parametrize("name", list(LOOPS))
def test_a_plain_pytorch_loop_trains_like_one_device_with_the_same_routing(name: str) -> None:
    for worst in get_pool(2).run(plain_loop, name, 2):
        assert worst["routing"] == 0, worst  # every step, every layer: the same expert loads
        bound = worst["tolerance"]
        assert worst["loss"] <= 2 * bound, worst  # the loss drifts with each step's parameters
        assert worst["param"] <= bound, worst


def test_meshtrain_moe_counts_the_whole_step_under_a_pipeline_of_micro_batches() -> None:
    """A router's ``tokens_per_expert`` is the step's whole batch, as one device's one forward
    counts it: a pipeline of 2 micro-batches on pp2 x dp2 used to keep the last micro-batch's
    counts only (20 tokens apart on the last stage; found by the false-alarm benchmark, in fp32
    as in fp16)."""
    case = Case("meshtrain-moe", "pp", "fp32", None, seed=1, steps=1, optimizer="adamw")
    model_fn = case.model_fn()
    report = mt.testing.assert_equivalent(
        model_fn,
        case.mesh,
        case.options(model_fn()),
        batches=case.batches(),
        steps=case.steps,
        optimizer=case.optimizer,
        seed=case.seed,
    )
    counts = [c for c in report.comparisons if c.fqn.endswith("router.tokens_per_expert")]
    assert counts and all(c.abs_error == 0 for c in counts)
