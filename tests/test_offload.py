"""Optimizer-state offload in one process: stepping one parameter at a time with states kept on
the host gives the optimizer's own update, bit for bit; the class name and state dict are
unchanged (checkpoints load either way); optimizers that are not element-wise are refused."""

from __future__ import annotations

import copy

import pytest
import torch

import meshtrain as mt
from meshtrain.train.offload import offload_states


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.1),
        lambda ps: torch.optim.Adam(ps, lr=1e-2),
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    ],
)
def test_offloaded_steps_equal_the_optimizer_bitwise(make) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(7))]
    twins = copy.deepcopy(params)
    plain, offloaded = make(params), offload_states(make(twins))
    for _ in range(3):
        for a, b in zip(params, twins):
            a.grad = torch.randn_like(a)
            b.grad = a.grad.clone()
        plain.step()
        offloaded.step()
    for a, b in zip(params, twins):
        assert torch.equal(a, b)
    assert type(offloaded).__name__ == type(plain).__name__
    assert str(offloaded.state_dict()) == str(plain.state_dict())
    assert all(group["params"] for group in offloaded.param_groups)


def test_parameters_without_gradients_are_skipped() -> None:
    frozen, trained = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    optimizer = offload_states(torch.optim.AdamW([frozen, trained], lr=0.1))
    trained.grad = torch.ones(2)
    optimizer.step()
    assert frozen not in optimizer.state and "exp_avg" in optimizer.state[trained]


def test_non_elementwise_optimizers_are_refused() -> None:
    optimizer = torch.optim.Adagrad([torch.nn.Parameter(torch.ones(2))])
    with pytest.raises(
        mt.PlanError, match=r"exact for element-wise optimizers only .* got Adagrad"
    ):
        offload_states(optimizer)


def test_offloading_twice_changes_nothing() -> None:
    optimizer = offload_states(torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))]))
    cls = type(optimizer)
    assert offload_states(optimizer) is optimizer and type(optimizer) is cls
