"""What the abstract run sees a model's forward do besides computing shards — each a way an
accepted plan would crash at the first forward or train differently from one device:

- **a parameter read outside its owner's forward** (a tied head ``F.linear(h, embed.weight)``, a
  functional conv on a child's weight): a replicated one is recorded (the lowering hands the
  reader local tensors, :class:`~meshtrain.plan.ir.ParamReader`); a tensor-parallel one is
  refused, naming the parameter and the reader (no local tensor there is one device's weight);
- **an in-place update of a styled module's output** (``out += x`` after a row-wise Linear): the
  lowering's output is a view made by DTensor's ``to_local``, which autograd forbids modifying in
  place, so the plan records the module and the lowering hands out a fresh tensor;
- **a buffer written from the batch** (a hand-made running mean; BatchNorm's statistics are the
  lowering's, :mod:`meshtrain.lower.data.batch_norm`): each data-parallel rank would update it from its
  own rows; found here by following what the batch flows into;
- **a module under a pair's prepare point reading the input marked for the column-wise Linears**
  (the lowering makes that input one DTensor for them): refused, naming the module;
- **attention shapes context parallelism cannot split** (checked where the model calls scaled
  dot-product attention, naming the module).

Example:
    >>> mutated(torch.ops.aten.add_.Tensor, (torch.ones(1), torch.ones(1)), {})[0].shape
    torch.Size([1])
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils.weak import WeakIdKeyDictionary

from meshtrain.errors import PlanError
from meshtrain.plan.context.axis import attention_shape_error
from meshtrain.plan.proof.boundaries import Refused

_aten = torch.ops.aten

#: scaled dot-product attention as the model calls it (q, k, v first)
ATTENTION_CALLS = frozenset({torch.nn.functional.scaled_dot_product_attention})


#: why a pair parent's input is one replicated DTensor under sequence parallelism, and the fix
_WHY_SEQUENCE_PARALLEL = (
    "sequence parallelism gathers into one replicated activation",
    "or drop the ('seq', ...) activation rule",
)


@dataclass
class Effects:
    """State the abstract run keeps about the forward's effects (see module doc)."""

    # param → (fqn, owners)
    owners: WeakIdKeyDictionary = field(default_factory=WeakIdKeyDictionary)
    sharded: set[str] = field(default_factory=set)  # parameters sharded over the tp axis
    buffers: WeakIdKeyDictionary = field(default_factory=WeakIdKeyDictionary)  # tensor → fqn
    batch: WeakIdKeyDictionary = field(default_factory=WeakIdKeyDictionary)  # batch-derived
    outputs: WeakIdKeyDictionary = field(default_factory=WeakIdKeyDictionary)  # → styled module
    marked: WeakIdKeyDictionary = field(default_factory=WeakIdKeyDictionary)  # → prepare points
    reads: dict[str, str] = field(default_factory=dict)  # parameter → first reader
    written: dict[str, str] = field(default_factory=dict)  # buffer → module that wrote it
    fresh: list[str] = field(default_factory=list)  # styled modules whose output is updated
    reread: set[str] = field(default_factory=set)  # buffers read after the batch wrote them
    context: bool = False
    units: frozenset[str] = frozenset()  # FSDP units resharded after forward
    sequence_parallel: bool = False  # pair parents' inputs become one replicated DTensor
    why_dtensor: tuple[str, str] = _WHY_SEQUENCE_PARALLEL
    prepared: Callable[[str], bool] = lambda fqn: False

    def on_op(
        self,
        func: Any,
        args: Any,
        kwargs: Any,
        inputs: list[torch.Tensor],
        output: Any,
        stack: Sequence[str],
    ) -> None:
        """Called for every aten op the run looks at (outside styled modules)."""
        where = stack[-1] if stack else ""
        self._reads(inputs, stack)
        if self.sequence_parallel:
            self._gathered_read(func, inputs, stack)
        outs = [t for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor)]
        writes = mutated(func, args, kwargs)
        for tensor in inputs:
            buffer = self.buffers.get(tensor)
            writer = self.written.get(buffer) if buffer is not None else None
            if writer is not None and writer in stack and not any(tensor is w for w in writes):
                self.reread.add(buffer)
        for written in writes:
            self._write(written, inputs, where)
        self._follow(func, inputs, outs)

    def on_call(self, func: Any, args: Any, kwargs: dict[str, Any], stack: Sequence[str]) -> None:
        """Called for every torch function the model calls (outside styled modules)."""
        if self.context and func in ATTENTION_CALLS:
            q, k, v = (list(args) + [kwargs.get(n) for n in ("query", "key", "value")])[:3]
            if all(isinstance(t, torch.Tensor) for t in (q, k, v)):
                self._attention((q, k, v), stack[-1] if stack else "")

    def _reads(self, inputs: list[torch.Tensor], stack: Sequence[str]) -> None:
        for tensor in inputs:
            found = self.owners.get(tensor)
            if found is None:
                continue
            fqn, owners = found
            if fqn not in self.reads and not any(owner in stack for owner in owners):
                self.reads[fqn] = stack[-1] if stack else ""

    def _write(self, tensor: torch.Tensor, inputs: list[torch.Tensor], where: str) -> None:
        module = self.outputs.get(tensor)
        if module is not None and module not in self.fresh:
            self.fresh.append(module)
        buffer = self.buffers.get(tensor)
        if buffer is not None and any(t in self.batch for t in inputs if t is not tensor):
            self.written.setdefault(buffer, where)

    def _follow(self, func: Any, inputs: list[torch.Tensor], outs: list[torch.Tensor]) -> None:
        """Batch-derived values, prepare-point marks, views of styled outputs and buffers."""
        if any(t in self.batch for t in inputs):
            for out in outs:
                self.batch[out] = True
        marks = frozenset().union(*(self.marked[t] for t in inputs if t in self.marked))
        if marks:
            for out in outs:
                self.marked[out] = marks
        if getattr(func, "is_view", False) and inputs:
            for table in (self.outputs, self.buffers):
                if inputs[0] in table:
                    for out in outs:
                        table[out] = table[inputs[0]]

    def _attention(self, args: Any, where: str) -> None:
        q, k, v = args[:3]
        why = attention_shape_error(tuple(q.shape), tuple(k.shape), tuple(v.shape))
        if why is not None:
            raise Refused(
                PlanError(
                    f"module '{where or '<root>'}' calls attention that context parallelism cannot "
                    f"split: {why} Train it without the ('seq', ...) context rule, or give its values "
                    "the query/key head size (pad v, as flash-attention paths of such models do).",
                    fqn=where or None,
                )
            )

    def on_enter(self, fqn: str, module: nn.Module, args: Any, kwargs: Any, styled: bool) -> None:
        """Under sequence parallelism a pair parent's input is gathered into one DTensor for its
        column-wise Linears: a module with parameters of its own and no style reading it would
        compute on that DTensor (refused)."""
        if not self.sequence_parallel or styled:
            return
        if not any(True for _ in module.parameters(recurse=False)):
            return
        for point in self._points(pytree.tree_leaves((args, kwargs)), [fqn]):
            raise Refused(
                _gathered_refusal(
                    point, f"module '{fqn}' ({type(module).__name__})", fqn, self.why_dtensor
                )
            )

    def _gathered_read(self, func: Any, inputs: list[torch.Tensor], stack: Sequence[str]) -> None:
        """An op of the pair parent's own code on the gathered input (``x + attention(x)``
        inside it), refused under sequence parallelism (see :meth:`on_enter`)."""
        for point in self._points(inputs, stack):
            where = stack[-1] if stack else ""
            raise Refused(
                _gathered_refusal(point, f"'{where or '<root>'}' ({func})", where, self.why_dtensor)
            )

    def _points(self, values: Sequence[Any], stack: Sequence[str]) -> list[str]:
        found = []
        for value in values:
            if isinstance(value, torch.Tensor) and value in self.marked:
                found += [
                    p
                    for p in self.marked[value]
                    if self.prepared(p)
                    and any(s == p or s.startswith(p + ".") or not p for s in stack)
                ]
        return found

    def batch_leaves(self, value: Any) -> bool:
        return any(
            isinstance(t, torch.Tensor) and t in self.batch for t in pytree.tree_leaves(value)
        )

    def taint(self, value: Any) -> None:
        for t in pytree.tree_leaves(value):
            if isinstance(t, torch.Tensor):
                self.batch[t] = True

    def rebound(self, fqn: str, module: nn.Module, before: dict[str, torch.Tensor]) -> None:
        """A buffer attribute given a new batch-derived tensor in the forward (``self.x = ...``)."""
        for name, old in before.items():
            new = module._buffers.get(name)
            if new is not None and new is not old and new in self.batch:
                self.written.setdefault(f"{fqn}.{name}" if fqn else name, fqn)


def _gathered_refusal(point: str, what: str, fqn: str, why: tuple[str, str]) -> PlanError:
    return PlanError(
        f"{what} computes on the input of '{point or '<root>'}', which {why[0]} for its "
        "column-wise Linears (a residual or a norm inside the module): it cannot use it there. "
        f"Move that computation out of '{point or '<root>'}' (to its caller), {why[1]}.",
        fqn=fqn or None,
    )


def mutated(func: Any, args: Any, kwargs: Any) -> list[torch.Tensor]:
    """The tensors an aten op writes in place (its arguments marked as written)."""
    schema = getattr(func, "_schema", None)
    if schema is None or not schema.is_mutable:
        return []
    found = []
    for index, argument in enumerate(schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = args[index] if index < len(args) else kwargs.get(argument.name)
        if isinstance(value, torch.Tensor):
            found.append(value)
    return found


def buffer_owners(model: nn.Module) -> dict[str, str]:
    """Buffers a forward may write from the batch, by FQN → owning module: every floating-point
    buffer except BatchNorm's statistics (the lowering computes those over the global batch)."""
    found = {}
    for fqn, module in model.named_modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            continue
        for name, buffer in module.named_buffers(recurse=False):
            if buffer is not None and buffer.is_floating_point():
                found[f"{fqn}.{name}" if fqn else name] = fqn
    return found


def parameter_owners(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """Each parameter (first name) → every module holding it (tied parameters: several)."""
    first: dict[int, str] = {}
    owners: dict[str, list[str]] = {}
    for fqn, param in model.named_parameters(remove_duplicate=False):
        name = first.setdefault(id(param), fqn)
        owners.setdefault(name, []).append(fqn.rpartition(".")[0])
    return {name: tuple(dict.fromkeys(found)) for name, found in owners.items()}
