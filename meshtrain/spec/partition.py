"""``P``: the partition spec, one entry per tensor dim.

Semantics follow ``jax.sharding.PartitionSpec``:

* each entry is ``None`` (the dim is not sharded), one mesh axis name, or a tuple of axis names
  (the dim is sharded over several axes, **major to minor in the order written**, independent of
  the mesh's own axis order: ``P(("x", "y"))`` and ``P(("y", "x"))`` are different layouts);
* trailing ``None`` entries may be left out: ``P("x")`` on a rank-2 tensor means ``P("x", None)``;
* mesh axes named nowhere mean the tensor is replicated over them; ``P()`` is fully replicated;
* ``unreduced`` names axes over which each device holds a partial sum (DTensor ``Partial``).

A ``P`` is immutable and hashable, and it is not a tuple: it never compares equal to one. A
one-element tuple entry is stored as the bare axis name (``P(("x",)) == P("x")``) and an empty tuple
as ``None``, because they describe the same layout.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import overload

from meshtrain.errors import SpecError

#: One entry of a spec: not sharded, sharded over one axis, or over several (major to minor).
Entry = str | tuple[str, ...] | None


def _normalise_entry(entry: object, position: int) -> Entry:
    if entry is None or isinstance(entry, str):
        if isinstance(entry, str) and not entry:
            raise SpecError(
                f"P entry {position} is an empty axis name; use None for a dim that is not sharded."
            )
        return entry
    if isinstance(entry, (tuple, list)):
        axes = tuple(entry)
        for axis in axes:
            if not isinstance(axis, str) or not axis:
                raise SpecError(
                    f"P entry {position} is {entry!r}: a tuple entry must hold mesh axis names "
                    "(non-empty strings), e.g. P(('dp', 'tp'), None)."
                )
        if not axes:
            return None
        return axes[0] if len(axes) == 1 else axes
    raise SpecError(
        f"P entry {position} is {entry!r} of type {type(entry).__name__}: each entry must be None, a "
        "mesh axis name or a tuple of axis names, e.g. P('tp', None) or P(('dp', 'tp'))."
    )


class P:
    """Partition spec: how each tensor dim is laid out over named mesh axes.

    Example:
        >>> spec = P("tp", None)
        >>> spec
        P('tp', None)
        >>> spec.axes
        ('tp',)
        >>> P(("dp", "tp")).padded(2)
        P(('dp', 'tp'), None)
    """

    __slots__ = ("_entries", "_unreduced")

    _entries: tuple[Entry, ...]
    _unreduced: frozenset[str]

    def __init__(self, *entries: object, unreduced: Iterable[str] = ()) -> None:
        normalised = tuple(_normalise_entry(entry, i) for i, entry in enumerate(entries))
        unreduced_axes = frozenset((unreduced,) if isinstance(unreduced, str) else unreduced)
        for axis in unreduced_axes:
            if not isinstance(axis, str) or not axis:
                raise SpecError(f"P(unreduced=...) holds {axis!r}; it must hold mesh axis names.")
        object.__setattr__(self, "_entries", normalised)
        object.__setattr__(self, "_unreduced", unreduced_axes)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"P is immutable; build a new one instead of setting {name!r}")

    @property
    def entries(self) -> tuple[Entry, ...]:
        """The entries as written (trailing ``None`` not filled in)."""
        return self._entries

    @property
    def unreduced(self) -> frozenset[str]:
        """Axes over which each device holds a partial sum."""
        return self._unreduced

    @property
    def axes(self) -> tuple[str, ...]:
        """Every mesh axis that shards some dim, in entry order (duplicates kept)."""
        return tuple(axis for entry in self._entries for axis in entry_axes(entry))

    def padded(self, ndim: int) -> P:
        """This spec with trailing ``None`` entries filled in up to ``ndim`` entries.

        A spec longer than ``ndim`` is returned unchanged; validation reports it.
        """
        if len(self._entries) >= ndim:
            return self
        return P(*self._entries, *([None] * (ndim - len(self._entries))), unreduced=self._unreduced)

    def dim_of(self, axis: str) -> int | None:
        """The tensor dim that ``axis`` shards, or ``None`` when it shards no dim."""
        for dim, entry in enumerate(self._entries):
            if axis in entry_axes(entry):
                return dim
        return None

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[Entry]:
        return iter(self._entries)

    @overload
    def __getitem__(self, index: int) -> Entry: ...
    @overload
    def __getitem__(self, index: slice) -> tuple[Entry, ...]: ...
    def __getitem__(self, index: int | slice) -> Entry | tuple[Entry, ...]:
        return self._entries[index]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, P):
            return NotImplemented
        return self._entries == other._entries and self._unreduced == other._unreduced

    def __hash__(self) -> int:
        return hash((P, self._entries, self._unreduced))

    def __repr__(self) -> str:
        parts = [repr(entry) for entry in self._entries]
        if self._unreduced:
            parts.append(f"unreduced={{{', '.join(repr(a) for a in sorted(self._unreduced))}}}")
        return f"P({', '.join(parts)})"

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild, (self._entries, tuple(sorted(self._unreduced))))

    def to_json(self) -> dict[str, object]:
        """A JSON-friendly form: ``{"entries": [...], "unreduced": [...]}``."""
        return {
            "entries": [list(e) if isinstance(e, tuple) else e for e in self._entries],
            "unreduced": sorted(self._unreduced),
        }

    @classmethod
    def from_json(cls, data: dict[str, object]) -> P:
        """Inverse of :meth:`to_json`."""
        entries = data.get("entries", [])
        unreduced = data.get("unreduced", [])
        if not isinstance(entries, list) or not isinstance(unreduced, list):
            raise SpecError(
                f"cannot read a P from {data!r}: expected lists under 'entries' and 'unreduced'."
            )
        return cls(*entries, unreduced=unreduced)


def _rebuild(entries: tuple[Entry, ...], unreduced: tuple[str, ...]) -> P:
    return P(*entries, unreduced=unreduced)


def entry_axes(entry: Entry) -> tuple[str, ...]:
    """The mesh axes of one spec entry, major to minor.

    Example:
        >>> entry_axes(("dp", "tp")), entry_axes("tp"), entry_axes(None)
        (('dp', 'tp'), ('tp',), ())
    """
    if entry is None:
        return ()
    if isinstance(entry, str):
        return (entry,)
    return entry
