"""P → DTensor on real gloo ranks: every rank holds exactly the reference shard, and the full
tensor rebuilt by DTensor equals the original (a wrong shard order would silently scramble it)."""

from __future__ import annotations

import pytest
import torch
from helpers import mesh_for
from hypothesis import given, settings
from hypothesis import strategies as st

from meshtrain import Mesh, MeshError, P, make_mesh
from meshtrain.lower import device_mesh, distribute
from meshtrain.spec.layout import shard_slices
from meshtrain.spec.placements import from_placements
from meshtrain.testing.runner import get_pool
from meshtrain.testing.strategies import meshes, sharded_shapes

pytestmark = pytest.mark.spmd


def check_distribution(
    names: tuple[str, ...], sizes: tuple[int, ...], shape: tuple[int, ...], spec: P
) -> dict[str, object]:
    """Runs on every rank: distribute a full tensor, compare with the reference shard and rebuild it."""
    mesh = mesh_for(tuple(zip(names, sizes)))
    full = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
    dtensor = distribute(full, mesh, spec)
    expected_local = full[shard_slices(spec, shape, mesh, torch.distributed.get_rank())]
    return {
        "local_ok": torch.equal(dtensor.to_local(), expected_local),
        "full_ok": torch.equal(dtensor.full_tensor(), full),
        "spec_back": from_placements(dtensor.placements, mesh),
        "placements": repr(dtensor.placements),
    }


def _without_size_one_axes(spec: P, mesh: Mesh) -> P:
    entries = [
        tuple(a for a in (e if isinstance(e, tuple) else (e,)) if mesh.size(a) > 1) if e else None
        for e in spec
    ]
    cleaned = [e or None for e in entries]
    while cleaned and cleaned[-1] is None:
        cleaned.pop()
    return P(*cleaned)


def _assert_distributes(mesh: Mesh, shape: tuple[int, ...], spec: P) -> None:
    results = get_pool(mesh.world_size).run(
        check_distribution, mesh.axis_names, mesh.axis_sizes, shape, spec
    )
    for rank, result in enumerate(results):
        context = (
            f"rank {rank}, {spec!r} on {mesh}, shape {shape}, placements {result['placements']}"
        )
        assert result["local_ok"], f"wrong local shard: {context}"
        assert result["full_ok"], f"full tensor scrambled: {context}"
        assert result["spec_back"] == _without_size_one_axes(spec, mesh), context


@pytest.mark.parametrize("world_size", [2, 4])
@given(data=st.data())
def test_distribute_matches_reference_and_round_trips(world_size: int, data: st.DataObject) -> None:
    mesh = data.draw(meshes(world_size, max_axes=3))
    shape, spec = data.draw(sharded_shapes(mesh))
    _assert_distributes(mesh, shape, spec)


@settings(max_examples=15)
@given(data=st.data())
def test_distribute_on_eight_ranks(data: st.DataObject) -> None:
    mesh = data.draw(meshes(8, max_axes=3))
    shape, spec = data.draw(sharded_shapes(mesh))
    _assert_distributes(mesh, shape, spec)


@pytest.mark.parametrize(
    "spec",
    [
        P(("a", "b", "c")),
        P(("c", "b", "a")),
        P(("b", "a", "c")),
        P(("c", "a", "b")),
        P(("b", "c", "a")),
        P(("a", "c", "b")),
    ],
)
def test_every_order_of_three_axes_on_one_dim(spec: P) -> None:
    _assert_distributes(Mesh(("a", "b", "c"), (2, 2, 2)), (16, 3), spec)


def mesh_layout(axes: dict[str, int]) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """Runs on every rank: the dims of the DeviceMesh behind a named mesh."""
    bound = device_mesh(make_mesh(axes))
    return tuple(bound.mesh_dim_names or ()), tuple(bound.shape)


def test_size_one_axes_create_no_device_mesh_dims() -> None:
    results = get_pool(4).run(mesh_layout, {"pp": 1, "dp": -1, "tp": 2})
    assert results == [(("dp", "tp"), (2, 2))] * 4


def bad_mesh_error(axes: dict[str, int]) -> str:
    """Runs on every rank: the error a mesh that does not fit the world raises."""
    try:
        make_mesh(axes)
    except MeshError as err:
        return str(err)
    return "no error"


def test_mesh_mismatch_raises_on_every_rank_without_hanging() -> None:
    results = get_pool(4).run(bad_mesh_error, {"dp": 3, "tp": 2}, _timeout_s=30.0)
    assert len(set(results)) == 1
    assert (
        "mesh {dp: 3, tp: 2} spans 6 ranks but the world has 4 (initialised process group)"
        in results[0]
    )
