"""Context parallelism costed: activations per rank divide by cp, and the bytes the plan predicts
for context attention are the bytes its kernel sends on gloo ranks, exactly."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import meshtrain as mt
from meshtrain import Rules
from meshtrain.models import LlamaConfig, build_llama, default_rules
from meshtrain.plan.context.cost import (
    TILE_K,
    TILE_Q,
    allgather_saved,
    attention_collectives,
    kv_bytes,
    ring_in_flight,
)
from meshtrain.plan.memory.activations import AttentionCall, trace_activations
from meshtrain.testing.runner import get_pool

BLOCKS = ("layers.0", "layers.1")


def _context_plan(cp: int, seq_len: int = 64, **options: object) -> mt.Plan:
    model = build_llama(LlamaConfig.debug(), device="meta")
    mesh = mt.make_mesh(dp=2, cp=cp, world_size=2 * cp, abstract=True)
    logical = default_rules(tp=None).logical + ((("seq", "cp"),) if cp > 1 else ())
    return mt.plan(
        model, mesh, Rules(logical=logical, fsdp="dp"), batch_size=2, seq_len=seq_len, **options
    )  # type: ignore[arg-type]


def test_the_trace_records_each_attentions_query_keys_and_values() -> None:
    model = build_llama(LlamaConfig.debug(), device="meta")
    profile = trace_activations(model, BLOCKS, batch_size=2, seq_len=32)
    # debug Llama: 4 query heads, 2 key/value heads (unrepeated), head_dim 16
    expected = AttentionCall((2, 4, 32, 16), (2, 2, 32, 16), (2, 2, 32, 16), 4)
    assert [b.attention for b in profile.blocks] == [(expected,), (expected,)]


@pytest.mark.parametrize("cp", [2, 4])
def test_activations_per_rank_are_one_cp_th_plus_one_layers_ring(cp: int) -> None:
    whole, split = _context_plan(1), _context_plan(cp)
    profile = split.activation_estimates  # per mode, each with the ring's transient
    model = build_llama(LlamaConfig.debug(), device="meta")
    local = trace_activations(model, BLOCKS, batch_size=2, seq_len=64 // cp)
    transient = ring_in_flight(local, cp, "ring")
    assert transient > 0
    # beyond SDPA, each layer keeps the ring's fp32 output [2, 4, 64 / cp, 16] once more: in
    # every layer without checkpointing, in the one recomputed block with it
    extra, layers = 2 * 4 * (64 // cp) * 16 * 4, {"none": 2, "full": 1, "selective": 1}
    for (mode, at_cp), (_, at_one) in zip(profile, whole.activation_estimates):
        assert at_one % cp == 0
        assert at_cp == at_one // cp + transient + layers[mode] * extra, mode


@pytest.mark.parametrize("local", [16, 512, 2048])
def test_the_rings_transient_holds_one_tile_of_scores_at_any_length(local: int) -> None:
    """The kernel's default tile is the plan's; the scores the ring's transient counts are three
    fp32 [B, Hq, tq, tk] tensors, the tile clipped to S_local: flat once S_local passes it."""
    from meshtrain.lower.context.attention_blocks import DEFAULT_TILE

    assert (DEFAULT_TILE.q, DEFAULT_TILE.k) == (TILE_Q, TILE_K) == (512, 512)
    model = build_llama(replace(LlamaConfig.debug(), max_seq_len=local), device="meta")
    profile = trace_activations(model, BLOCKS, batch_size=2, seq_len=local)
    side = min(local, 512)
    scores = ring_in_flight(profile, 4, "ring") - ring_in_flight(profile, 4, "ring", scores=False)
    assert scores == 3 * 2 * 4 * side * side * 4
    # besides: k, v stacked and arriving (fp32 debug model), three fp32 gradients of them, and
    # the fp32 query gradient with one block's share of it
    kv, q = 2 * 2 * 2 * local * 16 * 4, 2 * 4 * local * 16 * 4
    assert ring_in_flight(profile, 4, "ring", scores=False) == 2 * kv + 3 * kv + 2 * q


def test_allgather_keeps_each_layers_whole_sequence_attention() -> None:
    ring = _context_plan(4, context_method="ring")
    gathered = _context_plan(4, context_method="allgather")
    model = build_llama(LlamaConfig.debug(), device="meta")
    local = trace_activations(model, BLOCKS, batch_size=2, seq_len=16)
    call = local.blocks[0].attention[0]
    in_flight = ring_in_flight(local, 4, "ring")
    # two layers, each keeping keys and values of all 64 tokens, probabilities and the mask
    per_layer = 4 * kv_bytes(call) + 2 * (2 * 4 * 16 * 64 * 4) + 2 * 16 * 64
    assert allgather_saved(call, 4) == per_layer
    ring_output = 2 * 4 * 16 * 16 * 4  # the ring's extra fp32 output per layer (none: 2 layers)
    assert gathered.memory.activations == (
        ring.memory.activations - in_flight - 2 * ring_output + 2 * per_layer
    )


def test_bf16_ring_saves_its_output_in_fp32() -> None:
    fp32 = _context_plan(2, precision="fp32", zero=3)
    bf16 = _context_plan(2, precision="bf16", zero=3)
    assert bf16.memory.activations < fp32.memory.activations
    assert any(c.axis == "cp" and c.kind == "send/recv" for c in bf16.collectives)


def test_the_plan_lists_context_collectives_and_recomputed_forward_traffic() -> None:
    plain = {c.why: c for c in _context_plan(4).collectives if c.axis == "cp"}
    again = {
        c.why: c
        for c in _context_plan(4, activation_checkpointing="full").collectives
        if c.axis == "cp"
    }
    forward = next(why for why in plain if why.startswith("forward"))
    backward = next(why for why in plain if why.startswith("backward"))
    assert again[forward].bytes == 2 * plain[forward].bytes
    assert again[backward] == plain[backward]
    assert not [c for c in _context_plan(1).collectives if c.axis == "cp"]


def test_auto_chooses_context_parallelism_when_nothing_else_fits() -> None:
    from meshtrain.plan.auto.search import choose_plan
    from meshtrain.plan.options import AutoSearch, PlanOptions

    # one head, one block: neither tensor nor pipeline parallelism can split it
    config = LlamaConfig(
        dim=64,
        n_layers=1,
        n_heads=1,
        n_kv_heads=1,
        vocab_size=8192,
        multiple_of=32,
        max_seq_len=4096,
    )
    model = build_llama(config, device="meta")
    request = PlanOptions(global_batch=4, seq_len=4096)

    def choose(mib: int) -> object:
        return choose_plan(
            model,
            4,
            default_rules(),
            request,
            search=AutoSearch(device_memory=mib * 2**20),
            device_type="cuda",
        )

    roomy, tight = choose(40), choose(36)
    assert roomy.plan.context_axis is None  # type: ignore[attr-defined]
    # cp 2 suffices: its ring holds one 512 x 512 tile of scores, not [1, 1, 2048, 2048] ones
    assert tight.plan.context_axis == "cp" and tight.chosen.candidate.cp == 2  # type: ignore[attr-defined]
    assert tight.plan.memory.total <= 36 * 2**20 < roomy.plan.memory.total  # type: ignore[attr-defined]


# --- predicted = measured, on gloo ranks --------------------------------------------------------


def _traced_calls(dtype: torch.dtype, seq_local: int) -> list[AttentionCall]:
    model = build_llama(LlamaConfig.debug(), device="meta")
    profile = trace_activations(model, BLOCKS, batch_size=2, seq_len=seq_local, dtype=dtype)
    return [call for block in profile.blocks for call in block.attention]


_GROUPS: dict[int, object] = {}


def _group(cp: int) -> object:
    """This rank's context group of ``cp`` consecutive ranks (created once per pool)."""
    import torch.distributed as dist

    if cp not in _GROUPS:
        world = dist.get_world_size()
        groups = [dist.new_group(list(range(s, s + cp))) for s in range(0, world, cp)]
        _GROUPS[cp] = groups[dist.get_rank() // cp]
    return _GROUPS[cp]


def measure_bytes(
    calls: list[AttentionCall], cp: int, method: str, documents: bool, balance: str
) -> dict[str, int]:
    """Runs on every rank: each traced call's context attention, forward and backward, counted."""
    import torch.distributed as dist

    from meshtrain.lower.context.layout import chunk_positions
    from meshtrain.lower.context.ring_attention import context_attention, count_bytes

    group = _group(cp)
    rank = dist.get_rank(group)  # type: ignore[arg-type]
    generator = torch.Generator().manual_seed(dist.get_rank())
    dtype = {2: torch.bfloat16, 4: torch.float32}
    with count_bytes() as sent:
        for call in calls:
            q, k, v = (
                torch.randn(shape, generator=generator)
                .to(dtype[call.element_bytes])
                .requires_grad_()
                for shape in (call.query, call.key, call.value)
            )
            seq = call.key[2]
            docs = (torch.arange(seq)[None].expand(call.key[0], seq) // 8) if documents else None
            positions = chunk_positions(seq * cp, cp, rank, balance)  # type: ignore[arg-type]
            out = context_attention(
                q,
                k,
                v,
                group=group,
                positions_q=positions,  # type: ignore[arg-type]
                documents=docs,
                method=method,
            )  # type: ignore[arg-type]
            out.float().sum().backward()
    return dict(sent.counts)


def _predicted(calls: list[AttentionCall], cp: int, method: str, documents: bool) -> dict[str, int]:
    metadata, forward, backward = attention_collectives(
        calls, cp=cp, axis="cp", method=method, documents=documents
    )
    return {"metadata": metadata.bytes, "forward": forward.bytes, "backward": backward.bytes}


def _measured(counts: dict[str, int]) -> dict[str, int]:
    return {
        "metadata": counts.get("metadata", 0),
        "forward": counts.get("forward/kv", 0),
        "backward": counts.get("backward/kv", 0) + counts.get("backward/dkv", 0),
    }


@pytest.mark.spmd
@pytest.mark.parametrize(
    ("cp", "method", "dtype", "documents", "balance"),
    [
        (4, "ring", torch.float32, False, "headtail"),
        (2, "ring", torch.bfloat16, True, "contiguous"),
        (4, "allgather", torch.bfloat16, False, "headtail"),
        (2, "allgather", torch.float32, True, "headtail"),
    ],
)
def test_predicted_bytes_are_the_kernels_measured_bytes(
    cp: int, method: str, dtype: torch.dtype, documents: bool, balance: str
) -> None:
    calls = _traced_calls(dtype, seq_local=16)
    counts = get_pool(4).run(measure_bytes, calls, cp, method, documents, balance)
    predicted = _predicted(calls, cp, method, documents)
    assert predicted["forward"] > 0 and predicted["backward"] > 0
    for rank, rank_counts in enumerate(counts):
        assert _measured(rank_counts) == predicted, rank


_CONTEXT_TRAFFIC = ("positions", "forward: keys", "backward: keys")


def measure_step(cp: int, checkpointing: str, precision: str, other: str = "") -> tuple[dict, dict]:
    """Runs on every rank: one training step of a tiny Llama under dp × cp (or tp × cp, or
    pp × cp with ``other``), its context attention's bytes counted, beside what its plan
    predicts for that traffic."""
    from context_models import SEQ, batches, own_llama, rules

    from meshtrain.lower.context.ring_attention import count_bytes
    from meshtrain.train import Batch, forward_backward

    model = own_llama()
    axes = {"pp": 4 // cp, "dp": 1} if other == "pp" else {"dp": 4 // cp}
    if other == "tp":
        axes = {"dp": 1, "tp": 4 // cp}
    mesh = mt.make_mesh(**axes, cp=cp)
    chosen = rules()
    if other == "tp":
        chosen = mt.Rules(logical=(("seq", "cp"), *default_rules(tp="tp").logical), fsdp="dp")
    pipeline = {"pipeline": mt.Pipeline(axis="pp", schedule="1F1B")} if other == "pp" else {}
    plan = mt.plan(
        model,
        mesh,
        chosen,
        global_batch=4,
        seq_len=SEQ,
        activation_checkpointing=checkpointing,
        precision=precision,
        **pipeline,
    )
    model = mt.apply(plan, model)
    inputs, targets = batches(0)
    data_rank = mesh.coordinates(torch.distributed.get_rank())["dp"]
    per_rank = 4 // mesh.size("dp")
    rows = slice(per_rank * data_rank, per_rank * (data_rank + 1))
    batch = Batch(inputs[rows], targets[rows])
    forward_backward(plan, model, batch)  # a pipeline's first step also infers its shapes
    with count_bytes() as sent:
        forward_backward(plan, model, batch)
    predicted = {
        prefix: sum(c.bytes for c in plan.collectives if c.why.startswith(prefix))
        for prefix in _CONTEXT_TRAFFIC
    }
    return predicted, dict(sent.counts)


@pytest.mark.spmd
@pytest.mark.parametrize(
    ("cp", "checkpointing", "precision", "other"),
    [
        (4, "full", "fp32", ""),
        (2, "selective", "bf16", ""),
        (2, "none", "fp32", "tp"),
        (2, "none", "fp32", "pp"),
    ],
)
def test_a_training_steps_context_bytes_are_the_plans(
    cp: int, checkpointing: str, precision: str, other: str
) -> None:
    for rank, (predicted, counts) in enumerate(
        get_pool(4).run(measure_step, cp, checkpointing, precision, other)
    ):
        measured = _measured(counts)
        assert predicted["forward: keys"] > 0
        assert measured == {
            "metadata": predicted["positions"],
            "forward": predicted["forward: keys"],
            "backward": predicted["backward: keys"],
        }, rank
