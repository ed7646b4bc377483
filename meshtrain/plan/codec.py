"""How each field of a plan's data is written to JSON, read back and shown in the report,
declared with the field: ``json_field(codec, explain=section, ...)`` puts the codec and the
report section in the dataclass field's metadata, and :func:`to_data`, :func:`from_data` and
:func:`report` walk the fields. A new ``Plan`` field is one line with its codec and section; its
JSON, ``Plan.from_json`` and its place in ``Plan.explain()`` follow.

Example:
    >>> from dataclasses import dataclass
    >>> AXES = Section(0, lambda tiny: [f"axes {list(tiny.axes)} of size {tiny.size}"])
    >>> @dataclass(frozen=True)
    ... class Tiny:
    ...     axes: tuple[str, ...] = json_field(STRINGS, explain=AXES, default=())
    ...     size: int = json_field(PLAIN, explain=AXES, default=1)
    >>> to_data(Tiny(("dp", "tp"), 4)), from_data(Tiny, {"axes": ["dp"]})
    ({'axes': ['dp', 'tp'], 'size': 4}, Tiny(axes=('dp',), size=1))
    >>> print(report(Tiny(("dp",), 2)), end="")
    axes ['dp'] of size 2
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

#: the metadata keys a field's codec and report section are kept under
CODEC = "json"
EXPLAIN = "explain"


@dataclass(frozen=True)
class Codec:
    """``encode(value)`` → JSON data; ``decode(data, decoded)`` → the value, given the fields
    decoded before it (a plan's units read its options). ``omit_empty``: left out of the JSON
    when empty (fields added later, so plans without them keep their JSON)."""

    encode: Callable[[Any], Any]
    decode: Callable[[Any, Mapping[str, Any]], Any]
    omit_empty: bool = False


@dataclass(frozen=True, eq=False)
class Section:
    """One part of a value's report: ``render(value)`` → its lines (none when it has nothing to
    say). Sections print in ``order``, a blank line between; the fields a section shows each
    name it, so one section may stand for several fields."""

    order: float
    render: Callable[[Any], list[str]]


#: the section of a field the report leaves out on purpose (say why beside the field)
UNSHOWN = Section(-1, lambda _: [])


def json_field(codec: Codec, *, explain: Section, **kwargs: Any) -> Any:
    """A dataclass field written and read by ``codec`` and shown by the report section
    ``explain`` (``kwargs``: ``default``, ...)."""
    return dataclasses.field(metadata={CODEC: codec, EXPLAIN: explain}, **kwargs)


def records(cls: type, omit_empty: bool = False) -> Codec:
    """A tuple of dataclass records, each written as its attributes."""
    return Codec(
        lambda items: [vars(item) for item in items],
        lambda data, _: tuple(cls(**item) for item in data),
        omit_empty,
    )


def record(cls: type) -> Codec:
    """One dataclass record, written as its attributes."""
    return Codec(vars, lambda data, _: cls(**data))


def methods(cls: Any, many: bool = False) -> Codec:
    """Values with their own ``to_json`` / ``from_json`` (a tuple of them when ``many``)."""
    if many:
        return Codec(
            lambda items: [item.to_json() for item in items],
            lambda data, _: tuple(cls.from_json(item) for item in data),
        )
    return Codec(lambda value: value.to_json(), lambda data, _: cls.from_json(data))


PLAIN = Codec(lambda value: value, lambda data, _: data)
STRINGS = Codec(list, lambda data, _: tuple(data))
#: a tuple of tuples (pairs, groups), written as lists of lists
NESTED = Codec(
    lambda items: [list(item) for item in items], lambda data, _: tuple(map(tuple, data))
)


def to_data(value: Any) -> dict[str, Any]:
    """Every field of ``value`` as its codec writes it."""
    data = {}
    for field in dataclasses.fields(value):
        codec: Codec = field.metadata[CODEC]
        item = getattr(value, field.name)
        if not (codec.omit_empty and not item):
            data[field.name] = codec.encode(item)
    return data


def from_data(cls: type, data: Mapping[str, Any]) -> Any:
    """``cls`` from what :func:`to_data` wrote; a field missing from ``data`` (written before it
    existed) takes its default."""
    decoded: dict[str, Any] = {}
    for field in dataclasses.fields(cls):
        if field.name in data:
            decoded[field.name] = field.metadata[CODEC].decode(data[field.name], decoded)
    return cls(**decoded)


def sections(cls: Any) -> list[Section]:
    """The report sections the fields of ``cls`` name, each once, in order."""
    unique = {id(f.metadata[EXPLAIN]): f.metadata[EXPLAIN] for f in dataclasses.fields(cls)}
    return sorted(unique.values(), key=lambda section: section.order)


def report(value: Any) -> str:
    """Every section of ``value``'s fields that has something to say, a blank line between."""
    parts = [section.render(value) for section in sections(value)]
    return "\n\n".join("\n".join(lines) for lines in parts if lines) + "\n"
