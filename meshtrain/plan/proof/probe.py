"""The inputs of the plan-time abstract run: the user's example, or a batch meshtrain can build.

``mt.plan(..., example_inputs=...)`` (the harness, the recipes and ``meshtrain check`` pass their
first batch) gives the model's inputs: a tensor (one positional input), a tuple of positional
inputs, or a mapping of keyword inputs. Only shapes and dtypes are kept (the run is on fake
tensors); the batch dim (dim 0, when every tensor input shares it) becomes an odd size that is no
dimension of the model, so sizes in the run are unambiguous.

Without an example, a batch is built only where its kind is certain: token ids for a model whose
forward takes ``input_ids`` or whose first module is an ``nn.Embedding``; images from a vision
config (``pixel_values``); ``[batch, seq, features]`` for a model whose first module is an
``nn.Linear``. Anything else (a convolution first) is no guess: :func:`probe_for` says why, and
planning asks for ``example_inputs`` in one line.

Example:
    >>> import torch
    >>> from torch import nn
    >>> probe_for(nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10)), None, tp_size=2).describe()
    'a fake [3, 6] token batch'
    >>> probe_for(nn.Sequential(nn.Linear(6, 2)), torch.zeros(4, 6), tp_size=2).describe()
    'the example inputs (batch resized to 3): 3×6 float32'
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from meshtrain.errors import format_shape


@dataclass(frozen=True)
class TensorSpec:
    """A probe input's shape and dtype (made a fake tensor when the run starts)."""

    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class Probe:
    """One abstract forward's inputs: positional and keyword, tensors as :class:`TensorSpec`;
    ``kind`` is 'tokens', 'images', 'features' or 'example'."""

    args: tuple[Any, ...]
    kwargs: tuple[tuple[str, Any], ...]
    kind: str
    resized_from: int | None = None

    def make(self) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The inputs as tensors (call under the run's fake mode); values are zeros."""
        made = pytree.tree_map(
            lambda leaf: (
                torch.zeros(leaf.shape, dtype=leaf.dtype) if isinstance(leaf, TensorSpec) else leaf
            ),
            (self.args, dict(self.kwargs)),
        )
        return made[0], made[1]

    def tensors(self) -> list[TensorSpec]:
        leaves = pytree.tree_leaves((self.args, dict(self.kwargs)))
        return [leaf for leaf in leaves if isinstance(leaf, TensorSpec)]

    def describe(self) -> str:
        first = self.tensors()[0] if self.tensors() else None
        if self.kind != "example" and first is not None:
            return f"a fake [{', '.join(map(str, first.shape))}] {_KINDS[self.kind]}"
        resized = f" (batch resized to {first.shape[0]})" if first and self.resized_from else ""
        shapes = ", ".join(
            f"{format_shape(t.shape)} {str(t.dtype).removeprefix('torch.')}" for t in self.tensors()
        )
        return f"the example inputs{resized}: {shapes}"


_KINDS = {"tokens": "token batch", "images": "image batch", "features": "feature batch"}

#: example inputs given to the planning call running now (``mt.plan(example_inputs=...)``)
_EXAMPLE: ContextVar[Any] = ContextVar("meshtrain_example_inputs", default=None)


@contextlib.contextmanager
def example_inputs(example: Any) -> Iterator[None]:
    """Plan with ``example`` as the abstract run's inputs (``None``: build a probe)."""
    token = _EXAMPLE.set(example)
    try:
        yield
    finally:
        _EXAMPLE.reset(token)


def current_example() -> Any:
    """The example inputs of the planning call running now, or ``None``."""
    return _EXAMPLE.get()


def probe_for(model: nn.Module, example: Any, *, tp_size: int) -> Probe | str:
    """The abstract run's inputs: ``example`` resized (see module doc), else a built probe, else
    why none can be built (a phrase naming the model's first module)."""
    if example is not None:
        return _from_example(model, example)
    return _guessed(model, tp_size)


def _from_example(model: nn.Module, example: Any) -> Probe:
    args: tuple[Any, ...]
    if isinstance(example, Mapping):
        args, kwargs = (), dict(example)
    elif isinstance(example, (tuple, list)):
        args, kwargs = tuple(example), {}
    else:
        args, kwargs = (example,), {}
    leaves = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    rows = {int(t.shape[0]) for t in leaves if t.dim() >= 1}
    old = next(iter(rows)) if len(rows) == 1 else None
    seq = next((int(t.shape[1]) for t in leaves if t.dim() >= 2), 0)
    batch = probe_batch(model, seq) if old is not None else None

    def spec(leaf: Any) -> Any:
        if not isinstance(leaf, torch.Tensor):
            return leaf
        shape = tuple(int(n) for n in leaf.shape)
        if batch is not None and shape and shape[0] == old:
            shape = (batch, *shape[1:])
        return TensorSpec(shape, leaf.dtype)

    made = pytree.tree_map(spec, (args, kwargs))
    return Probe(tuple(made[0]), tuple(made[1].items()), "example", old)


def _guessed(model: nn.Module, tp_size: int) -> Probe | str:
    seq = probe_length(model, tp_size)
    batch = probe_batch(model, seq)
    config = getattr(model, "config", None)
    first = _first_argument(model)
    size, channels = getattr(config, "image_size", None), getattr(config, "num_channels", None)
    if first == "pixel_values" and isinstance(size, int) and isinstance(channels, int):
        return Probe((TensorSpec((batch, channels, size, size), torch.float32),), (), "images")
    leaf = _first_leaf(model)
    if first == "input_ids" or isinstance(leaf, nn.Embedding):
        return Probe((TensorSpec((batch, seq), torch.long),), _decoder(model, batch, seq), "tokens")
    if isinstance(leaf, nn.Linear):
        return Probe((TensorSpec((batch, seq, leaf.in_features), torch.float32),), (), "features")
    fqn = next((f for f, m in model.named_modules() if m is leaf), "")
    what = f"'{fqn}' ({type(leaf).__name__})" if leaf is not None else "no module with parameters"
    return (
        f"meshtrain cannot build an input for {type(model).__name__}, whose first module is "
        f"{what} (it builds token ids for an Embedding, [batch, seq, features] for a Linear)"
    )


def _first_argument(model: nn.Module) -> str:
    try:
        return next(iter(inspect.signature(model.forward).parameters), "")
    except (TypeError, ValueError):
        return ""


def _first_leaf(model: nn.Module) -> nn.Module | None:
    """The first leaf module (registration order) holding parameters: where the inputs go."""
    holders = [m for m in model.modules() if any(True for _ in m.parameters(recurse=False))]
    leaves = [m for m in holders if not any(True for _ in m.children())]
    return next(iter(leaves or holders), None)


def _decoder(model: nn.Module, batch: int, seq: int) -> tuple[tuple[str, Any], ...]:
    """An encoder-decoder's decoder tokens (the same probe batch)."""
    try:
        names = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return ()
    if "decoder_input_ids" not in names:
        return ()
    return (("decoder_input_ids", TensorSpec((batch, seq), torch.long)),)


def probe_length(model: nn.Module, tp_size: int) -> int:
    """A sequence length that divides by ``tp_size`` and is no dimension of any parameter or
    buffer of ``model`` (so a dim's size says which dim it is), within its position table.

    Example:
        >>> probe_length(nn.Linear(6, 10), 2)
        14
    """
    sizes = {n for t in (*model.parameters(), *model.buffers()) for n in t.shape}
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None) or 1 << 16
    for multiple in range(3, 1 << 12, 2):
        seq = tp_size * multiple
        if seq not in sizes and seq != tp_size:
            return seq if seq <= limit else tp_size * 3
    return tp_size * 3


def probe_batch(model: nn.Module, seq: int) -> int:
    """An odd batch size that is no dimension of ``model`` and not ``seq`` (a batch of 1 would
    merge with size-1 dims in reshapes and leave them ambiguous).

    Example:
        >>> probe_batch(nn.Linear(3, 5), 14)
        7
    """
    sizes = {n for t in (*model.parameters(), *model.buffers()) for n in t.shape} | {seq}
    return next(n for n in range(3, 1 << 12, 2) if n not in sizes)


def signature(probe: Probe | str) -> str:
    """A key for caches: the probe's kind and inputs."""
    return probe if isinstance(probe, str) else repr((probe.kind, probe.args, probe.kwargs))
