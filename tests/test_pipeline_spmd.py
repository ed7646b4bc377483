"""Every pipeline schedule, alone and composed with FSDP and TP, trains like one device (tier 2).

Contract (fp32, reduction order only) as in ``test_equivalence_spmd``: loss per step, the global
gradient norm (over every stage) and SGD parameters within 1e-6 relative to each tensor's largest
magnitude; clipped gradients and momentum within 2e-6. Two steps: the second starts from updated
parameters and a momentum buffer, so every quantity the contract names is compared after an update.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import StackedMLP, full, mesh_for, mlp_rules, rel, world_size
from torch import nn

import meshtrain as mt
from meshtrain import Rules
from meshtrain.models import LlamaConfig, build_llama, default_rules
from meshtrain.testing.runner import get_pool
from meshtrain.train import Batch, clip_grad_norm_, forward_backward

pytestmark = pytest.mark.spmd

LR = 0.1
STEPS = 2
TIGHT = 1e-6
MAX_NORM = {"llama": 0.5, "mlp": 0.02}  # below every step's gradient norm (asserted)


@dataclass(frozen=True)
class Case:
    axes: tuple[tuple[str, int], ...]
    schedule: str
    stages_per_rank: int = 1
    microbatches: int = 4
    zero: int = 3
    sequence_parallel: bool = False
    model: str = "llama"

    @property
    def world(self) -> int:
        return world_size(self.axes)


def _build(case: Case) -> tuple[nn.Module, Rules, int]:
    fsdp = ("dp",) if "dp" in dict(case.axes) else ()
    if case.model == "mlp":
        torch.manual_seed(0)
        return StackedMLP(n_blocks=4), mlp_rules(fsdp), 64
    model = build_llama(LlamaConfig.preset("debug", n_layers=8), seed=0)
    logical = default_rules(sequence_parallel=case.sequence_parallel).logical
    return model, Rules(logical=logical, fsdp=fsdp), 256


def train_both(case: Case) -> dict[str, float]:
    mesh = mesh_for(case.axes)
    axes = dict(case.axes)
    model, rules, vocab = _build(case)
    reference = copy.deepcopy(model)
    plan = mt.plan(
        model,
        mesh,
        rules,
        zero=case.zero,
        optimizer="sgd",
        pipeline=mt.Pipeline(
            schedule=case.schedule,
            microbatches=case.microbatches,
            stages_per_rank=case.stages_per_rank,
        ),
    )
    pipelined = mt.apply(plan, model)
    optimizer = torch.optim.SGD(pipelined.parameters(), lr=LR, momentum=0.9)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=LR, momentum=0.9)
    dp_ranks = axes.get("dp", 1)
    dp_index = mesh.coordinates(dist.get_rank()).get("dp", 0)
    per_rank = case.microbatches * 2
    generator = torch.Generator().manual_seed(1234)
    worst = {"loss": 0.0, "norm": 0.0, "grads": 0.0, "params": 0.0, "states": 0.0, "clipped": 0.0}
    ref_params = dict(reference.named_parameters())
    for _ in range(STEPS):
        tokens = torch.randint(0, vocab, (dp_ranks * per_rank, 17), generator=generator)
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        ref_loss = F.cross_entropy(reference(inputs).flatten(0, 1), targets.flatten())
        ref_loss.backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(
            reference.parameters(), max_norm=MAX_NORM[case.model]
        )
        worst["clipped"] = max(worst["clipped"], float(ref_norm > MAX_NORM[case.model]))
        mine = slice(dp_index * per_rank, (dp_index + 1) * per_rank)
        loss, _ = forward_backward(plan, pipelined, Batch(inputs[mine], targets[mine]))
        norm = clip_grad_norm_(pipelined.parameters(), max_norm=MAX_NORM[case.model], plan=plan)
        worst["loss"] = max(worst["loss"], abs(loss - ref_loss.item()) / ref_loss.item())
        worst["norm"] = max(worst["norm"], abs(norm.item() - ref_norm.item()) / ref_norm.item())
        for fqn, param in pipelined.named_parameters():
            worst["grads"] = max(worst["grads"], rel(full(param.grad), ref_params[fqn].grad))
        optimizer.step()
        ref_optimizer.step()
        optimizer.zero_grad()
        ref_optimizer.zero_grad()
    for fqn, param in pipelined.named_parameters():
        worst["params"] = max(worst["params"], rel(full(param.detach()), ref_params[fqn].detach()))
        state = optimizer.state[param]["momentum_buffer"]
        ref_state = ref_optimizer.state[ref_params[fqn]]["momentum_buffer"]
        worst["states"] = max(worst["states"], rel(full(state), ref_state))
    return worst


SCHEDULES = {
    "GPipe": 1,
    "1F1B": 1,
    "Interleaved1F1B": 2,
    "LoopedBFS": 2,
    "InterleavedZeroBubble": 2,
    "ZBVZeroBubble": 2,
    "DualPipeV": 2,
}
COMPOSITIONS = {
    "pp": (("pp", 2), ("dp", 1), ("tp", 1)),
    "pp-fsdp": (("pp", 2), ("dp", 2), ("tp", 1)),
    "pp-tp": (("pp", 2), ("dp", 1), ("tp", 2)),
    "pp-fsdp-tp": (("pp", 2), ("dp", 2), ("tp", 2)),
}


SPLIT_BACKWARD = {"InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"}


def _case(schedule: str, composition: str, **overrides: object) -> Case:
    # zero=3 cannot run split-backward schedules (a PlanError, tested in test_pipeline_plan).
    zero = 2 if schedule in SPLIT_BACKWARD else 3
    fields: dict[str, object] = {"zero": zero, **overrides}
    return Case(COMPOSITIONS[composition], schedule, SCHEDULES[schedule], **fields)  # type: ignore[arg-type]


def _check(case: Case) -> None:
    results = get_pool(case.world).run(train_both, case, _timeout_s=300.0)
    worst = {key: max(r[key] for r in results) for key in results[0]}
    assert worst["clipped"] == 1.0, f"clipping never triggered: {worst}"
    assert worst["loss"] <= TIGHT, worst
    assert worst["norm"] <= TIGHT, worst
    assert worst["grads"] <= 2 * TIGHT, worst
    assert worst["states"] <= 2 * TIGHT, worst
    assert worst["params"] <= TIGHT, worst


# Every schedule runs on 8 ranks (pp × dp × tp) once: these three with sequence parallelism
# (test_sequence_parallel_under_a_pipeline), the others here.
SEQUENCE_PARALLEL_3D = ("1F1B", "Interleaved1F1B", "ZBVZeroBubble")


# The first tier runs every schedule under pp × FSDP and every composition at least once; the
# rest of the grid is the extended tier (docs/testing.md, "Tiers").
FIRST_TIER = {
    *((schedule, "pp-fsdp") for schedule in SCHEDULES),
    ("1F1B", "pp"),
    ("Interleaved1F1B", "pp-tp"),
    ("GPipe", "pp-fsdp-tp"),
    ("1F1B", "pp-tp-sp"),
    ("Interleaved1F1B", "pp-fsdp-tp-sp"),
    ("ZBVZeroBubble", "pp-tp-sp"),
}


def _tiered(*values: str) -> Any:
    first = (values[0], values[1]) in FIRST_TIER
    return pytest.param(*values, marks=() if first else pytest.mark.extended)


@pytest.mark.parametrize(
    ("schedule", "composition"),
    [
        _tiered(schedule, composition)
        for schedule in SCHEDULES
        for composition in COMPOSITIONS
        if not (composition == "pp-fsdp-tp" and schedule in SEQUENCE_PARALLEL_3D)
    ],
)
def test_schedule_trains_like_one_device(schedule: str, composition: str) -> None:
    _check(_case(schedule, composition))


@pytest.mark.parametrize(
    ("schedule", "composition", "zero"),
    [
        ("1F1B", "pp-fsdp", 0),
        ("1F1B", "pp-fsdp", 1),
        ("Interleaved1F1B", "pp-fsdp-tp", 2),
        ("ZBVZeroBubble", "pp-fsdp", 1),
        ("DualPipeV", "pp-fsdp-tp", 0),
    ],
)
def test_zero_stages_under_a_pipeline(schedule: str, composition: str, zero: int) -> None:
    _check(_case(schedule, composition, zero=zero))


@pytest.mark.parametrize(
    ("schedule", "composition"),
    [
        pytest.param(
            schedule,
            composition,
            marks=() if (schedule, f"{composition}-sp") in FIRST_TIER else pytest.mark.extended,
        )
        for composition in ("pp-tp", "pp-fsdp-tp")
        for schedule in SEQUENCE_PARALLEL_3D
    ],
)
def test_sequence_parallel_under_a_pipeline(schedule: str, composition: str) -> None:
    _check(_case(schedule, composition, sequence_parallel=True))


# The blocks end in a row-wise Linear whose local output is a view; FSDP2 warns that an in-place
# op on it would skip the pre-backward hook. The model adds out of place (h = h + ...).
@pytest.mark.filterwarnings("ignore:.*FSDP2-wrapped module .* returned a view tensor")
@pytest.mark.parametrize(
    ("schedule", "composition"),
    [("1F1B", "pp-fsdp"), ("Interleaved1F1B", "pp-tp"), ("ZBVZeroBubble", "pp-fsdp-tp")],
)
def test_a_model_with_a_module_list_pipelines(schedule: str, composition: str) -> None:
    """Not meshtrain's model: blocks in an nn.ModuleList (kept under their original indices)."""
    _check(_case(schedule, composition, model="mlp", microbatches=4))


@pytest.mark.filterwarnings("ignore:.*FSDP2-wrapped module .* returned a view tensor")
def test_a_model_that_reads_a_removed_module_on_every_stage_pipelines() -> None:
    """ViT's forward reads ``embeddings.patch_embeddings.projection.weight.dtype`` before its
    embeddings run, on every stage; a later stage holds a stub there, which reads such
    attributes from the removed module kept on the meta device (the plan was accepted and every
    later stage crashed with "'_Stub' object has no attribute 'patch_embeddings'")."""
    import zoo
    from precision_cases import vit_images

    from meshtrain import P
    from meshtrain.testing import assert_equivalent

    report = assert_equivalent(
        zoo.vit,
        {"pp": 2, "dp": 2},
        {"rules": Rules({r".*": P()}, fsdp="dp"), "pipeline": mt.Pipeline(microbatches=2)},
        batches=vit_images,
        steps=1,
        optimizer="adamw",
    )
    assert report.passed
