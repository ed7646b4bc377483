"""Sizes read off a shard, known as such: the abstract run's provenance of sizes.

On a rank, ``x.shape[2]`` of a tensor sharded on dim 2 is the rank's size; on one device the same
line of the model's code reads one device's size. A size the code passes on to a reshape must
therefore be one device's size in the one-device run, while a constant (a head count from the
config) stays what it is — that difference is what tells torchtitan's rotary
``x.reshape(*x.shape[:-1], -1, 2)`` (sizes read off the shard: fine) from OPT's
``view(bsz, -1, num_heads, head_dim)`` (a global constant on a shard: wrong).

:class:`SizeProvenance` is a torch-function mode: reading the shape (``x.shape``, ``x.size()``,
``x.size(d)``, ``len(x)``) of a sharded tensor returns :class:`LocalSize` ints on its sharded dim,
which carry one device's size beside the rank's through Python arithmetic (``n // 2``,
``a * b``); every torch call whose arguments hold such sizes records them, so the abstract
run's one-device op (at the aten level, where sizes are plain ints again) looks the rank's size
lists up and takes one device's instead (:meth:`SizeProvenance.whole_sizes`).

Example:
    >>> n = LocalSize(8, 16)
    >>> (n // 2, (n // 2).whole, n * 3 + 1, (n * 3 + 1).whole)
    (4, 8, 25, 49)
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_aten = torch.ops.aten

#: size arguments given as scalars, by aten op: their positions (a slice's end, a narrowed
#: length, an ``arange``'s bounds); size lists are found by type
SCALAR_SIZES: dict[Any, tuple[int, ...]] = {
    _aten.arange.default: (0,),
    _aten.arange.start: (0, 1),
    _aten.arange.start_step: (0, 1),
    _aten.slice.Tensor: (2, 3),
    _aten.narrow.default: (3,),
}


class LocalSize(int):
    """A rank's size of a sharded dim (the int's value) and one device's (``whole``).

    Example:
        >>> LocalSize(4, 8) + 0, (LocalSize(4, 8) + 0).whole
        (4, 8)
    """

    whole: int

    def __new__(cls, local: int, whole: int) -> LocalSize:
        value = super().__new__(cls, local)
        value.whole = whole
        return value

    def _combine(self, other: Any, op: Callable[[int, int], Any], flip: bool = False) -> Any:
        if not isinstance(other, int) or isinstance(other, bool):
            return op(int(other), int(self)) if flip else op(int(self), other)
        other_whole = other.whole if isinstance(other, LocalSize) else int(other)
        pair = (
            ((int(other), int(self)), (other_whole, self.whole))
            if flip
            else ((int(self), int(other)), (self.whole, other_whole))
        )
        local, whole = op(*pair[0]), op(*pair[1])
        return LocalSize(local, whole) if type(local) is int and local != whole else local

    def __add__(self, other: Any) -> Any:
        return self._combine(other, operator.add)

    def __radd__(self, other: Any) -> Any:
        return self._combine(other, operator.add, flip=True)

    def __sub__(self, other: Any) -> Any:
        return self._combine(other, operator.sub)

    def __rsub__(self, other: Any) -> Any:
        return self._combine(other, operator.sub, flip=True)

    def __mul__(self, other: Any) -> Any:
        return self._combine(other, operator.mul)

    def __rmul__(self, other: Any) -> Any:
        return self._combine(other, operator.mul, flip=True)

    def __floordiv__(self, other: Any) -> Any:
        return self._combine(other, operator.floordiv)

    def __rfloordiv__(self, other: Any) -> Any:
        return self._combine(other, operator.floordiv, flip=True)

    def __mod__(self, other: Any) -> Any:
        return self._combine(other, operator.mod)

    def __neg__(self) -> Any:
        return LocalSize(-int(self), -self.whole)

    def __index__(self) -> int:
        return int(self)


class Sizes(tuple[Any, ...]):
    """A shape whose entries may be :class:`LocalSize` (``torch.Size`` keeps plain ints only):
    slices stay :class:`Sizes`; ``numel()`` as on ``torch.Size``."""

    def __getitem__(self, key: Any) -> Any:
        item = super().__getitem__(key)
        return Sizes(item) if isinstance(key, slice) else item

    def numel(self) -> int:
        total = 1
        for size in self:
            total = total * size
        return total


def whole_args(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """A torch call's arguments with the sizes read off shards made one device's (tensors and
    everything else as given).

    Example:
        >>> whole_args(("x", LocalSize(2, 4), (LocalSize(2, 4), -1), 3))
        ('x', 4, [4, -1], 3)
    """
    return tuple(whole_of(a) if _tagged(a) and not isinstance(a, slice) else a for a in args)


def whole_of(value: Any) -> Any:
    """``value`` with every :class:`LocalSize` replaced by one device's size (lists and tuples
    looked into, given back as lists).

    Example:
        >>> whole_of((3, LocalSize(2, 4), -1))
        [3, 4, -1]
    """
    if isinstance(value, LocalSize):
        return value.whole
    if isinstance(value, (list, tuple)):
        return [whole_of(v) for v in value]
    return value


def _tagged(value: Any) -> bool:
    if isinstance(value, LocalSize):
        return True
    if isinstance(value, slice):
        return any(isinstance(v, LocalSize) for v in (value.start, value.stop, value.step))
    return isinstance(value, (list, tuple)) and any(_tagged(v) for v in value)


class SizeProvenance(TorchFunctionMode):
    """Hands out :class:`LocalSize` for the sharded dim of a shard's shape and records, per
    torch call, the size lists and sizes that carry one (see module doc). ``shard_of(tensor)``
    gives a shard's ``(dim, one device's size)`` or None; ``watch`` sees every other torch call
    (the abstract run checks attention calls there)."""

    def __init__(
        self,
        shard_of: Callable[[torch.Tensor], tuple[int, int] | None],
        watch: Callable[[Any, Any, dict[str, Any]], None] | None = None,
        composite: Callable[[Any, Any, dict[str, Any]], Any] | None = None,
    ) -> None:
        super().__init__()
        self.shard_of, self.watch, self.composite = shard_of, watch, composite
        self.frames: list[tuple[dict[tuple[int, ...], tuple[int, ...]], dict[int, int]]] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _SHAPE_READS:
            return self._shape(func, args, kwargs)
        if self.watch is not None:
            self.watch(func, args, kwargs)
        if self.composite is not None and func in COMPOSITES:
            return self.composite(func, args, kwargs)
        if not (_tagged(args) or _tagged(tuple(kwargs.values()))):
            return func(*args, **kwargs)
        self.frames.append(_record(args, kwargs))
        try:
            return func(*args, **kwargs)
        finally:
            self.frames.pop()

    def _shape(self, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        result = func(*args, **kwargs)
        tensor = args[0]
        found = self.shard_of(tensor) if isinstance(tensor, torch.Tensor) else None
        if found is None:
            return result
        dim, whole = found
        if func is torch.Tensor.__len__:
            return LocalSize(result, whole) if dim == 0 and result != whole else result
        if isinstance(result, int):  # x.size(d)
            asked = args[1] if len(args) > 1 else kwargs.get("dim")
            return LocalSize(result, whole) if asked % tensor.dim() == dim else result
        return Sizes(
            LocalSize(n, whole) if i == dim and n != whole else n for i, n in enumerate(result)
        )

    def whole_sizes(self, func: Any, args: Sequence[Any]) -> tuple[Any, ...] | None:
        """``args`` of an aten op with the rank's size lists (and scalar sizes, at the positions
        :data:`SCALAR_SIZES` gives) that came from a shard replaced by one device's; None when
        none did."""
        if not self.frames:
            return None
        lists, scalars = self.frames[-1]
        positions = SCALAR_SIZES.get(func, ())
        out, changed = [], False
        for index, arg in enumerate(args):
            new = arg
            if isinstance(arg, (list, tuple)) and arg and all(type(n) is int for n in arg):
                whole = lists.get(tuple(arg))
                new = type(arg)(whole) if whole is not None and whole != tuple(arg) else arg
            elif index in positions and type(arg) is int:
                new = scalars.get(arg, arg)
            changed = changed or new is not arg
            out.append(new)
        return tuple(out) if changed else None


#: torch functions whose aten decomposition reshapes with sizes torch computes from the rank's
#: shapes (matmul folds batch dims together; flatten merges dims): checked as one op, their
#: output against one device's, instead of op by op
COMPOSITES = frozenset(
    {
        torch.matmul,
        torch.Tensor.matmul,
        torch.Tensor.__matmul__,
        torch.Tensor.__rmatmul__,
        torch.flatten,
        torch.Tensor.flatten,
        torch.Tensor.unflatten,
        torch.einsum,
    }
)

_SHAPE_READS = frozenset({torch.Tensor.shape.__get__, torch.Tensor.size, torch.Tensor.__len__})  # type: ignore[attr-defined]


def _record(
    args: Any, kwargs: dict[str, Any]
) -> tuple[dict[tuple[int, ...], tuple[int, ...]], dict[int, int]]:
    """The rank's → one device's size lists and scalar sizes among a torch call's arguments: each
    list holding a :class:`LocalSize`, the run of int positional arguments (``view(*sizes)``)."""
    lists: dict[tuple[int, ...], tuple[int, ...]] = {}
    scalars: dict[int, int] = {}
    for value in [*args, *kwargs.values()]:
        _collect(value, lists, scalars)
    run = [v for v in args if isinstance(v, int) and not isinstance(v, bool)]
    if any(isinstance(v, LocalSize) for v in run):
        lists[tuple(int(v) for v in run)] = tuple(whole_of(run))
    return lists, scalars


def _collect(
    value: Any, lists: dict[tuple[int, ...], tuple[int, ...]], scalars: dict[int, int]
) -> None:
    if isinstance(value, LocalSize):
        scalars[int(value)] = value.whole
    elif isinstance(value, slice):
        for bound in (value.start, value.stop, value.step):
            _collect(bound, lists, scalars)
    elif isinstance(value, (list, tuple)) and _tagged(value):
        if all(isinstance(v, int) for v in value):
            lists[tuple(int(v) for v in value)] = tuple(whole_of(value))
        for item in value:
            _collect(item, lists, scalars)
