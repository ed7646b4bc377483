"""The balance loss over a batch split between ranks, in one process: each rank's share computed
with a count reducer that adds the other ranks' counts (what the all-reduce gives) averages to
the whole batch's loss, and the shares' gradients average to the whole batch's gradient, for
uneven splits too; transformers' own balance loss refused at plan time where it would be each
rank's."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from moe_models import mixtral

import meshtrain as mt
from meshtrain.errors import PlanError
from meshtrain.models.moe_experts import load_balance_loss


def _routing(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    scores = logits.softmax(-1)
    return scores, torch.topk(scores, top_k, dim=-1).indices


@settings(max_examples=10, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    sizes=st.lists(st.integers(1, 12), min_size=1, max_size=4),
    experts=st.integers(2, 8),
    top_k=st.integers(1, 2),
)
def test_rank_shares_average_to_the_whole_batch(
    seed: int, sizes: list[int], experts: int, top_k: int
) -> None:
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(sum(sizes), experts, generator=generator, dtype=torch.float64)
    whole = logits.clone().requires_grad_(True)
    expected = load_balance_loss(*_routing(whole, top_k), experts)
    (expected_grad,) = torch.autograd.grad(expected, whole)
    parts = [part.clone().requires_grad_(True) for part in logits.split(sizes)]
    packed = []  # what each rank hands the all-reduce: its counts, its tokens, 1
    for part in parts:
        _, index = _routing(part, top_k)
        counts = torch.bincount(index.flatten(), minlength=experts)
        packed.append(torch.cat([counts, counts.new_tensor([part.shape[0], 1])]))
    total = torch.stack(packed).sum(0)
    shares = [load_balance_loss(*_routing(part, top_k), experts, lambda _: total) for part in parts]
    mean = torch.stack(shares).mean()
    torch.testing.assert_close(mean, expected, rtol=1e-12, atol=1e-12)
    grads = torch.autograd.grad(mean, parts)  # the data-parallel mean of each rank's gradient
    torch.testing.assert_close(torch.cat(grads), expected_grad, rtol=1e-12, atol=1e-12)


def test_transformers_router_logits_are_refused_when_the_batch_is_split() -> None:
    model = mixtral()
    model.config.output_router_logits = True
    rules = mt.Rules({".*": mt.P()}, fsdp="dp")
    with pytest.raises(
        PlanError, match=r"MixtralForCausalLM has config\.output_router_logits=True"
    ):
        mt.plan(model, mt.make_mesh({"dp": 2}, world_size=2, abstract=True), rules)
    model.config.output_router_logits = False
    assert mt.plan(model, mt.make_mesh({"dp": 2}, world_size=2, abstract=True), rules)
