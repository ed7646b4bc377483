"""Predicted = measured: the all-to-all bytes expert parallelism's lowering really sends on 2 gloo
ranks, for a routing the test fixes, against :mod:`meshtrain.plan.experts.cost`'s prediction."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import meshtrain as mt
from meshtrain.lower.experts.parallel import apply_expert_parallel
from meshtrain.models.moe import MoEConfig, build_moe, default_rules
from meshtrain.models.moe_experts import GroupedExperts
from meshtrain.plan.experts.cost import (
    ExpertLayer,
    all_to_all_collectives,
    estimate_expert_collectives,
)
from meshtrain.testing.comms import CollectiveCounter
from meshtrain.testing.runner import get_pool

pytestmark = pytest.mark.spmd

EXPERTS, TOP_K, HIDDEN, INTER, TOKENS = 4, 2, 8, 4, 8


class FixedRouting(nn.Module):
    """Experts behind a routing the test chooses: ``uniform`` sends each token to one expert on
    each of the 2 ranks (experts t % 2 and 2 + t % 2); ``skewed`` sends the first half of the
    tokens to two experts of rank 0 (t % 2 and 1 - t % 2), the rest as ``uniform``: rank 0
    receives 24 rows of the 32, 1.5 times the mean."""

    def __init__(self, routing: str) -> None:
        super().__init__()
        self.config = SimpleNamespace(top_k=TOP_K)  # where the planner reads experts per token
        self.experts = GroupedExperts(EXPERTS, HIDDEN, INTER, kernel="loop")
        t = torch.arange(TOKENS)
        second = 2 + t % 2 if routing == "uniform" else torch.where(t < 4, 1 - t % 2, 2 + t % 2)
        pairs = (t % 2, second)
        self.register_buffer("index", torch.stack(pairs, dim=1), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.index, torch.full((TOKENS, TOP_K), 0.5))


def measure(routing: str) -> tuple[tuple[int, int], tuple[int, int]]:
    """On every rank: one forward and backward counted; the all-to-alls' count and bytes, and
    the plan's own (uniform routing)."""
    torch.manual_seed(0)
    model = FixedRouting(routing)
    for weight in (model.experts.gate_up_proj, model.experts.down_proj):
        nn.init.normal_(weight, std=0.1)
    mesh = mt.make_mesh(ep=2)
    rules = mt.Rules({r"experts\..*": mt.P("ep", None, None)}, fsdp=())
    plan = mt.plan(model, mesh, rules, batch_size=1, seq_len=TOKENS)
    apply_expert_parallel(plan, model)
    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(1), requires_grad=True)
    counter = CollectiveCounter(mesh)
    with counter:
        model(x).square().sum().backward()
    key = ("all_to_all", "ep")
    return (counter.counts[key], counter.bytes[key]), plan.collective_totals()[key]


def predicted(routing: str, max_load: float | None = None) -> tuple[int, int]:
    layer = ExpertLayer.swiglu(
        "experts", num_experts=EXPERTS, top_k=TOP_K, hidden=HIDDEN, inter=INTER
    )
    rows = all_to_all_collectives(
        [layer],
        axis="ep",
        ep=2,
        tokens=TOKENS,
        routing=routing,  # type: ignore[arg-type]
        max_load=max_load,
    )
    return sum(c.count for c in rows), sum(c.bytes for c in rows)


def test_uniform_routing_sends_the_predicted_bytes_on_every_rank() -> None:
    results = get_pool(2).run(measure, "uniform")
    # by hand: 16 rows of 8 fp32 = 512 B per token all-to-all, 4 of them; the tokens per
    # expert, 4 int64 = 32 B
    assert predicted("uniform") == (5, 4 * 512 + 32)
    assert results == [(predicted("uniform"), predicted("uniform"))] * 2


def test_a_skewed_routing_meets_its_max_load_bound_on_the_busiest_rank() -> None:
    results = [measured for measured, _ in get_pool(2).run(measure, "skewed")]
    # rank 0 receives 24 rows (payload: 24 of 8 fp32 = 768 B per token all-to-all), and the
    # tokens per expert (4 int64) as every rank
    assert predicted("worst", max_load=1.5) == (5, 4 * 768 + 8 * 4)
    assert results[0] == predicted("worst", max_load=1.5)
    # rank 1 sends 16 and receives 8: its buffers are the uniform ones
    assert results[1] == predicted("uniform")
    # the dropless bound (every row to rank 0: 32) is above both
    assert predicted("worst")[1] > results[0][1]


def measure_moe_step() -> tuple[dict, dict, dict, tuple[int, int]]:
    """On every rank of dp 2 × ep 2: meshtrain's debug MoE, one counted step (after a warm-up)
    with its own router; the counts and bytes measured, the plan's, and the worst case's."""
    model = build_moe(MoEConfig.debug(), seed=0)
    mesh = mt.make_mesh(dp=2, ep=2)
    plan = mt.plan(
        model, mesh, default_rules(tp=None, fsdp="dp", ep="ep"), zero=3, batch_size=2, seq_len=8
    )
    mt.apply(plan, model)
    tokens = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))

    def step() -> None:
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten(), reduction="sum").backward()

    step()
    model.zero_grad()
    counter = CollectiveCounter(mesh)
    with counter:
        step()
    worst = estimate_expert_collectives(
        plan.experts, plan.params, "ep", 2, plan.options, routing="worst"
    )
    return (
        dict(counter.counts),
        dict(counter.bytes),
        plan.collective_totals(),
        (sum(c.count for c in worst), sum(c.bytes for c in worst)),
    )


def test_an_moe_step_on_dp2_ep2_meets_the_plan() -> None:
    for counts, sent, plan, worst in get_pool(4).run(measure_moe_step):
        key = ("all_to_all", "ep")
        # FSDP: experts units over dp, the rest over dp+ep, and the routers' count all-reduces
        # (one per MoE layer: 2 of 8 + 2 int64), exactly as planned
        assert {k: (counts[k], sent[k]) for k in counts if k != key} == {
            k: v for k, v in plan.items() if k != key
        }
        assert plan[("all_reduce", "dp+ep")] == (2, 2 * 80)
        # the router's own routing: as many all-to-alls as planned; each payload is the larger
        # of the rank's send (its T·k rows, the uniform figure) and receive buffers, so the
        # bytes lie between the uniform prediction and the dropless worst case
        assert counts[key] == plan[key][0] == worst[0]
        assert plan[key][1] <= sent[key] <= worst[1]
