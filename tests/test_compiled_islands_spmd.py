"""Compiled plans with eager islands train like one device: under torch.compile the expert
dispatch (data-dependent all-to-all counts) and context attention (the ring's point-to-point
sends) run eagerly between compiled graphs (``torch.compiler.disable``); the rest of each block
compiles. Qwen3-MoE (transformers, tiny, built locally) on ep 2 and meshtrain's Llama on
dp 2 x cp 2, both with the ``aot_eager`` backend, under ``assert_equivalent``."""

from __future__ import annotations

import warnings

import pytest
import torch
from context_models import SEQ, batches, own_llama, rules
from moe_models import ep_rules, qwen3_moe, token_batches

from meshtrain.errors import GraphBreakWarning
from meshtrain.lower.compute import _watch_graph_breaks, compile_report, eager_island
from meshtrain.testing import assert_equivalent

pytestmark = [pytest.mark.spmd, pytest.mark.extended]

AOT_EAGER = {"backend": "aot_eager"}


def test_qwen3_moe_compiled_trains_like_one_device_on_ep2() -> None:
    """Per-block aot_eager compile around the eager dispatch; AdamW, 2 steps."""
    report = assert_equivalent(
        qwen3_moe,
        {"ep": 2},
        {"rules": ep_rules(fsdp=()), "compile": AOT_EAGER},
        batches=token_batches,
        steps=2,
        optimizer="adamw",
    )
    assert report.passed
    print(report.contract.level, max(c.ratio for c in report.comparisons), report.losses)


def test_llama_compiled_trains_like_one_device_on_dp2_cp2() -> None:
    """Per-block aot_eager compile around the eager ring attention; AdamW, 2 steps."""
    report = assert_equivalent(
        own_llama,
        {"dp": 2, "cp": 2},
        {"rules": rules(), "seq_len": SEQ, "compile": AOT_EAGER},
        batches=batches,
        steps=2,
        optimizer="adamw",
    )
    assert report.passed
    print(report.contract.level, max(c.ratio for c in report.comparisons), report.losses)


class _Island(torch.nn.Module):
    def __init__(self, real_break: bool) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.real_break = real_break

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _eager_double(self.linear(x))
        if self.real_break:
            torch._dynamo.graph_break()
        return self.linear(x)


@eager_island
def _eager_double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@pytest.mark.parametrize("real_break", [False, True])
def test_an_eager_island_is_counted_apart_from_graph_breaks(real_break: bool) -> None:
    """A call into an eager island is no GraphBreakWarning; any other break still warns."""
    torch._dynamo.reset()
    model = _Island(real_break)
    model.forward = torch.compile(model.forward, backend="aot_eager", dynamic=False)  # type: ignore[method-assign]
    _watch_graph_breaks(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = model(torch.ones(2, 4))
    expected = model.linear(2 * model.linear(torch.ones(2, 4)))
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    report = compile_report(model)
    warned = [w for w in caught if issubclass(w.category, GraphBreakWarning)]
    assert report.islands >= 1
    assert (report.graph_breaks > 0, len(warned)) == ((True, 1) if real_break else (False, 0))
