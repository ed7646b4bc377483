"""``P``: JAX PartitionSpec semantics (immutable, hashable, not a tuple, normalised entries)."""

from __future__ import annotations

import pickle

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshtrain import P, SpecError
from meshtrain.testing.strategies import meshes, specs


def test_repr_matches_jax_style() -> None:
    assert repr(P("tp", None)) == "P('tp', None)"
    assert repr(P(("dp", "tp"), None)) == "P(('dp', 'tp'), None)"
    assert repr(P()) == "P()"
    assert repr(P("tp", unreduced={"dp"})) == "P('tp', unreduced={'dp'})"


def test_is_not_a_tuple_and_is_immutable() -> None:
    spec = P("tp", None)
    assert spec != ("tp", None)
    assert not isinstance(spec, tuple)
    with pytest.raises(AttributeError, match="immutable"):
        spec._entries = ()  # type: ignore[misc]


def test_single_axis_tuple_and_empty_tuple_normalise() -> None:
    assert P(("tp",)) == P("tp")
    assert P(()) == P(None)
    assert hash(P(("tp",))) == hash(P("tp"))


def test_tuple_order_is_part_of_the_layout() -> None:
    assert P(("dp", "tp")) != P(("tp", "dp"))


def test_trailing_none_is_implicit_only_through_padded() -> None:
    assert P("tp") != P("tp", None)
    assert P("tp").padded(3) == P("tp", None, None)
    assert P("tp", None, None).padded(2) == P("tp", None, None)


def test_axes_and_dim_of() -> None:
    spec = P(("dp", "tp"), None, "pp")
    assert spec.axes == ("dp", "tp", "pp")
    assert spec.dim_of("tp") == 0
    assert spec.dim_of("pp") == 2
    assert spec.dim_of("cp") is None


@pytest.mark.parametrize(
    ("entry", "message"),
    [(3, "must be None, a mesh axis name"), ("", "empty axis name"), (("dp", 1), "tuple entry")],
)
def test_bad_entries_are_spec_errors(entry: object, message: str) -> None:
    with pytest.raises(SpecError, match=message):
        P(entry)


@given(meshes(world_size=8, max_axes=4).flatmap(lambda m: specs(m, ndim=3)))
def test_json_and_pickle_round_trip(spec: P) -> None:
    assert P.from_json(spec.to_json()) == spec
    assert pickle.loads(pickle.dumps(spec)) == spec
    assert hash(pickle.loads(pickle.dumps(spec))) == hash(spec)


@given(st.lists(st.sampled_from([None, "dp", "tp", ("dp", "tp"), ("tp",)]), max_size=4))
def test_equal_specs_hash_equal(entries: list[object]) -> None:
    assert P(*entries) == P(*entries)
    assert hash(P(*entries)) == hash(P(*entries))
    assert len(P(*entries)) == len(entries)


def test_unreduced_bare_string_is_one_axis() -> None:
    assert P("tp", unreduced="dp").unreduced == frozenset({"dp"})
