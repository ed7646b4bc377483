"""Compiled plans with eager islands train like one device: under torch.compile the expert
dispatch (data-dependent all-to-all counts) and context attention (the ring's point-to-point
sends) run eagerly between compiled graphs (``torch.compiler.disable``); the rest of each block
compiles. Qwen3-MoE (transformers, tiny, built locally) on ep 2 and meshtrain's Llama on
dp 2 x cp 2, both with the ``aot_eager`` backend, under ``assert_equivalent``."""

from __future__ import annotations

import pytest
from context_models import SEQ, batches, own_llama, rules
from moe_models import ep_rules, qwen3_moe, token_batches

from meshtrain.testing import assert_equivalent

pytestmark = [pytest.mark.spmd, pytest.mark.extended]

AOT_EAGER = {"backend": "aot_eager"}


def test_qwen3_moe_compiled_trains_like_one_device_on_ep2() -> None:
    """Per-block aot_eager compile around the eager dispatch; AdamW, 2 steps."""
    report = assert_equivalent(qwen3_moe, {"ep": 2},
                               {"rules": ep_rules(fsdp=()), "compile": AOT_EAGER},
                               batches=token_batches, steps=2, optimizer="adamw")  # fmt: skip
    assert report.passed
    print(report.contract.level, max(c.ratio for c in report.comparisons), report.losses)


def test_llama_compiled_trains_like_one_device_on_dp2_cp2() -> None:
    """Per-block aot_eager compile around the eager ring attention; AdamW, 2 steps."""
    report = assert_equivalent(own_llama, {"dp": 2, "cp": 2},
                               {"rules": rules(), "seq_len": SEQ, "compile": AOT_EAGER},
                               batches=batches, steps=2, optimizer="adamw")  # fmt: skip
    assert report.passed
    print(report.contract.level, max(c.ratio for c in report.comparisons), report.losses)
