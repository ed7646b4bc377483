"""Loading weights reports its progress: ``load_hf``'s callback counts every tensor filled, from 0
to the total; a run's ``init_from`` gets a bar on rank 0's terminal and nothing elsewhere (the
"loaded" line says it)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from meshtrain.recipes import load_recipe
from meshtrain.recipes.pretrained import load_pretrained
from meshtrain.recipes.run import _load_progress
from meshtrain.train.hf.load import load_hf


def _checkpoint(tmp_path: Path) -> tuple[Path, nn.Module]:
    torch.manual_seed(0)
    source = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 3), nn.LayerNorm(3))
    path = tmp_path / "model.safetensors"
    save_file({name: tensor.contiguous() for name, tensor in source.state_dict().items()}, path)
    return path, source


def test_the_callback_counts_every_tensor_up_to_the_total(tmp_path: Path) -> None:
    path, source = _checkpoint(tmp_path)
    target = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 3), nn.LayerNorm(3))
    calls: list[tuple[int, int]] = []
    report = load_pretrained(path, target, lambda done, total: calls.append((done, total)))
    assert report.tensors == 6
    assert calls == [(done, 6) for done in range(7)]  # 0, 1, …, 6 of 6
    for name, tensor in source.state_dict().items():
        assert torch.equal(target.state_dict()[name], tensor)  # and the weights are loaded
    assert load_hf(path, target).tensors == 6  # no callback: the same load


def test_a_run_shows_a_bar_on_a_terminal_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, _ = _checkpoint(tmp_path)
    recipe = load_recipe("debug", [f"checkpoint.init_from={path}"])
    with _load_progress(recipe) as progress:
        assert progress is None  # not a terminal (pytest captures stdout)
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    with _load_progress(recipe) as progress:
        assert progress is not None
        progress(0, 6)
        progress(6, 6)
    with _load_progress(load_recipe("debug")) as progress:
        assert progress is None  # no init_from: no bar
