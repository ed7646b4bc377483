"""``make_mesh`` and ``Mesh``: sizes, -1, validation before any process group, rank layout."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from meshtrain import Mesh, MeshError, make_mesh
from meshtrain.testing.strategies import meshes


def test_minus_one_absorbs_the_remainder() -> None:
    mesh = make_mesh(dp=-1, tp=2, world_size=8, abstract=True)
    assert mesh.shape == {"dp": 4, "tp": 2}
    assert mesh.is_abstract
    assert str(mesh) == "{dp: 4, tp: 2}"


def test_mapping_form_keeps_order_and_plans_at_scale() -> None:
    mesh = make_mesh({"pp": 16, "dp": -1, "tp": 8}, world_size=16384, abstract=True)
    assert mesh.axis_names == ("pp", "dp", "tp")
    assert mesh.shape == {"pp": 16, "dp": 128, "tp": 8}


def test_size_one_axes_are_kept_but_not_in_the_device_mesh() -> None:
    mesh = make_mesh(pp=1, dp=-1, tp=2, world_size=4, abstract=True)
    assert mesh.axis_names == ("pp", "dp", "tp")
    assert mesh.device_axes == ("dp", "tp")
    assert make_mesh(dp=1, tp=1, world_size=1, abstract=True).device_axes == ("dp",)


def test_world_size_from_torchrun_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "6")
    assert make_mesh(dp=-1, tp=3, abstract=True).shape == {"dp": 2, "tp": 3}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dp": -1, "tp": -1}, r"-1 on axes \['dp', 'tp'\]"),
        (
            {"dp": 3, "tp": 2},
            r"mesh \{dp: 3, tp: 2\} spans 6 ranks but the world has 8 \(world_size argument\)",
        ),
        ({"dp": -1, "tp": 3}, r"fixed axes multiply to 3, which does not divide 8"),
        ({"dp": 0}, r"axis 'dp' has size 0"),
        ({"dp": 2.0}, r"axis 'dp' has size 2.0"),
        ({}, r"at least one axis"),
    ],
)
def test_bad_meshes_name_axes_sizes_and_world(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(MeshError, match=message):
        make_mesh(world_size=8, abstract=True, **kwargs)  # type: ignore[arg-type]


def test_axis_given_twice_and_bad_names() -> None:
    with pytest.raises(MeshError, match="given twice"):
        make_mesh({"dp": 2}, dp=4, world_size=8, abstract=True)
    with pytest.raises(MeshError, match="not an identifier"):
        make_mesh({"d p": 8}, world_size=8, abstract=True)


def test_without_launcher_a_multi_rank_real_mesh_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for var in ("MASTER_ADDR", "TORCHELASTIC_RUN_ID", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(MeshError, match="torchrun --nproc_per_node 4"):
        make_mesh(dp=4)


def test_unknown_axis_suggests_the_nearest() -> None:
    with pytest.raises(MeshError, match="did you mean 'tp'"):
        Mesh(("dp", "tp"), (2, 2)).size("tpp")


@given(meshes(world_size=24, max_axes=4))
def test_coordinates_are_row_major_like_init_device_mesh(mesh: Mesh) -> None:
    layout = torch.arange(mesh.world_size).view(*mesh.axis_sizes)
    for rank in range(mesh.world_size):
        coords = mesh.coordinates(rank)
        assert int(layout[tuple(coords[a] for a in mesh.axis_names)]) == rank


@given(st.integers(1, 64), st.integers(1, 4))
def test_minus_one_resolves_whenever_the_fixed_axes_divide_the_world(world: int, tp: int) -> None:
    if world % tp:
        with pytest.raises(MeshError):
            make_mesh(dp=-1, tp=tp, world_size=world, abstract=True)
    else:
        assert make_mesh(dp=-1, tp=tp, world_size=world, abstract=True).world_size == world


@given(st.sampled_from([2, 4, 6, 8, 12]).flatmap(meshes), st.data())
def test_groups_over_several_axes_partition_the_ranks(mesh: Mesh, data: st.DataObject) -> None:
    """A group over a set of axes holds every rank that differs from its members only on those
    axes: the groups partition the world, each the size of the axes' product, in rank order."""
    axes = data.draw(st.sets(st.sampled_from(mesh.axis_names)))
    size = math.prod(mesh.size(axis) for axis in axes)
    groups = {mesh.group_ranks(rank, tuple(axes)) for rank in range(mesh.world_size)}
    assert all(len(group) == size and list(group) == sorted(group) for group in groups)
    assert sorted(r for group in groups for r in group) == list(range(mesh.world_size))
    for group in groups:
        fixed = [{a: c for a, c in mesh.coordinates(r).items() if a not in axes} for r in group]
        assert all(coords == fixed[0] for coords in fixed)
    named = [axis for axis in mesh.joined(tuple(axes)).split("+") if axis]  # its name: the axes
    assert all(mesh.size(axis) > 1 for axis in named)  # that matter, in mesh order
    assert named == sorted(named, key=mesh.axis_names.index)
    assert math.prod(mesh.size(axis) for axis in named) == size
