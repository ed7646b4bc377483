"""Each tensor-parallel style's boundary in the abstract run: what its lowering hands the module
on a rank (input) and what it hands on (output) — local, reduced, gathered or scattered.

A *leaf* style's module computes one device's result on whole inputs (its lowering's DTensor
semantics; its inner ops are not looked at); a *region* style only changes its module's input or
output, and the module's own ops are checked. Every :class:`~meshtrain.plan.ir.TPStyle` is in one
of the two sets (a test checks it).

Example:
    >>> TPStyle.ROWWISE in LEAF_STYLES, TPStyle.PREPARE_INPUT in REGION_STYLES
    (True, True)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from meshtrain.errors import PlanError
from meshtrain.plan.ir import ModuleStyle, TPStyle
from meshtrain.plan.tensor.styles import inside


class Prover(Protocol):
    """What a boundary reads and marks on the abstract rank
    (:class:`~meshtrain.plan.proof.prover.Prover`)."""

    ways: int
    sp: bool
    split_at_block: bool
    whole: tuple[str, ...]
    axis: str

    @property
    def shards(self) -> Any: ...  # tensor → its shard (a weak identity dictionary)

    def shard(
        self, local: torch.Tensor, dim: int, whole: torch.Tensor, outer: int = 1
    ) -> torch.Tensor: ...

    def mark(self, tensor: torch.Tensor, fqn: str) -> torch.Tensor: ...

    def describe(self, tensors: Sequence[torch.Tensor]) -> str: ...


#: styles whose module's inner ops their lowering owns (the abstract run emulates only their
#: boundaries)
LEAF_STYLES = frozenset(
    {
        TPStyle.COLWISE,
        TPStyle.ROWWISE,
        TPStyle.ROWWISE_REPLICATED_INPUT,
        TPStyle.COLWISE_GATHERED,
        TPStyle.LOSS_PARALLEL_HEAD,
        TPStyle.VOCAB_PARALLEL_EMBEDDING,
        TPStyle.EMBEDDING_DIM_PARALLEL,
        TPStyle.SEQUENCE_PARALLEL,
        TPStyle.EXPERTS_TENSOR_PARALLEL,
    }
)

#: styles the abstract run emulates at their module's input or output only (the module's own
#: ops are checked)
REGION_STYLES = frozenset(
    {
        TPStyle.PREPARE_INPUT,
        TPStyle.SEQUENCE_SPLIT,
        TPStyle.SEQUENCE_SPLIT_INPUT,
        TPStyle.SEQUENCE_GATHERED,
        TPStyle.SEQUENCE_GATHERED_TAIL,
    }
)


class Refused(Exception):
    """Carries a PlanError through the model's own code (which may catch PlanError-like errors)."""

    def __init__(self, error: PlanError) -> None:
        super().__init__(str(error))
        self.error = error


def boundary_in(
    prover: Prover, style: ModuleStyle, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A style's input as its lowering hands it to the module on a rank."""
    kind = style.style
    if kind in (TPStyle.PREPARE_INPUT, TPStyle.SEQUENCE_GATHERED):
        return _prepared(prover, style, args, kwargs)
    if kind == TPStyle.SEQUENCE_GATHERED_TAIL:
        return _tail(prover, style, args, kwargs)
    if not args or not isinstance(args[0], torch.Tensor):
        return args, kwargs
    x, rest = args[0], args[1:]
    if kind == TPStyle.ROWWISE:
        shard = prover.shards.get(x)
        if shard is None or shard.dim != x.dim() - 1:
            raise Refused(_unpaired(prover, style, x))
    if kind in LEAF_STYLES:
        return (gathered(prover, x), *rest), kwargs
    if kind == TPStyle.SEQUENCE_SPLIT_INPUT and x not in prover.shards:
        local = torch.empty(cut(x.shape, 1, prover.ways), dtype=x.dtype)
        return (prover.shard(local, 1, x), *rest), kwargs
    return args, kwargs


def _prepared(
    prover: Prover, style: ModuleStyle, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A pair parent's (or whole-sequence block's) activation: whole, and marked for the
    column-wise Linears under it."""
    if args and isinstance(args[0], torch.Tensor):
        x = prover.mark(gathered(prover, args[0]), style.fqn)
        return (x, *args[1:]), kwargs
    if style.argument and isinstance(kwargs.get(style.argument), torch.Tensor):
        x = prover.mark(gathered(prover, kwargs[style.argument]), style.fqn)
        return args, {**kwargs, style.argument: x}
    return args, kwargs


def _tail(
    prover: Prover, style: ModuleStyle, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The model's tail gathers a sequence shard; anything else there is no plan."""
    positional = bool(args) and isinstance(args[0], torch.Tensor)
    x = args[0] if positional else kwargs.get(style.argument)
    shard = prover.shards.get(x) if isinstance(x, torch.Tensor) else None
    if shard is None or shard.dim != 1:
        what = prover.describe([x]) if isinstance(x, torch.Tensor) else type(x).__name__
        raise Refused(
            PlanError(
                f"'{style.fqn}' ({style.module_type}) is where sequence parallelism gathers the "
                f"sequence before the model's output (its last module with parameters), but on a rank "
                f"it receives {what}, not a sequence shard: it does not run after the blocks. Shard "
                f"the output head column-wise (P('{prover.axis}') on its weight), or drop the "
                "('seq', ...) activation rule.",
                fqn=style.fqn,
            )
        )
    if positional:
        return (shard.whole, *args[1:]), kwargs
    return args, {**kwargs, style.argument: shard.whole}


def boundary_out(prover: Prover, style: ModuleStyle, output: Any) -> Any:
    """A style's output as its lowering hands it on: local, reduced, gathered or scattered."""
    if not isinstance(output, torch.Tensor):
        return output
    kind, ways = style.style, prover.ways
    if kind in (TPStyle.COLWISE, TPStyle.LOSS_PARALLEL_HEAD, TPStyle.SEQUENCE_PARALLEL):
        dim = 1 if kind == TPStyle.SEQUENCE_PARALLEL else output.dim() - 1
        local = torch.empty(cut(output.shape, dim, ways), dtype=output.dtype)
        return prover.shard(local, dim, output)
    scattered = kind == TPStyle.ROWWISE or (
        kind == TPStyle.VOCAB_PARALLEL_EMBEDDING and not prover.split_at_block
    )
    if kind in LEAF_STYLES:  # reduced or gathered: whole, or scattered to sequence shards
        if prover.sp and scattered and not inside(style.fqn, prover.whole):
            local = torch.empty(cut(output.shape, 1, ways), dtype=output.dtype)
            return prover.shard(local, 1, output)
        return output
    if kind in (TPStyle.SEQUENCE_SPLIT, TPStyle.SEQUENCE_GATHERED) and output not in prover.shards:
        local = torch.empty(cut(output.shape, 1, ways), dtype=output.dtype)
        return prover.shard(local, 1, output)
    return output


def gathered(prover: Prover, x: torch.Tensor) -> torch.Tensor:
    """The whole activation of a sharded input (all-gathered by the lowering)."""
    shard = prover.shards.get(x)
    return x if shard is None else shard.whole


def cut(shape: Sequence[int], dim: int, ways: int) -> tuple[int, ...]:
    dim %= len(shape)
    return tuple(n // ways if i == dim else n for i, n in enumerate(shape))


def _unpaired(prover: Prover, style: ModuleStyle, x: torch.Tensor) -> PlanError:
    return PlanError(
        f"'{style.fqn}' ({style.module_type}) is lowered row-wise, which takes the local output "
        f"of column-wise Linears (sharded over tensor-parallel axis '{prover.axis}' on its last "
        f"dim), but on a rank it receives {prover.describe([x])}. Shard the projection producing "
        f"its input column-wise, or replicate '{style.fqn}.weight' (spec P()).",
        fqn=style.fqn,
    )


def whole_forward(
    forward: Any, module: nn.Module, params: Callable[[], dict[str, torch.Tensor]]
) -> Any:
    """``forward`` run with ``module``'s parameters swapped for one device's (``params()``, by
    name under ``module``, read at call time): a styled module computes what its lowering
    computes."""

    def run(*args: Any, **kwargs: Any) -> Any:
        whole = params()
        owners = {name: module.get_submodule(name.rpartition(".")[0]) for name in whole}
        saved = {name: owner._parameters[name.rpartition(".")[2]] for name, owner in owners.items()}
        for name, owner in owners.items():
            owner._parameters[name.rpartition(".")[2]] = whole[name]  # type: ignore[assignment]
        try:
            return forward(*args, **kwargs)
        finally:
            for name, owner in owners.items():
                owner._parameters[name.rpartition(".")[2]] = saved[name]

    return run
