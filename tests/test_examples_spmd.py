"""The examples for models meshtrain did not write, run on real gloo ranks: a Hugging Face causal
LM in the user's own loop under FSDP × TP, and a CNN with BatchNorm under data parallelism."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from meshtrain.testing.runner import get_pool

pytestmark = pytest.mark.spmd

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import cnn_ddp  # noqa: E402
import hf_causal_lm  # noqa: E402

# fp32, reduction order only: tensor parallel splits the matmul reductions and the vocab's
# log-sum-exp, data parallelism averages the ranks' gradients (and BatchNorm sums its statistics
# over them); each changes rounding by a few ulps per step. 64 ulps of the loss is far above
# that and far below any real error (a wrong shard, a missing reduction, per-rank BatchNorm
# statistics move the loss by more than 1e-3).
BOUND = 64 * torch.finfo(torch.float32).eps


# Hugging Face's causal LM returns a view of its logits from the FSDP root; nothing here writes
# into it in place
@pytest.mark.filterwarnings("ignore:.*FSDP2-wrapped module .* returned a view tensor")
@pytest.mark.parametrize("example", [hf_causal_lm, cnn_ddp], ids=["hf_causal_lm", "cnn_ddp"])
def test_example_trains_like_one_device(example: object) -> None:
    results = get_pool(4).run(example.train, 3)  # type: ignore[attr-defined]
    for losses in results:
        assert len(losses) == 3
        for loss, reference in losses:
            assert abs(loss - reference) <= BOUND * reference, losses
