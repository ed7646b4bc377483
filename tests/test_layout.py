"""Spec validation errors and the reference shard layout (pure, no process groups)."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from meshtrain import Mesh, P, SpecError
from meshtrain.spec.layout import local_shape, shard_slices, validate_spec
from meshtrain.spec.placements import from_placements, to_placements
from meshtrain.testing.strategies import invalid_specs, meshes, sharded_shapes

MESH = Mesh(("dp", "tp"), (2, 3))


def test_error_message_names_parameter_shape_spec_mesh_and_fix() -> None:
    with pytest.raises(SpecError) as info:
        validate_spec(P("tp", None), (1000, 512), MESH, fqn="layers.3.mlp.w1.weight")
    assert str(info.value) == (
        "parameter 'layers.3.mlp.w1.weight' (shape 1000×512) cannot take P('tp', None) on mesh "
        "{dp: 2, tp: 3}: dim 0 (1000) is not divisible by tp=3. Use a tp size that divides 1000, "
        "shard another dim, or pad the parameter to a multiple of 3."
    )
    err = info.value
    assert (err.fqn, err.shape, err.spec, err.mesh) == (
        "layers.3.mlp.w1.weight",
        (1000, 512),
        P("tp", None),
        MESH,
    )


@pytest.mark.parametrize(
    ("spec", "shape", "message"),
    [
        (P("tpp"), (6,), r"axis 'tpp' is not in the mesh \(did you mean 'tp'\?"),
        (P("tp", "tp"), (6, 6), r"axis 'tp' is used twice \(dim 0 and dim 1\)"),
        (P(("tp", "tp")), (6,), r"axis 'tp' is used twice \(dim 0 and dim 0\)"),
        (P("tp", unreduced={"tp"}), (6,), r"axis 'tp' is used twice \(dim 0 and unreduced\)"),
        (P(None, None, "tp"), (6, 6), r"the spec has 3 entries but the tensor has 2 dims"),
        (P(("dp", "tp")), (8,), r"dim 0 \(8\) is not divisible by dp=2×tp=3 = 6"),
    ],
)
def test_each_kind_of_invalid_spec(spec: P, shape: tuple[int, ...], message: str) -> None:
    with pytest.raises(SpecError, match=message):
        validate_spec(spec, shape, MESH, fqn="w", rule="'w'")


@given(meshes(world_size=12, max_axes=3).flatmap(lambda m: st.tuples(st.just(m), invalid_specs(m))))
def test_every_invalid_spec_raises_with_the_parameter_name(case: tuple[Mesh, tuple]) -> None:
    mesh, (shape, spec, kind) = case
    with pytest.raises(SpecError) as info:
        validate_spec(spec, shape, mesh, fqn="model.block.weight")
    message = str(info.value)
    assert "parameter 'model.block.weight'" in message
    assert repr(spec) in message and str(mesh) in message
    expected = {
        "unknown_axis": "is not in the mesh",
        "axis_twice": "is used twice",
        "too_long": "entries but the tensor has",
        "not_divisible": "is not divisible by",
    }[kind]
    assert expected in message


@given(
    meshes(world_size=12, max_axes=3).flatmap(lambda m: st.tuples(st.just(m), sharded_shapes(m)))
)
def test_reference_shards_tile_the_tensor_exactly_once_per_replica(
    case: tuple[Mesh, tuple],
) -> None:
    mesh, (shape, spec) = case
    full = torch.arange(int(torch.Size(shape).numel())).reshape(shape)
    replicas = mesh.world_size // max(1, _product(mesh, spec))
    counts = torch.zeros(shape, dtype=torch.long)
    for rank in range(mesh.world_size):
        piece = full[shard_slices(spec, shape, mesh, rank)]
        assert tuple(piece.shape) == local_shape(spec, shape, mesh)
        counts[shard_slices(spec, shape, mesh, rank)] += 1
    assert bool((counts == replicas).all())


def _product(mesh: Mesh, spec: P) -> int:
    result = 1
    for axis in spec.axes:
        result *= mesh.size(axis)
    return result


@given(meshes(world_size=8, max_axes=3).flatmap(lambda m: st.tuples(st.just(m), sharded_shapes(m))))
def test_placements_round_trip_to_the_same_spec(case: tuple[Mesh, tuple]) -> None:
    mesh, (shape, spec) = case
    placements = to_placements(spec, mesh, len(shape))
    assert len(placements) == len(mesh.device_axes)
    expected = P(*(tuple(a for a in _axes(e) if mesh.size(a) > 1) or None for e in spec))
    assert from_placements(placements, mesh) == P(*_strip(expected))


def _axes(entry: object) -> tuple[str, ...]:
    return () if entry is None else ((entry,) if isinstance(entry, str) else tuple(entry))  # type: ignore[arg-type]


def _strip(spec: P) -> list[object]:
    entries = list(spec.entries)
    while entries and entries[-1] is None:
        entries.pop()
    return entries


def test_strided_shard_split_factor_for_every_order_of_three_axes() -> None:
    mesh = Mesh(("a", "b", "c"), (2, 3, 5))
    for order in itertools.permutations("abc"):
        placements = to_placements(P(order), mesh, 1)
        for i, axis in enumerate(order):
            factor = _product(
                mesh, P(tuple(x for x in order[:i] if "abc".index(x) > "abc".index(axis)))
            )
            placement = placements["abc".index(axis)]
            assert getattr(placement, "split_factor", 1) == factor, (order, axis, placement)
        assert from_placements(placements, mesh) == P(order)
