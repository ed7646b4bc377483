"""Which share of the global batch each rank trains (tier 1, real gloo ranks): the recipe runtime
and the harness slice batches by ``data_parallel_rank``; every data-parallel index appears once
over the data axes, and the tensor-parallel ranks of one index share it."""

from __future__ import annotations

import pytest
import torch.distributed as dist

import meshtrain as mt
from meshtrain.models import LlamaConfig, build_llama, default_rules
from meshtrain.testing.runner import get_pool
from meshtrain.train import loss

pytestmark = pytest.mark.spmd


def rank_and_share(axes: dict[str, int], data: tuple[str, ...]) -> tuple[int, dict, tuple]:
    mesh = mt.make_mesh(axes)
    model = build_llama(LlamaConfig.debug(), device="meta")
    rules = default_rules(fsdp=data, tp="tp" if "tp" in axes else None)
    plan = mt.plan(model, mesh, rules)
    return dist.get_rank(), mesh.coordinates(dist.get_rank()), loss.data_parallel_rank(plan)


@pytest.mark.parametrize(
    ("axes", "data"),
    [({"dp": 4}, ("dp",)), ({"rep": 2, "dp": 2}, ("rep", "dp")), ({"dp": 2, "tp": 2}, ("dp",))],
    ids=["fsdp", "hsdp", "fsdp-tp"],
)
def test_each_data_parallel_index_trains_its_own_share(
    axes: dict[str, int], data: tuple[str, ...]
) -> None:
    results = get_pool(4).run(rank_and_share, axes, data)
    size = 1
    for axis in data:
        size *= axes[axis]
    by_index: dict[int, list[dict]] = {}
    for _, coords, (index, ranks) in results:
        assert ranks == size
        by_index.setdefault(index, []).append(coords)
    assert sorted(by_index) == list(range(size))  # every share once ...
    for members in by_index.values():  # ... held by the ranks that differ only off the data axes
        assert len({tuple(c[a] for a in data) for c in members}) == 1
