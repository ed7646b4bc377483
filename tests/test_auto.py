"""strategy="auto": the chosen plan fits what it claims and no cheaper candidate fits (tier 1)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import meshtrain as mt
from meshtrain import PlanError
from meshtrain.errors import MeshtrainError
from meshtrain.models import LlamaConfig, build_llama, default_rules
from meshtrain.plan.auto.search import (
    MODES,
    Candidate,
    Links,
    _microbatches,
    _options,
    candidates,
    choose_plan,
    step_cost,
)
from meshtrain.plan.options import AutoSearch, Precision

MODEL = build_llama(LlamaConfig.preset("debug", n_layers=4), device="meta")
RULES = default_rules()


def every_candidate(world: int, global_batch: int, seq_len: int) -> list[tuple[int, float]]:
    """(peak bytes, cost) of every candidate, each planned in full by mt.plan (no shortcuts)."""
    result = []
    for pp, dp, tp in candidates(world, 8, 4):
        mesh = mt.make_mesh({"pp": pp, "dp": dp, "tp": tp}, world_size=world, abstract=True)
        for micro in _microbatches(pp, dp, global_batch):
            for zero in range(4):
                for mode in MODES:
                    c = Candidate(pp, dp, tp, zero, mode, micro)
                    try:
                        shared = mt.PlanOptions(seq_len=seq_len)
                        plan = mt.plan(MODEL, mesh, RULES, _options(c, global_batch, shared))
                    except MeshtrainError:
                        continue
                    cost = step_cost(plan, 8, Links(), global_batch * seq_len)
                    result.append((plan.memory.total, cost))
    return result


@settings(max_examples=6, deadline=None)
@given(
    world=st.sampled_from([2, 4, 8]),
    global_batch=st.sampled_from([8, 16]),
    memory=st.integers(400_000, 8_000_000),
)
def test_auto_fits_what_it_claims_and_nothing_cheaper_fits(
    world: int, global_batch: int, memory: int
) -> None:
    everything = every_candidate(world, global_batch, 32)
    fitting = [(peak, cost) for peak, cost in everything if peak <= memory]
    try:
        request = mt.PlanOptions(global_batch=global_batch, seq_len=32)
        choice = choose_plan(MODEL, world, RULES, request, search=AutoSearch(memory))
    except PlanError as error:
        assert not fitting, f"auto found nothing but {len(fitting)} candidates fit: {error}"
        assert "Use devices of at least" in error.message
        return
    plan = choice.plan
    assert plan.memory.total == choice.chosen.peak_bytes
    assert plan.memory.total <= memory
    assert plan.mesh.world_size == world
    cost = step_cost(plan, 8, Links(), global_batch * 32)
    assert cost == pytest.approx(choice.chosen.cost_s)
    cheapest = min(c for _, c in fitting)
    assert cost <= cheapest * (1 + 1e-9), "a cheaper candidate also fits"
    assert plan.notes[0].startswith("strategy auto on") and "strategy auto" in plan.explain()


def test_the_textbook_ladder() -> None:
    def chosen(memory: int) -> tuple[int, int, int, int, str]:
        plan = mt.plan(
            MODEL,
            mt.make_mesh(dp=8, world_size=8, abstract=True),
            RULES,
            strategy="auto",
            device_memory=memory,
            global_batch=16,
            seq_len=32,
        )
        mesh = plan.mesh.shape
        return (
            mesh["pp"],
            mesh["dp"],
            mesh["tp"],
            plan.options.zero,
            plan.options.activation_checkpointing,
        )

    assert chosen(100_000_000) == (1, 8, 1, 0, "none")  # fits one device: DDP
    tight = chosen(4_000_000)
    assert tight[:3] == (1, 8, 1) and (tight[3] >= 1 or tight[4] != "none")
    tighter = chosen(1_000_000)
    assert tighter[0] > 1 or tighter[2] > 1  # tensor or pipeline parallel only when needed


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_zero1_against_ddp_on_the_wire(precision: Precision) -> None:
    # fp32: DDP's all-reduce moves the bytes of ZeRO-1's all-gather + reduce-scatter in half the
    # collectives, so DDP is cheaper. bf16 compute with fp32 reduction: ZeRO-1 gathers bf16
    # parameters (6 bytes/parameter on the wire against DDP's 8) — the documented deviation.
    seven_b = build_llama(
        LlamaConfig(
            dim=4096,
            n_layers=32,
            n_heads=32,
            n_kv_heads=32,
            vocab_size=32000,
            multiple_of=256,
            ffn_dim_multiplier=None,
        ),
        device="meta",
    )
    mesh = mt.make_mesh(pp=1, dp=8, tp=1, world_size=8, abstract=True)
    cost = {
        zero: step_cost(
            mt.plan(seven_b, mesh, RULES, zero=zero, precision=precision), 8, Links(), 0
        )
        for zero in (0, 1)
    }
    assert (cost[1] < cost[0]) == (precision == "bf16")


def test_auto_refuses_what_it_chooses_and_needs_the_memory() -> None:
    mesh = mt.make_mesh(dp=8, world_size=8, abstract=True)
    with pytest.raises(PlanError, match=r"chooses microbatches=4 itself"):
        mt.plan(
            MODEL,
            mesh,
            RULES,
            strategy="auto",
            device_memory=10**9,
            global_batch=16,
            seq_len=32,
            microbatches=4,
        )
    with pytest.raises(PlanError, match=r"needs device_memory"):
        mt.plan(MODEL, mesh, RULES, strategy="auto", global_batch=16, seq_len=32)


def test_impossible_requests_name_what_would_work() -> None:
    mesh = mt.make_mesh(dp=4, world_size=4, abstract=True)
    with pytest.raises(PlanError) as error:
        mt.plan(
            MODEL, mesh, RULES, strategy="auto", device_memory=600_000, global_batch=16, seq_len=32
        )
    message = error.value.message
    assert "does not fit 4 devices" in message and "Use devices of at least" in message
    assert "or at least 64 devices of this memory" in message
    with pytest.raises(PlanError, match=r"no candidate mesh can be planned.*does not split"):
        mt.plan(
            MODEL,
            mt.make_mesh(dp=3, world_size=3, abstract=True),
            RULES,
            strategy="auto",
            device_memory=10**9,
            global_batch=16,
            seq_len=32,
        )


def test_cli_plan_strategy_auto(capsys: pytest.CaptureFixture[str]) -> None:
    from meshtrain.cli import main

    assert (
        main(["plan", "debug", "--world", "8", "--strategy", "auto", "--device-memory", "1GiB"])
        == 0
    )
    out = capsys.readouterr().out
    assert "strategy auto on 8 devices" in out and "fits in 1.00 GiB" in out
    assert out.index("searching layouts for 8 ranks") < out.index("strategy auto on 8 devices")
    assert main(["plan", "debug", "--world", "8", "--strategy", "auto"]) == 2
    assert "needs the memory per device" in capsys.readouterr().err


def test_a_long_search_says_how_it_goes() -> None:
    from meshtrain.plan.auto.search import reported
    from meshtrain.plan.options import AutoSearch

    class Layout:
        def __init__(self, fits: bool) -> None:
            self._fits = fits

        def fits(self, device_memory: int) -> bool:
            return self._fits

    said: list[str] = []
    search = AutoSearch(2**30, progress=said.append)
    layouts = [Layout(True), Layout(False), Layout(True)]
    assert list(reported(layouts, search, 4096, every_s=0.0)) == layouts  # type: ignore[arg-type]
    assert said[0] == "searching layouts for 4,096 ranks"
    assert [line.split(" in ")[0] for line in said[1:]] == [
        "  1 layouts planned",
        "  2 layouts planned",
        "  3 layouts planned",
    ]
    assert said[-1].endswith(", 2 fit")
    assert AutoSearch(2**30, progress=print) == AutoSearch(2**30)  # not part of the request
