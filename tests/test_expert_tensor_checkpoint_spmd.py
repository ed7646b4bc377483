"""A checkpoint of experts split inside over tp (``gate_up_proj`` packed: each rank holds a part
of the gate rows and of the up rows, two pieces of the global tensor) is the global tensor as
any other: it resumes bit for bit, parameters and AdamW state, on the same mesh, under expert
parallelism and with no tensor parallelism at all; and a checkpoint without tp loads into it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from moe_models import meshtrain_moe, token_batches

import meshtrain as mt
from meshtrain.lower.gather import full_tensor
from meshtrain.models.moe import default_rules as moe_rules
from meshtrain.testing.runner import get_pool
from meshtrain.train import Batch, forward_backward
from meshtrain.train.checkpoint.dcp import CheckpointConfig, Checkpointer, load_checkpoint
from meshtrain.train.checkpoint.packed import packed_dim
from meshtrain.train.loss import data_parallel_rank

pytestmark = pytest.mark.spmd

MESHES: dict[str, tuple[dict[str, int], dict[str, Any]]] = {
    "dp2-tp2-inside": ({"dp": 2, "tp": 2}, {"tp": "tp", "fsdp": "dp", "expert_tp": True}),
    "ep2-tp2-inside": ({"ep": 2, "tp": 2}, {"tp": "tp", "fsdp": (), "ep": "ep", "expert_tp": True}),
    "dp4": ({"dp": 4}, {"tp": None, "fsdp": "dp"}),
    "dp2-ep2-tp2-inside": (
        {"dp": 2, "ep": 2, "tp": 2},
        {"tp": "tp", "fsdp": "dp", "ep": "ep", "expert_tp": True},
    ),
    "dp8": ({"dp": 8}, {"tp": None, "fsdp": "dp"}),
}


def _trained(name: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    axes, rules = MESHES[name]
    model = meshtrain_moe()
    plan = mt.plan(model, mt.make_mesh(**axes), moe_rules(**rules))
    applied = mt.apply(plan, model)
    optimizer = torch.optim.AdamW(applied.parameters(), lr=1e-2)
    inputs, targets = token_batches(0)
    index, ranks = data_parallel_rank(plan)
    rows = slice(index * len(inputs) // ranks, (index + 1) * len(inputs) // ranks)
    forward_backward(plan, applied, Batch(inputs[rows], targets[rows]))
    optimizer.step()
    optimizer.zero_grad()
    return applied, optimizer


def _whole(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    found = {}
    for fqn, param in model.named_parameters():
        found[fqn] = param.detach()
        for key, value in optimizer.state[param].items():
            if isinstance(value, torch.Tensor) and value.ndim:
                found[f"{fqn}.{key}"] = value
    return {k: full_tensor(v).clone() for k, v in found.items()}


def save_and_resume(directory: str, saved_on: str, loaded_on: str) -> list[str]:
    """On every rank: one AdamW step on ``saved_on``, a checkpoint, then a fresh model and
    optimizer on ``loaded_on`` with the checkpoint loaded; the tensors that differ."""
    model, optimizer = _trained(saved_on)
    packed = [fqn for fqn, p in model.named_parameters() if packed_dim(p) is not None]
    assert bool(packed) == ("inside" in saved_on), packed
    expected = _whole(model, optimizer)
    checkpointer = Checkpointer(CheckpointConfig(directory, interval=1))
    path = checkpointer.save(1, dict(model.named_parameters()), optimizer, {})
    fresh, fresh_optimizer = _trained(loaded_on)  # other values: one step from another layout
    load_checkpoint(path, dict(fresh.named_parameters()), fresh_optimizer)
    got = _whole(fresh, fresh_optimizer)
    assert got.keys() == expected.keys()
    return [key for key in expected if not torch.equal(got[key], expected[key])]


@pytest.mark.parametrize(
    ("saved_on", "loaded_on"),
    [
        ("dp2-tp2-inside", "dp2-tp2-inside"),
        ("dp2-tp2-inside", "ep2-tp2-inside"),
        ("dp2-tp2-inside", "dp4"),
        ("dp4", "ep2-tp2-inside"),
    ],
)
def test_checkpoint_of_experts_split_inside_reshards_exactly(
    tmp_path: Path, saved_on: str, loaded_on: str
) -> None:
    differing = get_pool(4).run(save_and_resume, str(tmp_path / "ckpt"), saved_on, loaded_on)
    assert differing == [[]] * 4


@pytest.mark.extended
def test_a_checkpoint_of_fsdp_experts_and_tensor_parallel_experts_reshards_exactly(
    tmp_path: Path,
) -> None:
    """8 ranks: the packed weight FSDP-sharded over dp, split over ep and inside over tp, saved
    and loaded on dp 8 (one whole copy of each expert's gate and up rows per 8 ranks)."""
    differing = get_pool(8).run(
        save_and_resume, str(tmp_path / "ckpt"), "dp2-ep2-tp2-inside", "dp8"
    )
    assert differing == [[]] * 8
