"""Clipping on one process (tier 1, no ranks): ``meshtrain.train.clip_grad_norm_`` gives the norm
and the clipped gradients of ``torch.nn.utils.clip_grad_norm_`` on a plain model — with a norm
above ``max_norm`` (scaled down) and below it (left alone, never scaled up)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from meshtrain.train import clip_grad_norm_


def _model_with_grads() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    model(torch.randn(5, 8)).pow(2).sum().backward()
    return model


@pytest.mark.parametrize("ratio", [0.25, 4.0], ids=["norm-above-max", "norm-below-max"])
def test_clipping_matches_torch(ratio: float) -> None:
    model, reference = _model_with_grads(), _model_with_grads()
    norm = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()])
    max_norm = float(norm) * ratio
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm)
    got = clip_grad_norm_(model.parameters(), max_norm)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=0.0)
    for param, ref in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(param.grad, ref.grad, rtol=1e-6, atol=0.0)
    clipped = sum(float(p.grad.pow(2).sum()) for p in model.parameters()) ** 0.5
    assert clipped == pytest.approx(min(float(norm), max_norm), rel=1e-5)
