"""What the planner needs to know about modules it did not write: which are Linear-like (and
their weight layout), their widths, which parameters are the same tensor under two names, and
which blocks look alike (an abstract run computes the first and lets the others pass through).

Hugging Face's ``Conv1D`` (GPT-2) is a Linear whose weight is stored ``[in, out]``; its specs
describe that true layout, so column-wise is ``P(None, tp)`` on its weight. It is recognised by
class name and its ``nx``/``nf`` widths, without importing ``transformers``.

Example:
    >>> linear_widths(nn.Linear(4, 8))
    (4, 8)
    >>> tied = nn.ModuleDict({"a": nn.Embedding(8, 4), "b": nn.Linear(4, 8, bias=False)})
    >>> tied["b"].weight = tied["a"].weight
    >>> tied_groups(tied)
    (('a.weight', 'b.weight'),)
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from typing import Any

import torch
from torch import nn

from meshtrain.errors import PlanError


def is_transposed_linear(module: nn.Module) -> bool:
    """A Linear-like module whose weight is ``[in, out]`` (Hugging Face's ``Conv1D``)."""
    return (
        type(module).__name__ == "Conv1D"
        and isinstance(getattr(module, "nx", None), int)
        and isinstance(getattr(module, "nf", None), int)
    )


def is_linear_like(module: nn.Module) -> bool:
    """``nn.Linear`` or a transposed Linear."""
    return isinstance(module, nn.Linear) or is_transposed_linear(module)


def linear_widths(module: nn.Module) -> tuple[int, int] | None:
    """(in, out) features of a Linear-like module, else None."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    if is_transposed_linear(module):
        return int(module.nx), int(module.nf)  # type: ignore[arg-type]
    return None


def tied_groups(model: nn.Module) -> tuple[tuple[str, ...], ...]:
    """Names that share one parameter tensor (tied weights), each group in registration order:
    the first name is the one ``named_parameters()`` yields, the others are aliases."""
    names: dict[int, list[str]] = {}
    for fqn, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(fqn)
    return tuple(tuple(group) for group in names.values() if len(group) > 1)


def block_signature(module: nn.Module) -> tuple[Any, ...]:
    """What makes two blocks compute alike: class and parameter/buffer names, shapes and dtypes."""
    tensors = [*module.named_parameters(), *module.named_buffers()]
    return (type(module), tuple((name, tuple(t.shape), t.dtype) for name, t in tensors))


def lookalike_blocks(model: nn.Module, blocks: Sequence[str]) -> dict[str, str]:
    """Each block after the first of its signature → that first block (its representative)."""
    modules = dict(model.named_modules())
    first: dict[tuple[Any, ...], str] = {}
    found = {}
    for fqn in blocks:
        representative = first.setdefault(block_signature(modules[fqn]), fqn)
        if representative != fqn:
            found[fqn] = representative
    return found


def shared_tensors(model: nn.Module, lookalikes: dict[str, str]) -> dict[str, str]:
    """Parameter and buffer FQNs inside look-alike blocks → the representative's FQN of the same
    place, for tensors no module outside their block holds: an abstract run may give such a
    tensor its representative's fake (a block that passes its input through reads none of its
    own), instead of making one per block of a deep model."""
    names: dict[int, list[str]] = {}
    for fqn, tensor in (
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ):
        names.setdefault(id(tensor), []).append(fqn)
    first = {group[0] for group in names.values()}
    shared = {}
    for group in names.values():
        block = enclosing_block(group[0], lookalikes)
        if block is None or not all(name.startswith(block + ".") for name in group):
            continue
        twin = lookalikes[block] + group[0][len(block) :]
        if twin in first:
            shared[group[0]] = twin
    return shared


def enclosing_block(fqn: str, blocks: Container[str]) -> str | None:
    """The block of ``blocks`` that ``fqn`` lies strictly inside, else None.

    >>> enclosing_block("layers.3.attn.wq.weight", {"layers.3"})
    'layers.3'
    """
    end = fqn.rfind(".")
    while end > 0:
        if fqn[:end] in blocks:
            return fqn[:end]
        end = fqn.rfind(".", 0, end)
    return None


def main_output(output: Any) -> torch.Tensor:
    """The tensor a model or block returns: itself, the ``logits`` (or first tensor) of a
    ``ModelOutput`` or dict, or the first element of a tuple."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, dict):
        logits = output.get("logits")
        values = [logits] if isinstance(logits, torch.Tensor) else list(output.values())
    else:
        values = list(output)
    first = next((value for value in values if isinstance(value, torch.Tensor)), None)
    if first is None:
        raise PlanError(
            f"a pipeline stage's output is a {type(output).__name__} without a tensor in it: "
            "a block must return its activation (or a tuple/ModelOutput starting with it)."
        )
    return first
