"""Where sequence parallelism may split the sequence: at the embeddings, or at the first block.

Under sequence parallelism the activations between blocks are sequence shards. Splitting right at
the input embeddings is cheapest (the vocab-parallel embedding reduce-scatters instead of
all-reducing), but only correct when nothing between the embeddings and the first block derives a
position-dependent value — position ids, rotary tables, attention masks — from the embedded
activation's length: Hugging Face models build ``position_ids`` from ``inputs_embeds.shape[1]``,
so they would see a shard's length instead of the sequence's. meshtrain's Llama slices its tables
by the token ids' length and does not.

:func:`sequence_split_point` finds out by running the model's forward on fake tensors twice — once
as it is, once with every sequence-split embedding's output cut to one shard — up to the first
block, and comparing what the first block receives besides its activation. If anything changed,
the split moves to the first block's input (the embeddings stay replicated), so that code sees the
global sequence. Pure: fake tensors, no memory, no collectives.

Example:
    >>> from meshtrain.models import LlamaConfig, build_llama
    >>> model = build_llama(LlamaConfig.debug(), device="meta")
    >>> sequence_split_point(model, ("layers.0", "layers.1"), ("tok_embeddings",), tp_size=2)
    ''
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import optree
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from meshtrain.errors import PlanError, format_shape
from meshtrain.plan.ir import ModuleStyle, TPStyle
from meshtrain.plan.layers import lookalike_blocks, shared_tensors
from meshtrain.plan.tensor.styles import activation_argument


class _Reached(Exception):
    """Raised in the first block's pre-hook: what it received, and where the forward stops."""

    def __init__(self, shapes: tuple[tuple[int, ...], ...], activation: tuple[int, ...]) -> None:
        super().__init__()
        self.shapes, self.activation = shapes, activation


def sequence_split_point(
    model: nn.Module,
    blocks: Sequence[str],
    embeddings: Sequence[str],
    *,
    tp_size: int,
    seq_len: int | None = None,
) -> str:
    """``""`` to split at the ``embeddings``' outputs, or the first block's FQN to split at its
    input (see the module docstring). ``seq_len`` (default ``8 × tp_size``) is the probe's length.

    Raises :class:`PlanError` when the first block would receive an activation whose sequence
    dim is not the shard's (the model changes the sequence length before its blocks).
    """
    if not blocks or not embeddings:
        return ""
    length = seq_len or 8 * tp_size
    key = (
        tuple(blocks),
        tuple(embeddings),
        tp_size,
        length,
        tuple((fqn, tuple(p.shape), p.dtype) for fqn, p in model.named_parameters()),
    )
    known = _SPLITS.setdefault(model, {})
    if key not in known:
        known[key] = _split_point(model, blocks, embeddings, tp_size, length)
    return known[key]


#: model → split points found, freed with the model (planning one model many ways, as the
#: automatic search does, runs the probe once per tensor-parallel degree and sequence length)
_SPLITS: weakref.WeakKeyDictionary[nn.Module, dict[tuple[Any, ...], str]] = (
    weakref.WeakKeyDictionary()
)


def _split_point(
    model: nn.Module, blocks: Sequence[str], embeddings: Sequence[str], tp_size: int, length: int
) -> str:
    whole = _first_block_inputs(model, blocks, embeddings, length, shard=None)
    if whole is None:
        return ""
    sharded = _first_block_inputs(model, blocks, embeddings, length, shard=length // tp_size)
    assert sharded is not None
    if len(sharded.activation) < 2 or sharded.activation[1] != length // tp_size:
        raise PlanError(
            f"sequence parallelism cuts the output of {list(embeddings)} into sequence shards, "
            f"but the first block '{blocks[0]}' then receives an activation of shape "
            f"{format_shape(sharded.activation)} (a [batch, {length}] batch, shards of "
            f"{length // tp_size}): the model changes the sequence length before its blocks "
            "(e.g. prepends a token). Drop the ('seq', ...) activation rule."
        )
    return "" if sharded.shapes == whole.shapes else blocks[0]


def _first_block_inputs(
    model: nn.Module,
    blocks: Sequence[str],
    embeddings: Sequence[str],
    length: int,
    shard: int | None,
) -> _Reached | None:
    """What the first block receives on a fake ``[2, length]`` token batch (None when the
    forward fails before reaching it: the probe cannot tell, and the split stays put)."""
    modules = dict(model.named_modules())
    handles = [modules[blocks[0]].register_forward_pre_hook(_stop, with_kwargs=True)]
    shared = shared_tensors(model, lookalike_blocks(model, blocks))
    if shard is not None:
        for fqn in embeddings:
            handles.append(modules[fqn].register_forward_hook(_narrow(shard)))
    try:
        with FakeTensorMode(allow_non_fake_inputs=False):
            state = {
                name: torch.empty(tuple(value.shape), dtype=value.dtype)
                for name, value in (*model.named_parameters(), *model.named_buffers())
                if name not in shared
            }
            state.update({name: state[twin] for name, twin in shared.items()})
            tokens = torch.zeros(2, length, dtype=torch.long)
            torch.func.functional_call(model, state, (tokens,))
    except _Reached as reached:
        return reached
    except Exception:  # the model's own forward on fake token ids: nothing to compare
        return None
    finally:
        for handle in handles:
            handle.remove()
    return None


def _stop(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    argument = activation_argument(module)
    if args:
        activation, rest = args[0], (args[1:], kwargs)
    else:
        activation = kwargs.get(argument)
        rest = ((), {key: value for key, value in kwargs.items() if key != argument})
    if not isinstance(activation, torch.Tensor):
        return
    leaves: list[Any] = optree.tree_leaves(rest)  # type: ignore[arg-type]
    others = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
    raise _Reached(tuple(tuple(t.shape) for t in others), tuple(activation.shape))


def _narrow(shard: int) -> Any:
    def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        if isinstance(output, torch.Tensor) and output.dim() >= 2:
            return output.narrow(1, 0, shard)
        return output

    return hook


def place_sequence_split(
    model: nn.Module,
    styles: tuple[ModuleStyle, ...],
    blocks: Sequence[str],
    *,
    tp_size: int,
    seq_len: int | None = None,
) -> tuple[ModuleStyle, ...]:
    """The sequence-parallel styles with the split where :func:`sequence_split_point` puts it:
    unchanged when at the embeddings; otherwise the replicated embeddings' ``sequence_split``
    styles dropped and a ``sequence_split_input`` style on the first block."""
    embeddings = [s.fqn for s in styles if s.style in _SPLIT_EMBEDDINGS]
    styled = [s.fqn for s in styles]
    # a block that is itself styled or inside a styled module (a Linear of a pair that sits in a
    # ModuleDict) is no place to split the stream
    blocks = [b for b in blocks if not any(b == f or b.startswith(f + ".") for f in styled if f)]
    point = sequence_split_point(model, blocks, embeddings, tp_size=tp_size, seq_len=seq_len)
    if not point:
        return styles
    module = model.get_submodule(point)
    axis = styles[0].axis
    split = ModuleStyle(
        point,
        type(module).__name__,
        TPStyle.SEQUENCE_SPLIT_INPUT,
        axis,
        "input sliced into sequence shards here, not at the embeddings: the model derives "
        "positions, rotary tables or masks from the embedded sequence, so those see it whole",
        activation_argument(module),
    )
    kept = tuple(s for s in styles if s.style != TPStyle.SEQUENCE_SPLIT)
    return (*kept, split)


#: styles whose output becomes sequence shards when the split is at the embeddings
_SPLIT_EMBEDDINGS = (TPStyle.VOCAB_PARALLEL_EMBEDDING, TPStyle.SEQUENCE_SPLIT)
