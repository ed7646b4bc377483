"""mt.plan: pure planning — styles read off specs, FSDP units, memory model, errors at plan time."""

from __future__ import annotations

import pytest
import torch
from helpers import GroupedLM, TiedMLP, grouped_rules
from hypothesis import given
from hypothesis import strategies as st

import meshtrain as mt
from meshtrain import P, PlanError, Rules
from meshtrain.models import LlamaConfig, build_llama, default_rules
from meshtrain.plan import Plan

MODEL = build_llama(LlamaConfig.debug(), device="meta")
N_PARAMS = LlamaConfig.debug().num_params()


def mesh(**axes: int) -> mt.Mesh:
    world = 1
    for size in axes.values():
        world *= size
    return mt.make_mesh(axes, world_size=world, abstract=True)


def test_styles_units_and_json_round_trip() -> None:
    plan = mt.plan(MODEL, mesh(dp=2, tp=2), default_rules())
    styles = {s.fqn: s.style for s in plan.styles}
    assert styles["tok_embeddings"] == "vocab_parallel_embedding"
    assert styles["layers.0.attention.wq"] == "colwise"
    assert styles["layers.1.feed_forward.w2"] == "rowwise"
    assert styles["output"] == "loss_parallel_head"
    assert [u.fqn for u in plan.units] == ["layers.0", "layers.1", ""]
    assert plan.units[-1].params == ("tok_embeddings.weight", "norm.weight", "output.weight")
    assert Plan.from_json(plan.to_json()) == plan
    assert "loss_parallel_head" in plan.explain()


def test_without_loss_parallel_the_head_is_gathered_and_flagged() -> None:
    plan = mt.plan(MODEL, mesh(dp=2, tp=2), default_rules(), loss_parallel=False)
    head = next(s for s in plan.styles if s.fqn == "output")
    assert head.style == "colwise_gathered" and "extra collective" in head.note


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_memory_matches_the_zero_stage_formulas(zero: int, precision: str) -> None:
    # Pure FSDP over 4 ranks, AdamW: at rest 4 bytes each for master parameter, gradient and
    # 2 states, sharded under zero >= 1; during a step gathered compute copies and unsharded
    # gradients of the units in flight (see meshtrain.plan.cost).
    plan = mt.plan(
        MODEL, mesh(dp=4), Rules({r".*": P()}, fsdp="dp"), zero=zero, precision=precision
    )
    full = 4 * N_PARAMS
    shard = full // 4  # every dim 0 of the debug model divides by 4: no FSDP padding
    m = plan.memory
    at_rest = full if zero == 0 else shard
    assert (m.params, m.grads, m.optimizer_states) == (at_rest, at_rest, 2 * at_rest)
    assert m.buffers == 2 * 64 * 8 * 4  # rope cos and sin, [max_seq_len, head_dim / 2] fp32
    numel = {
        u.fqn: sum(p.local_numel for p in plan.params if p.fqn in u.params) for u in plan.units
    }
    compute_bytes = 2 if precision == "bf16" else 4
    if zero == 0:
        gathered = N_PARAMS * compute_bytes if precision == "bf16" else 0
    elif zero == 3:  # the root (kept after forward), the running block and the prefetched one
        gathered = (numel[""] + 2 * numel["layers.0"]) * compute_bytes
    else:
        gathered = N_PARAMS * compute_bytes
    assert m.gathered_params == gathered
    assert m.unsharded_grads == (0 if zero == 0 else 4 * max(numel.values()))
    assert m.total == m.at_rest + m.transient == m.at_rest + gathered + m.unsharded_grads


def test_tensor_parallel_divides_local_bytes_by_tp_for_sharded_params() -> None:
    model = build_llama(LlamaConfig.preset("debug", n_heads=8, n_kv_heads=4), device="meta")
    plan = mt.plan(model, mesh(dp=1, tp=4), Rules(logical=default_rules().logical, fsdp="dp"))
    for p in plan.params:
        assert p.local_numel * (4 if p.spec.axes else 1) == torch.Size(p.shape).numel()


def test_heads_must_split_whole_over_the_tensor_parallel_axis() -> None:
    # debug: 4 query heads and 2 key/value heads of 16; tp=4 would leave half a kv head per rank.
    with pytest.raises(PlanError, match=r"'layers.0.attention.wk' projects 2 heads of size 16"):
        mt.plan(MODEL, mesh(dp=1, tp=4), default_rules())


def test_fsdp_collectives_per_step() -> None:
    plan = mt.plan(MODEL, mesh(dp=2, tp=2), default_rules(), zero=3, microbatches=2)
    counts = [(c.kind, c.axis, c.count) for c in plan.collectives]
    assert counts[:3] == [
        ("all_gather", "dp", 3 * 2),
        ("all_gather", "dp", 2 * 2),
        ("reduce_scatter", "dp", 3 * 2),
    ]
    # 2 blocks: forward all-reduce per row-wise module (2 each) + the vocab-parallel embedding;
    # backward all-reduce per pair parent (attention, feed-forward) + the head; per micro-batch.
    tp = [(c.kind, c.count, c.why.split(":")[0]) for c in plan.collectives if c.axis == "tp"]
    assert sorted(tp) == [
        ("all_reduce", 1 * 2, "forward"),
        ("all_reduce", 2 * 2 * 2, "forward"),
        ("all_reduce", (2 * 2 + 1) * 2, "backward"),
    ]
    zero1 = mt.plan(MODEL, mesh(dp=2, tp=2), default_rules(), zero=1, microbatches=2)
    assert [(c.kind, c.axis, c.count) for c in zero1.collectives][:2] == [
        ("all_gather", "dp", 3),
        ("reduce_scatter", "dp", 3),
    ]


def test_hsdp_adds_an_all_reduce_over_the_replicate_axis() -> None:
    plan = mt.plan(MODEL, mesh(rep=2, dp=2), Rules({r".*": P()}, fsdp=("rep", "dp")))
    assert plan.data_axes == ("rep", "dp")
    assert ("all_reduce", "rep") in {(c.kind, c.axis) for c in plan.collectives}


def test_planning_llama3_405b_on_16384_fake_ranks() -> None:
    model = build_llama(LlamaConfig.llama3_405b(), device="meta")
    plan = mt.plan(
        model, mt.make_mesh(dp=-1, tp=8, world_size=16384, abstract=True), default_rules()
    )
    assert plan.mesh.shape == {"dp": 2048, "tp": 8}
    # 405.85e9 fp32 parameters over 16,384 ranks would be ~99 MB each if every dim 0 divided;
    # FSDP2 pads dim 0 of the tensor-parallel shard to a multiple of dp=2048: w1's 53248/8 = 6656
    # local rows become 4 rows per rank (8192 in all), wk's 1024/8 = 128 rows become 1 row each.
    ideal = 4 * 405_853_388_800 / 16384
    w1 = next(p for p in plan.params if p.fqn == "layers.0.feed_forward.w1.weight")
    wk = next(p for p in plan.params if p.fqn == "layers.0.attention.wk.weight")
    assert (w1.local_shape, w1.shard_shape) == ((6656, 16384), (4, 16384))
    assert (wk.local_shape, wk.shard_shape) == ((128, 16384), (1, 16384))
    assert ideal < plan.memory.params < 1.3 * ideal
    assert any("FSDP pads dim 0" in note for note in plan.notes)


@pytest.mark.parametrize(
    ("kwargs", "rules", "axes", "message"),
    [
        ({"zero": 4}, default_rules(), {"dp": 2, "tp": 2}, r"zero=4 is out of range"),
        (
            {},
            Rules({r".*wq\.weight": P("dp"), r".*": P()}, fsdp="dp"),
            {"dp": 2, "tp": 2},
            r"axis 'dp' is a data axis .* parameter 'layers.0.attention.wq.weight' is sharded over it",
        ),
        (
            {},
            Rules({r".*norm\.weight": P("tp"), r".*": P()}, fsdp="dp"),
            {"dp": 2, "tp": 2},
            r"parameter 'layers.0.attention_norm.weight' of RMSNorm .* Norm weights stay replicated",
        ),
        (
            {},
            Rules({r".*": P()}),
            {"dp": 2, "tp": 2},
            r"mesh axis 'dp' \(size 2\) .* is neither a data axis",
        ),
        (
            {"fsdp_units": ["layers.7"]},
            default_rules(),
            {"dp": 2, "tp": 2},
            r"fsdp_units names 'layers.7'",
        ),
        (
            {},
            Rules(
                {r".*wq\.weight": P(None, "tp"), r".*wk\.weight": P("tp", "tp2"), r".*": P()},
                fsdp="dp",
            ),
            {"dp": 1, "tp": 2, "tp2": 2},
            r"several model axes \['tp', 'tp2'\]",
        ),
        (
            {},
            Rules(
                {
                    r".*wq\.weight": P("tp", None),
                    r".*wk\.weight": P(None, "tp"),
                    r".*wv\.weight": P(),
                    r"layers\.0\.attention\.wo\.weight": P("tp", None),
                    r".*": P(),
                },
                fsdp="dp",
            ),
            {"dp": 2, "tp": 2},
            r"'layers\.0\.attention\.wv' beside 'layers\.0\.attention\.wq' is replicated",
        ),
        (
            {"offload": True, "zero": 0},
            default_rules(),
            {"dp": 2, "tp": 2},
            r"offload=True needs sharded data parallelism",
        ),
    ],
)
def test_bad_plans_are_plan_errors_that_name_the_culprit(
    kwargs: dict, rules: Rules, axes: dict[str, int], message: str | None
) -> None:
    if message is None:  # a valid but unusual layout must plan
        mt.plan(MODEL, mesh(**axes), rules, **kwargs)
        return
    with pytest.raises(PlanError, match=message):
        mt.plan(MODEL, mesh(**axes), rules, **kwargs)


def test_attention_with_q_heads_split_and_k_v_whole_is_refused() -> None:
    """wq column-wise and wo row-wise with wk, wv replicated trains silently wrong (each rank
    would pair a shard of q's heads with all of k's and v's): refused while planning."""
    rules = Rules(
        {
            r"layers\.0\.attention\.wq\.weight": P("tp"),
            r"layers\.0\.attention\.wo\.weight": P(None, "tp"),
            r".*": P(),
        },
        fsdp="dp",
    )
    with pytest.raises(
        PlanError,
        match=r"'layers\.0\.attention\.wk' beside 'layers\.0\.attention\.wq' is replicated",
    ) as err:
        mt.plan(MODEL, mesh(dp=2, tp=2), rules)
    assert err.value.fqn == "layers.0.attention.wk.weight"


def test_a_model_that_is_not_ours() -> None:
    with torch.device("meta"):
        model = TiedMLP()
    rules = Rules(
        {
            r"blocks\.\d+\.0\.(weight|bias)": P("tp"),
            r"blocks\.\d+\.2\.weight": P(None, "tp"),
            r".*": P(),
        },
        fsdp="dp",
    )
    plan = mt.plan(model, mesh(dp=2, tp=2), rules)
    assert {s.fqn: s.style for s in plan.styles} == {
        "blocks.0": "prepare_input",
        "blocks.1": "prepare_input",
        "blocks.0.0": "colwise",
        "blocks.0.2": "rowwise",
        "blocks.1.0": "colwise",
        "blocks.1.2": "rowwise",
    }
    assert [u.fqn for u in plan.units] == ["blocks.0", "blocks.1", ""]
    assert "embed.weight" in plan.units[-1].params  # the tied weight appears once


def test_column_wise_linears_in_a_projection_module_pair_with_the_row_wise_one_beside_it() -> None:
    # torchtitan's attention keeps wq/wk/wv in a qkv module next to wo; pairing looks through such
    # modules (all of whose parameters are column-wise) to the parent that holds the row-wise one.
    plan = mt.plan(GroupedLM(), mesh(dp=2, tp=2), grouped_rules("dp"))
    styles = {s.fqn: s.style for s in plan.styles}
    assert styles["blocks.0.mixer"] == "prepare_input"
    assert styles["blocks.0.mixer.projections.gate"] == styles["blocks.1.mixer.projections.up"]
    assert styles["blocks.0.mixer.projections.up"] == "colwise"
    assert styles["blocks.1.mixer.down"] == "rowwise"
    assert "blocks.0.mixer.projections" not in styles
    # A module holding anything but column-wise Linears is not looked through: with the row-wise
    # 'down' replicated, the projections have no consumer and their outputs are gathered.
    unpaired = Rules({r".*projections\.(gate|up)\.weight": P("tp", None), r".*": P()}, fsdp="dp")
    styles = {s.fqn: s.style for s in mt.plan(GroupedLM(), mesh(dp=2, tp=2), unpaired).styles}
    assert styles["blocks.0.mixer.projections.gate"] == "colwise_gathered"
    assert "blocks.0.mixer" not in styles


@given(
    st.lists(st.sampled_from(["col", "row", "rep"]), min_size=3, max_size=3),
    st.sampled_from([0, 1, 2, 3]),
    st.sampled_from([(1, 2), (2, 2), (2, 1), (4, 2)]),
)
def test_any_mix_of_column_row_and_replicated_linears_plans(
    choice: list[str], zero: int, sizes: tuple[int, int]
) -> None:
    spec = {"col": P("tp", None), "row": P(None, "tp"), "rep": P()}
    rules = Rules(
        {
            r".*attention\.w[qkv]\.weight": spec[choice[0]],
            r".*attention\.wo\.weight": spec[choice[1]],
            r".*feed_forward\.w.\.weight": spec[choice[2]],
            r".*": P(),
        },
        fsdp="dp",
        allow_unused=True,
    )
    dp, tp = sizes
    try:
        plan = mt.plan(MODEL, mesh(dp=dp, tp=tp), rules, zero=zero)
    except PlanError as err:
        assert "tensor-parallel" in str(err) or "neither a data axis" in str(err)
        return
    assert Plan.from_json(plan.to_json()) == plan
    assert plan.memory.total > 0


SP_RULES = default_rules(sequence_parallel=True)


def test_sequence_parallelism_comes_from_the_seq_activation_rule() -> None:
    plan = mt.plan(MODEL, mesh(dp=2, tp=2), SP_RULES, batch_size=2, seq_len=8)
    assert plan.sequence_parallel
    styles = {s.fqn: s.style for s in plan.styles}
    assert styles["layers.0.attention_norm"] == styles["norm"] == "sequence_parallel"
    assert styles["layers.0.attention"] == styles["layers.1.feed_forward"] == "prepare_input"
    assert styles["layers.0.attention.wo"] == "rowwise"
    assert "reduce-scattered to sequence shards" in next(
        s.note for s in plan.styles if s.fqn == "layers.0.attention.wo"
    )
    assert Plan.from_json(plan.to_json()) == plan
    assert "with sequence parallelism" in plan.explain()
    # Without the activation rule the same parameter rules give plain tensor parallelism.
    assert not mt.plan(MODEL, mesh(dp=2, tp=2), default_rules()).sequence_parallel


def test_sequence_parallel_collectives_and_their_payloads() -> None:
    batch, seq, dim, vocab = 2, 8, 64, 256
    plan = mt.plan(MODEL, mesh(dp=1, tp=2), SP_RULES, microbatches=3, batch_size=batch, seq_len=seq)
    rows: dict[tuple[str, str], tuple[int, int]] = {}
    for c in plan.collectives:
        count, size = rows.get((c.kind, c.why.split(":")[0]), (0, 0))
        rows[(c.kind, c.why.split(":")[0])] = (count + c.count, size + c.bytes)
    act = batch * seq * 4  # bytes per feature of one fp32 activation
    # Per micro-batch: reduce-scatter of 2 row-wise outputs per block (width dim) + embedding;
    # all-gather of each pair parent's input (dim) + the head's input (dim), and the mirror
    # images in backward; norm weights' partial gradients once per step (no data axis).
    assert rows[("reduce_scatter", "forward")] == (3 * 5, 3 * 5 * dim * act)
    assert rows[("all_gather", "forward")] == (3 * 5, 3 * 5 * dim * act)
    assert rows[("reduce_scatter", "backward")] == (3 * 5, 3 * 5 * dim * act)
    assert rows[("all_gather", "backward")][0] == 3 * 5
    assert rows[
        ("all_reduce", "norm weights' partial gradients, one per parameter per gradient sync")
    ] == (
        5,
        5 * dim * 4,
    )
    gathered = mt.plan(
        MODEL, mesh(dp=1, tp=2), SP_RULES, loss_parallel=False, batch_size=1, seq_len=4
    )
    forward_gathers = [
        c for c in gathered.collectives if c.kind == "all_gather" and "forward" in c.why
    ]
    assert sum(c.count for c in forward_gathers) == 5 + 1  # + the gathered logits
    assert sum(c.bytes for c in forward_gathers) == 4 * 4 * (5 * dim + vocab)


def test_activation_collectives_are_unsized_without_a_batch_shape() -> None:
    plan = mt.plan(MODEL, mesh(tp=2), default_rules(fsdp=None))
    tp_rows = [c for c in plan.collectives if c.axis == "tp"]
    assert tp_rows and all(c.bytes == 0 and "give batch_size and seq_len" in c.why for c in tp_rows)


@pytest.mark.parametrize(
    ("rules", "kwargs", "message"),
    [
        (
            SP_RULES,
            {"seq_len": 9},
            r"seq_len=9 does not divide over tensor-parallel axis 'tp' of size 2",
        ),
        (
            Rules(logical=(*default_rules().logical, ("seq", "dp")), fsdp="dp"),
            {},
            r"maps the sequence dim to \['dp'\] .* context parallelism",
        ),
        (
            Rules(
                {
                    r".*attention\.w[qkv]\.weight": P(),
                    r".*attention\.wo\.weight": P(None, "tp"),
                    r".*": P(),
                },
                logical=(("seq", "tp"),),
                fsdp="dp",
            ),
            {},
            r"'layers.0.attention.wo' .* 'rowwise_replicated_input', which has no sequence-parallel form",
        ),
        ({**{}}, {"batch_size": 0}, r"batch_size=0 must be a positive integer"),
    ],
)
def test_bad_sequence_parallel_plans(rules: object, kwargs: dict, message: str) -> None:
    rules = rules if isinstance(rules, Rules) else SP_RULES
    with pytest.raises(PlanError, match=message):
        mt.plan(MODEL, mesh(dp=2, tp=2), rules, **kwargs)


def test_sequence_parallelism_gathers_before_a_replicated_head() -> None:
    """No column-wise head: the sequence is gathered at the model's tail (its last module with
    parameters outside the blocks), which runs whole; a model whose parameters after the blocks
    are all tensor-parallel has no tail and is refused."""
    rules = Rules(
        {r"output\.weight": P(), r"tok_embeddings\.weight": P()},
        logical=default_rules(sequence_parallel=True).logical,
        fsdp="dp",
    )
    plan = mt.plan(MODEL, mesh(dp=2, tp=2), rules)
    styles = {s.fqn: s.style for s in plan.styles}
    assert styles["output"] == "sequence_gathered_tail" and styles["norm"] == "sequence_parallel"
    gathers = [c for c in plan.collectives if "tail" in c.why]
    assert [(c.kind, c.axis, c.count) for c in gathers] == [("all_gather", "tp", 1)]


def test_sequence_parallelism_needs_an_input_embedding() -> None:
    with torch.device("meta"):
        model = torch.nn.Sequential(
            torch.nn.LayerNorm(8),
            torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)),
        )
    rules = Rules(
        {r"1\.0\.weight|1\.0\.bias": P("tp"), r"1\.1\.weight": P(None, "tp"), r".*": P()},
        logical=(("seq", "tp"),),
    )
    with pytest.raises(PlanError, match=r"needs the model to start from an nn.Embedding"):
        mt.plan(model, mesh(tp=2), rules)


def test_sequence_parallel_embedding_inputs_are_checked_on_forward() -> None:
    from meshtrain.lower.tensor.parallel import _check_sequence

    embedding = torch.nn.Embedding(8, 4)
    _check_sequence("pos", "tp", 2, embedding, (torch.zeros(2, 6, dtype=torch.long),))
    with pytest.raises(PlanError, match=r"input of 'pos' has shape 6, but sequence parallelism"):
        _check_sequence("pos", "tp", 2, embedding, (torch.zeros(6, dtype=torch.long),))
    with pytest.raises(PlanError, match=r"sequence length 5 .* does not divide over"):
        _check_sequence("tok", "tp", 2, embedding, (torch.zeros(2, 5, dtype=torch.long),))


def test_a_new_plan_field_is_one_declaration_its_json_and_report_follow() -> None:
    """A field declared with its JSON codec and report section (meshtrain/plan/codec.py) is
    written by ``to_json``, read by ``from_json`` and shown by ``explain`` in its section's place
    with no other edit; a plan written before it existed reads back with the field's default."""
    import dataclasses
    import json

    from meshtrain.plan.codec import STRINGS, Section, json_field

    hosts_section = Section(
        6.5, lambda plan: [f"hosts: {', '.join(plan.hosts)}"] if plan.hosts else []
    )

    @dataclasses.dataclass(frozen=True)
    class Wider(Plan):
        hosts: tuple[str, ...] = json_field(STRINGS, explain=hosts_section, default=())

    plan = mt.plan(MODEL, mesh(dp=2, tp=2), default_rules())
    fields = {field.name: getattr(plan, field.name) for field in dataclasses.fields(Plan)}
    wider = Wider(**fields, hosts=("node-a", "node-b"))
    text = wider.to_json()
    assert json.loads(text)["hosts"] == ["node-a", "node-b"]
    assert Wider.from_json(text) == wider
    assert Wider.from_json(plan.to_json()) == Wider(**fields)
    report = wider.explain()
    assert "\n\nhosts: node-a, node-b\n" in report  # a section of its own
    # after the collectives (order 6), before what follows them; nothing else moved
    assert report.index("collectives per step") < report.index("hosts:")
    assert report.replace("\n\nhosts: node-a, node-b", "") == plan.explain()
    assert Wider(**fields).explain() == plan.explain()  # an empty section prints nothing


def test_every_plan_field_names_the_report_section_that_shows_it() -> None:
    """``explain()`` is built from the fields' declarations: each names its section; only the
    user's own logical-axis rules are left out of the report, on purpose."""
    import dataclasses

    from meshtrain.plan.codec import EXPLAIN, UNSHOWN

    unshown = [f.name for f in dataclasses.fields(Plan) if f.metadata[EXPLAIN] is UNSHOWN]
    assert unshown == ["activation_rules"]
