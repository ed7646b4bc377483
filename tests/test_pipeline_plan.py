"""Pipelined plans, pure: stage → rank layout, schedule costs, explain/JSON, and bad input."""

from __future__ import annotations

import pytest
import torch
from helpers import StackedMLP, TiedMLP
from hypothesis import given, settings
from hypothesis import strategies as st

import meshtrain as mt
from meshtrain import P, PlanError, Rules
from meshtrain.adapters import lora
from meshtrain.models import LlamaConfig, build_llama, default_rules
from meshtrain.plan import SCHEDULES, Plan
from meshtrain.plan.memory.activations import trace_activations
from meshtrain.plan.pipeline.schedule import bubble_fraction, stage_ranks

MODEL = build_llama(LlamaConfig.preset("debug", n_layers=8), device="meta")
RULES = default_rules()
SINGLE = ("GPipe", "1F1B")
LOOPED = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble")
V_SHAPED = ("ZBVZeroBubble", "DualPipeV")


def mesh(**axes: int) -> mt.Mesh:
    world = 1
    for size in axes.values():
        world *= size
    return mt.make_mesh({"dp": 1, "tp": 1, **axes}, world_size=world, abstract=True)


def pipelined(schedule: str = "1F1B", *, pp: int = 2, dp: int = 1, tp: int = 1, **kwargs):  # type: ignore[no-untyped-def]
    stages_per_rank = kwargs.pop("stages_per_rank", 1 if schedule in SINGLE else 2)
    microbatches = kwargs.pop("microbatches", 8)
    split = kwargs.pop("split", "auto")
    pipeline = mt.Pipeline(
        schedule=schedule, microbatches=microbatches, stages_per_rank=stages_per_rank, split=split
    )
    return mt.plan(
        kwargs.pop("model", MODEL),
        mesh(pp=pp, dp=dp, tp=tp),
        kwargs.pop("rules", RULES),
        pipeline=pipeline,
        **kwargs,
    )


def test_one_stage_per_rank_in_model_order() -> None:
    plan = pipelined("1F1B", pp=2)
    assert plan.pipeline is not None
    first, last = plan.pipeline.stages
    assert (first.rank, last.rank) == (0, 1)
    assert first.modules == ("tok_embeddings", *(f"layers.{i}" for i in range(4)))
    assert last.modules == (*(f"layers.{i}" for i in range(4, 8)), "norm", "output")
    assert set(first.params) | set(last.params) == {p.fqn for p in plan.params}
    assert not set(first.params) & set(last.params)
    assert plan.options.microbatches == 8


@pytest.mark.parametrize("schedule", LOOPED)
def test_looped_schedules_place_stage_s_on_rank_s_mod_p(schedule: str) -> None:
    plan = pipelined(schedule, pp=2, stages_per_rank=2, microbatches=4)
    assert plan.pipeline is not None
    assert [s.rank for s in plan.pipeline.stages] == [0, 1, 0, 1]
    assert [s.index for s in plan.pipeline.local_stages(1)] == [1, 3]


@pytest.mark.parametrize("schedule", V_SHAPED)
def test_v_schedules_fold_the_stages_back(schedule: str) -> None:
    plan = pipelined(schedule, pp=2, microbatches=4)
    assert plan.pipeline is not None
    assert [s.rank for s in plan.pipeline.stages] == [0, 1, 1, 0]
    # rank 0 holds the first and the last stage: embedding and head on one rank
    assert plan.pipeline.local_stages(0)[-1].modules[-2:] == ("norm", "output")
    assert stage_ranks(schedule, 4, 2) == (0, 1, 2, 3, 3, 2, 1, 0)


@settings(max_examples=40, deadline=None)
@given(
    schedule=st.sampled_from(("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS")),
    pp=st.integers(2, 6),
    rounds=st.integers(1, 4),
    stages_per_rank=st.integers(1, 3),
)
def test_bubble_of_non_split_schedules_matches_the_textbook(
    schedule: str, pp: int, rounds: int, stages_per_rank: int
) -> None:
    """Simulating torch's action order gives (P−1)/(v·M+P−1) for GPipe, 1F1B, interleaving."""
    v = 1 if schedule in SINGLE else stages_per_rank
    micro = pp * rounds
    expected = (pp - 1) / (v * micro + pp - 1)
    assert bubble_fraction(schedule, pp, micro, v) == pytest.approx(expected)


def test_zero_bubble_schedules_beat_their_non_split_counterparts() -> None:
    interleaved = pipelined("Interleaved1F1B", pp=4, microbatches=8)
    zero_bubble = pipelined("InterleavedZeroBubble", pp=4, microbatches=8)
    zbv = pipelined("ZBVZeroBubble", pp=4, microbatches=8)
    assert interleaved.pipeline and zero_bubble.pipeline and zbv.pipeline
    assert interleaved.pipeline.bubble_fraction == pytest.approx(3 / 19)
    assert zero_bubble.pipeline.bubble_fraction < interleaved.pipeline.bubble_fraction / 2
    assert zbv.pipeline.bubble_fraction < interleaved.pipeline.bubble_fraction / 2


def test_1f1b_holds_fewer_micro_batches_than_gpipe() -> None:
    gpipe, one_f_one_b = pipelined("GPipe", pp=4), pipelined("1F1B", pp=4)
    assert gpipe.pipeline and one_f_one_b.pipeline
    assert [s.in_flight for s in gpipe.pipeline.stages] == [8, 8, 8, 8]
    assert [s.in_flight for s in one_f_one_b.pipeline.stages] == [4, 3, 2, 1]


def test_point_to_point_traffic_and_activation_memory_are_sized() -> None:
    plan = pipelined("1F1B", pp=4, batch_size=2, seq_len=16)
    assert plan.pipeline is not None
    boundary = 2 * 16 * 64 * 4  # micro-batch × seq × dim × fp32
    assert plan.pipeline.p2p_count == 2 * 8 * 3  # forward and backward, 8 micro-batches, 3 cuts
    assert plan.pipeline.p2p_bytes == 2 * 8 * 3 * boundary
    first = plan.pipeline.stages[0]
    # the stage's blocks' saved bytes per micro-batch (traced; see test_activations.py)
    blocks = [m for m in first.modules if m.startswith("layers.")]
    profile = trace_activations(MODEL, blocks, batch_size=2, seq_len=16)
    per_micro_batch = sum(b.saved.rest for b in profile.blocks)
    assert first.activation_bytes == first.in_flight * per_micro_batch > 0
    rows = [c for c in plan.collectives if c.kind == "send/recv"]
    assert rows and rows[0].axis == "pp" and rows[0].bytes == plan.pipeline.p2p_bytes
    # under sequence parallelism each tensor-parallel rank sends its sequence shard
    sp = pipelined(
        "1F1B", pp=4, tp=2, rules=default_rules(sequence_parallel=True), batch_size=2, seq_len=16
    )
    assert sp.pipeline is not None and sp.pipeline.p2p_bytes == plan.pipeline.p2p_bytes // 2


def test_a_V_schedule_sends_nothing_between_its_two_middle_stages() -> None:
    plan = pipelined("ZBVZeroBubble", pp=2, microbatches=4)
    assert plan.pipeline is not None
    assert plan.pipeline.p2p_count == 2 * 4 * 2  # stages 1 and 2 share rank 1


def adapted(*layers: int) -> torch.nn.Module:
    """The 8-layer debug Llama with adapters on the attention of ``layers``, the rest frozen."""
    model = build_llama(LlamaConfig.preset("debug", n_layers=8), device="meta")
    which = "|".join(map(str, layers))
    return lora(model, rank=4, alpha=8, targets=[rf"layers\.({which})\.attention\.w[qv]"])


# Stages of 8 layers on pp 2: 1F1B 0: embedding, layers 0–3 | 1: layers 4–7, head. Looped and V
# schedules, 2 per rank: 0: embedding, layers 0–1 | 1: 2–3 | 2: 4–5 | 3: 6–7, head; looped ranks
# 0 1 0 1 (3 rank boundaries), V ranks 0 1 1 0 (2). No gradient goes back across a boundary
# before the first stage with an adapter; a frozen stage after one still sends its gradient.
FROZEN_SENDS = [  # (schedule, adapted layers, frozen rank boundaries)
    ("1F1B", (0,), 0),
    ("1F1B", (4, 7), 1),
    ("GPipe", (5,), 1),
    ("Interleaved1F1B", (2,), 1),
    ("Interleaved1F1B", (4,), 2),
    ("Interleaved1F1B", (0, 7), 0),
    ("LoopedBFS", (7,), 3),
    ("DualPipeV", (4,), 1),  # stages 1 and 2 share a rank
    ("ZBVZeroBubble", (0, 4), 0),
    ("DualPipeV", (6,), 2),
]


@pytest.mark.parametrize(("schedule", "layers", "frozen"), FROZEN_SENDS)
def test_no_gradient_is_sent_back_before_the_first_trainable_stage(
    schedule: str, layers: tuple[int, ...], frozen: int
) -> None:
    plan = pipelined(schedule, model=adapted(*layers), batch_size=2, seq_len=16)
    assert plan.pipeline is not None
    crossings = 3 if schedule in LOOPED else 2 if schedule in V_SHAPED else 1
    assert plan.pipeline.frozen_crossings == frozen
    # 8 micro-batches forward across every boundary, backward across the others
    assert plan.pipeline.p2p_count == 8 * (2 * crossings - frozen)
    assert plan.pipeline.p2p_bytes == plan.pipeline.p2p_count * 2 * 16 * 64 * 4  # fp32
    (row,) = (c for c in plan.collectives if c.kind == "send/recv")
    assert (row.count, row.bytes) == (plan.pipeline.p2p_count, plan.pipeline.p2p_bytes)
    assert Plan.from_json(plan.to_json()) == plan


@pytest.mark.parametrize("schedule", ["InterleavedZeroBubble", "ZBVZeroBubble"])
def test_zero_bubble_schedules_refuse_a_frozen_first_stage(schedule: str) -> None:
    """Their weight-gradient step gives a later first-to-train stage's parameters no gradient
    (measured: ``layers.3``'s adapters under ZBVZeroBubble kept ``grad=None``)."""
    with pytest.raises(PlanError, match=rf"schedule '{schedule}' with stage 2 the first to train"):
        pipelined(schedule, model=adapted(4))
    pipelined(schedule, model=adapted(0, 4))  # stage 0 trains: its inputs' gradients flow


def test_explain_says_where_no_gradient_is_sent_back() -> None:
    plan = pipelined("Interleaved1F1B", model=adapted(4), microbatches=4)
    assert plan.pipeline is not None
    assert "point-to-point per step: 16 sends" in plan.explain()
    assert (
        "(activations forward across 3 rank boundaries, their gradients backward across 1: the "
        "first 2 have no trainable parameter before them)" in plan.explain()
    )
    assert "(activations forward, their gradients backward)" in pipelined("1F1B").explain()


def test_memory_is_the_busiest_pipeline_ranks() -> None:
    flat = mt.plan(MODEL, mesh(dp=2), RULES, zero=3)
    plan = pipelined("1F1B", pp=2, dp=2, zero=3)
    assert plan.memory.total < flat.memory.total
    assert plan.memory.total > flat.memory.total * 0.4
    assert plan.pipeline is not None
    per_rank = [sum(s.param_bytes for s in plan.pipeline.local_stages(r)) for r in (0, 1)]
    assert plan.memory.params == max(per_rank)
    assert sum(per_rank) == flat.memory.params


def test_explain_and_json_round_trip() -> None:
    plan = pipelined("Interleaved1F1B", pp=2, dp=2, tp=2, microbatches=4, batch_size=1, seq_len=8)
    text = plan.explain()
    assert "pipeline over 'pp': Interleaved1F1B, 4 stages (2 per rank), 4 micro-batches" in text
    assert "bubble fraction 0.111" in text
    assert "point-to-point per step: 24 sends" in text
    assert Plan.from_json(plan.to_json()) == plan
    explicit = pipelined("1F1B", split=["layers.3"])
    assert Plan.from_json(explicit.to_json()) == explicit


def test_explicit_split_points() -> None:
    plan = pipelined("1F1B", split=["layers.2"])
    assert plan.pipeline is not None
    assert plan.pipeline.stages[0].modules == ("tok_embeddings", "layers.0", "layers.1")


def test_global_batch_fills_in_the_micro_batch_size() -> None:
    plan = pipelined("1F1B", dp=2, microbatches=4, global_batch=16)
    assert plan.options.batch_size == 2


def test_planning_a_405b_pipeline_on_16k_ranks_is_quick() -> None:
    model = build_llama(LlamaConfig.llama3_405b(), device="meta")
    abstract = mt.make_mesh(pp=16, dp=-1, tp=8, world_size=16384, abstract=True)
    plan = mt.plan(
        model,
        abstract,
        default_rules(),
        zero=2,
        pipeline=mt.Pipeline(schedule="Interleaved1F1B", microbatches=32, stages_per_rank=2),
        batch_size=1,
        seq_len=8192,
    )
    assert plan.pipeline is not None and len(plan.pipeline.stages) == 32
    assert 0 < plan.pipeline.bubble_fraction < 0.2


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (
            lambda: pipelined("1F1B", pp=2, microbatches=1),
            r"'1F1B' with 2 pipeline ranks .* cannot run microbatches=1: .* Use microbatches ≥ 2",
        ),
        (
            lambda: pipelined("DualPipeV", pp=2, microbatches=3),
            r"'DualPipeV' .* \(4 stages\) cannot run microbatches=3: .* Use microbatches ≥ 4",
        ),
        (
            lambda: pipelined("Interleaved1F1B", pp=4, microbatches=9),
            r"cannot run microbatches=9: .* Use a multiple of 4 micro-batches",
        ),
        (
            lambda: pipelined("GPipe", pp=16),
            r"has 8 repeated blocks but the pipeline asks for 16 stages",
        ),
        (
            lambda: pipelined("Interleaved1F1B", pp=2, stages_per_rank=6),
            r"has 8 repeated blocks but the pipeline asks for 12 stages",
        ),
        (
            lambda: pipelined("1F1B", split=["layers.x"]),
            r"split point 'layers.x' is not a repeated block FQN",
        ),
        (
            lambda: pipelined("1F1B", split=["layers.1", "layers.5"]),
            r"gives 2 split points for 2 stages; give 1",
        ),
        (lambda: pipelined("1F1B", pp=1), r"pipeline axis 'pp' has size 1 .* at least 2"),
        (
            lambda: pipelined("1F1B", dp=2, microbatches=4, global_batch=12),
            r"global_batch=12 does not split into 2 data-parallel ranks × 4 pipeline micro-batches",
        ),
        (
            lambda: pipelined("ZBVZeroBubble", dp=2, zero=3),
            r"zero=3 with schedule 'ZBVZeroBubble'.* Use zero=2",
        ),
        (
            lambda: mt.plan(
                MODEL, mesh(pp=2), RULES, microbatches=2, pipeline=mt.Pipeline(microbatches=4)
            ),
            r"microbatches=2 and Pipeline\(microbatches=4\) disagree",
        ),
    ],
)
def test_bad_pipelines_fail_at_plan_time(build, message: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(PlanError, match=message):
        build()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"schedule": "Chimera"}, r"pipeline schedule 'Chimera' is unknown; use one of"),
        (
            {"schedule": "1F1B", "stages_per_rank": 2},
            r"runs one stage per rank.* use stages_per_rank=1",
        ),
        ({"schedule": "DualPipeV", "stages_per_rank": 3}, r"two stages per rank in a V"),
        ({"microbatches": 0}, r"Pipeline\(microbatches=0\): give a positive integer"),
    ],
)
def test_bad_pipeline_options(kwargs: dict, message: str) -> None:
    with pytest.raises(PlanError, match=message):
        mt.Pipeline(**kwargs)


def test_every_torch_schedule_is_offered() -> None:
    from torch.distributed.pipelining.schedules import get_schedule_class

    assert (*SINGLE, *LOOPED, *V_SHAPED) == SCHEDULES
    for name in SCHEDULES:
        get_schedule_class(name)


def test_tied_weights_across_stages_are_refused() -> None:
    rules = Rules({r".*": P()}, fsdp="dp")
    with pytest.raises(PlanError, match=r"'head.weight' is the same tensor as 'embed.weight'"):
        mt.plan(TiedMLP(), mesh(pp=2), rules, pipeline=mt.Pipeline(microbatches=2))


def test_the_pipeline_axis_has_one_job() -> None:
    with pytest.raises(PlanError, match=r"'pp' is the pipeline axis and a data axis"):
        mt.plan(MODEL, mesh(pp=2), Rules(logical=RULES.logical, fsdp="pp"), pipeline=mt.Pipeline())
    with pytest.raises(PlanError, match=r"mesh axis 'pp' .*\(pipeline=mt.Pipeline\(axis='pp'\)\)"):
        mt.plan(MODEL, mesh(pp=2), RULES)
    with pytest.raises(PlanError, match=r"pipeline axis 'stage' is not an axis of mesh"):
        mt.plan(MODEL, mesh(pp=2), RULES, pipeline=mt.Pipeline(axis="stage"))


def test_a_module_list_model_keeps_its_block_names() -> None:
    plan = mt.plan(StackedMLP(n_blocks=4), mesh(pp=2), Rules({r".*": P()}), pipeline=mt.Pipeline())
    assert plan.pipeline is not None
    assert plan.pipeline.stages[1].modules == ("blocks.2", "blocks.3", "norm", "head")


def test_pipelined_plans_accumulate_inside_the_schedule() -> None:
    plan = pipelined("1F1B")
    with (
        pytest.raises(PlanError, match=r"meshtrain.train.forward_backward"),
        mt.micro_batch(plan, MODEL, last=True),
    ):
        pass
