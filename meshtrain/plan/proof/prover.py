"""The abstract rank: a dispatch mode that propagates tensor-parallel shards through every aten
op of a model's forward on fake tensors, checks each against one device's op, and records where
replicated parameters meet shards (see :mod:`meshtrain.plan.proof.run`).

Example:
    >>> from meshtrain.plan.proof.shard_dims import shard_dim_of
    >>> shard_dim_of((3, 6, 2, 16), (3, 6, 4, 16), ways=2)
    2
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

from meshtrain.errors import PlanError, format_shape
from meshtrain.plan.experts.activations import counts_shape
from meshtrain.plan.experts.axis import is_experts_module
from meshtrain.plan.ir import WHOLE_SEQUENCE, ModuleStyle, ParamLayout, PartialGrad, TPStyle
from meshtrain.plan.proof.boundaries import (
    LEAF_STYLES,
    Refused,
    boundary_in,
    boundary_out,
    whole_forward,
)
from meshtrain.plan.proof.effects import Effects, buffer_owners, parameter_owners
from meshtrain.plan.proof.experts import dense_forward
from meshtrain.plan.proof.refusals import global_reshape, lost, mixed, refuse_partial
from meshtrain.plan.proof.shard_dims import NOT_A_SHARD, reshaped_shard_dim, shard_dim_of
from meshtrain.plan.proof.sizes import SizeProvenance, whole_args
from meshtrain.spec.partition import entry_axes

_aten = torch.ops.aten
_RESHAPES = frozenset({_aten.view.default, _aten._unsafe_view.default, _aten.reshape.default})
#: composite functions that are reshapes (the shard must land where one device's does)
_FLATTENS = frozenset({torch.flatten, torch.Tensor.flatten, torch.Tensor.unflatten})


@dataclass(frozen=True)
class Shard:
    """A rank's tensor is a shard of ``whole`` (one device's tensor) along ``dim`` (viewed as
    ``[outer, size / outer]``, cut on its second part: see
    :func:`~meshtrain.plan.proof.shard_dims.reshaped_shard_dim`)."""

    dim: int
    whole: torch.Tensor
    outer: int = 1


class Prover(TorchDispatchMode):
    """Propagates shards through every aten op and records where replicated parameters meet
    them, and what :class:`~meshtrain.plan.proof.effects.Effects` looks for."""

    def __init__(
        self,
        model: nn.Module,
        params: Sequence[ParamLayout],
        styles: Sequence[ModuleStyle],
        tp_axis: str | None,
        tp_size: int,
        sequence_parallel: bool,
        effects: Effects,
    ) -> None:
        super().__init__()
        self.model, self.layouts = model, {p.fqn: p for p in params}
        self.styles = {s.fqn: s for s in styles}
        self.axis, self.ways, self.sp = tp_axis or "", tp_size, sequence_parallel
        self.split_at_block = any(s.style == TPStyle.SEQUENCE_SPLIT_INPUT for s in styles)
        self.whole = tuple(s.fqn for s in styles if s.style in WHOLE_SEQUENCE)
        self.effects = effects
        effects.sequence_parallel, effects.prepared = sequence_parallel, self._prepares
        self.shards: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.origin: WeakIdKeyDictionary = WeakIdKeyDictionary()  # tensor → parameter FQNs
        self.sizes = SizeProvenance(self._shard_size, self._watch, self._composite)
        self.stack: list[str] = []
        self.quiet = 0
        self.first_input: dict[str, int | None] = {}
        self.found: dict[str, tuple[str, str]] = {}  # parameter → (module, op)
        self.copies: dict[str, str] = {}  # look-alike block → the block that ran
        self.kept_shard: set[str] = set()
        self._patched: list[nn.Module] = []
        self.whole_params: dict[str, dict[str, torch.Tensor]] = {}
        self._buffers_before: list[dict[str, torch.Tensor]] = []

    # -- set-up ---------------------------------------------------------------------------
    def fake_state(self) -> dict[str, torch.Tensor]:
        """Parameters at their tensor-parallel local shapes, buffers whole (created under the
        caller's fake mode); replicated trainable ones remembered by identity."""
        state: dict[str, torch.Tensor] = {}
        owners = parameter_owners(self.model)
        for fqn, param in self.model.named_parameters():
            layout = self.layouts.get(fqn)
            shape = self._local(layout) if layout is not None else tuple(param.shape)
            dtype = param.dtype if param.is_floating_point() else torch.float32
            state[fqn] = torch.empty(shape, dtype=dtype)
            if self.axis:
                self.effects.owners[state[fqn]] = (fqn, owners.get(fqn, ()))
            if layout is not None and self.axis and self.axis in layout.spec.axes:
                self.effects.sharded.add(fqn)
            elif layout is not None and layout.trainable and self.axis:
                self.origin[state[fqn]] = frozenset({fqn})
        writable = buffer_owners(self.model)
        for fqn, buffer in self.model.named_buffers():
            state[fqn] = torch.empty(tuple(buffer.shape), dtype=buffer.dtype)
            if fqn in writable:
                self.effects.buffers[state[fqn]] = fqn
        self._whole_params(state)
        return state

    def _whole_params(self, state: dict[str, torch.Tensor]) -> None:
        for fqn, style in self.styles.items():
            if style.style in LEAF_STYLES:
                module = self.model.get_submodule(fqn)
                self.whole_params[fqn] = {
                    name: torch.empty(tuple(p.shape), dtype=state[_join(fqn, name)].dtype)
                    for name, p in module.named_parameters(remove_duplicate=False)
                    if _join(fqn, name) in state
                }

    def _local(self, layout: ParamLayout) -> tuple[int, ...]:
        entries = layout.spec.padded(len(layout.shape))
        return tuple(
            -(-n // self.ways) if self.axis in entry_axes(entry) else n
            for n, entry in zip(layout.shape, entries)
        )

    def _shard_size(self, tensor: torch.Tensor) -> tuple[int, int] | None:
        shard = self.shards.get(tensor)
        return None if shard is None else (shard.dim, int(shard.whole.shape[shard.dim]))

    def _watch(self, func: Any, args: Any, kwargs: dict[str, Any]) -> None:
        if not self.quiet:
            self.effects.on_call(func, args, kwargs, self.stack)

    def _composite(self, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        """A torch function of :data:`~meshtrain.plan.proof.sizes.COMPOSITES` checked as one
        op: its aten steps run unchecked (their sizes are torch's, from the rank's shapes), its
        output against one device's call."""
        inputs = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        sharded = [t for t in inputs if t in self.shards]
        if self.quiet or not sharded:
            return func(*args, **kwargs)
        self.quiet += 1
        try:
            try:
                output = func(*args, **kwargs)
            except Exception as error:
                raise Refused(self._mixed(func, inputs, error)) from None
            self.effects.on_op(func, args, kwargs, inputs, output, self.stack)
            self._note_origin(func, inputs, sharded, output)
            self._propagate(func, whole_args(args), kwargs, sharded, output, True)
        finally:
            self.quiet -= 1
        return output

    def hook(self, blocks: Sequence[str]) -> list[Any]:
        """Module hooks: the module stack, the styles' boundaries, repeated blocks skipped."""
        handles = []
        for fqn, module in self.model.named_modules():
            handles.append(
                module.register_forward_pre_hook(_bound(self.enter, fqn), with_kwargs=True)
            )
            handles.append(module.register_forward_hook(_bound(self.exit, fqn), with_kwargs=True))
        for fqn, style in self.styles.items():
            module = self.model.get_submodule(fqn) if fqn else self.model
            if style.style in LEAF_STYLES and "forward" not in vars(module):
                own = dense_forward(module) if is_experts_module(module) else module.forward
                module.forward = whole_forward(own, module, self._whole_of(fqn))
                self._patched.append(module)
        for fqn, module in self.model.named_modules():
            if (
                is_experts_module(module)
                and fqn not in self.styles
                and ("forward" not in vars(module))
            ):
                module.forward = dense_forward(module)  # routing's shapes are data-dependent
                self._patched.append(module)
        self._skip_repeated([fqn for fqn in blocks if fqn not in self.styles])
        return handles

    def _whole_of(self, fqn: str) -> Callable[[], dict[str, torch.Tensor]]:
        """One device's parameters of styled module ``fqn`` (made by :meth:`fake_state`, which
        runs after the hooks are in place)."""
        return lambda: self.whole_params.get(fqn, {})

    def _skip_repeated(self, blocks: Sequence[str]) -> None:
        modules = dict(self.model.named_modules())
        first: dict[tuple[Any, ...], str] = {}
        for fqn in blocks:
            module = modules[fqn]
            representative = first.setdefault(_signature(module), fqn)
            if representative == fqn or "forward" in vars(module):
                continue
            module.forward = self._pass_through(module.forward, representative, fqn)
            self._patched.append(module)

    def _pass_through(
        self, forward: Callable[..., Any], representative: str, fqn: str
    ) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            if representative in self.kept_shard and args and isinstance(args[0], torch.Tensor):
                self.copies[fqn] = representative
                return args[0]
            return forward(*args, **kwargs)

        return run

    def restore(self) -> None:
        for module in self._patched:
            del module.forward

    # -- results --------------------------------------------------------------------------
    def partial_grads(self) -> tuple[PartialGrad, ...]:
        """Each replicated parameter that met a shard, with its module's sharded input dim;
        refused when its module does not take the shard as its first input."""
        found = dict(self.found)
        for copy, representative in self.copies.items():
            prefix = representative + "."
            for param, (module, op) in self.found.items():
                if param.startswith(prefix):
                    found[copy + param[len(representative) :]] = (
                        copy + module[len(representative) :],
                        op,
                    )
        result = []
        names = [name for name, _ in self.model.named_parameters()]
        for param, (where, op) in sorted(found.items(), key=lambda item: _order(names, item[0])):
            owner = param.rpartition(".")[0]
            dim = self.first_input.get(representative_fqn(owner, self.copies))
            if dim is None or owner in self.styles:
                raise refuse_partial(param, owner, where, op, self.axis)
            result.append(PartialGrad(param, owner, self.axis, dim, op))
        return tuple(result)

    # -- module boundaries ----------------------------------------------------------------
    def enter(
        self, fqn: str, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        self.stack.append(fqn)
        self._buffers_before.append(dict(module._buffers))  # type: ignore[arg-type]
        first = args[0] if args else None
        if fqn not in self.first_input:
            shard = self.shards.get(first) if isinstance(first, torch.Tensor) else None
            self.first_input[fqn] = shard.dim if shard is not None else None
        style = self.styles.get(fqn)
        if not self.quiet:
            self.effects.on_enter(fqn, module, args, kwargs, style is not None)
        if style is None:
            return args, kwargs
        if style.style == TPStyle.COLWISE and self.sp:
            self._check_parent_called(style)
        if style.style in LEAF_STYLES:
            self.quiet += 1
        return boundary_in(self, style, args, kwargs)

    def _check_parent_called(self, style: ModuleStyle) -> None:
        """Under sequence parallelism a column-wise Linear takes its input gathered by its
        pair's parent: a parent never called (a ModuleDict whose Linears its owner calls) gathers
        nothing, and the Linear would compute on a sequence shard."""
        parents = [
            f
            for f, s in self.styles.items()
            if s.style == TPStyle.PREPARE_INPUT and (not f or style.fqn.startswith(f + "."))
        ]
        parent = max(parents, key=len, default=None)
        if parent is None or parent in self.stack:
            return
        module = self.model.get_submodule(parent) if parent else self.model
        raise Refused(
            PlanError(
                f"'{style.fqn}' is column-wise in a pair under '{parent}' ({type(module).__name__}), "
                f"whose input sequence parallelism gathers once for its Linears, but "
                f"'{parent}' is not called in the forward (its Linears are called directly, from "
                f"'{(self.stack[-2] if len(self.stack) > 1 else '') or '<root>'}'): nothing would gather "
                "their input from its sequence shards. Put the pair in a module whose forward calls "
                "them, or drop the ('seq', ...) activation rule.",
                fqn=style.fqn,
            )
        )

    def exit(
        self,
        fqn: str,
        module: nn.Module,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        output: Any,
    ) -> Any:
        self.stack.pop()
        self.effects.rebound(fqn, module, self._buffers_before.pop())
        style = self.styles.get(fqn)
        if style is not None and style.style in LEAF_STYLES:
            self.quiet -= 1
        result = output if style is None else boundary_out(self, style, output)
        if self.effects.batch_leaves((args, kwargs)):
            self.effects.taint(result)
        leaf = style is not None and style.style in LEAF_STYLES
        if (leaf or fqn in self.effects.units) and isinstance(result, torch.Tensor):
            self.effects.outputs[result] = fqn
        self._keeps_shard(fqn, args, kwargs, result)
        return result

    def _keeps_shard(
        self, fqn: str, args: tuple[Any, ...], kwargs: dict[str, Any], result: Any
    ) -> None:
        first = args[0] if args else kwargs.get("hidden_states")
        if isinstance(first, torch.Tensor) and isinstance(result, torch.Tensor):
            before, after = self.shards.get(first), self.shards.get(result)
            same = (before is None) == (after is None) and (
                before is None or before.dim == after.dim
            )
            if same and first.shape == result.shape:
                self.kept_shard.add(fqn)

    def _prepares(self, fqn: str) -> bool:
        style = self.styles.get(fqn)
        return style is not None and style.style == TPStyle.PREPARE_INPUT

    def shard(
        self, local: torch.Tensor, dim: int, whole: torch.Tensor, outer: int = 1
    ) -> torch.Tensor:
        self.shards[local] = Shard(dim, whole, outer)
        if local in self.effects.batch:
            self.effects.batch[whole] = True
        return local

    def mark(self, tensor: torch.Tensor, fqn: str) -> torch.Tensor:
        """``tensor`` is the input ``fqn``'s lowering marks for its column-wise Linears."""
        self.effects.marked[tensor] = self.effects.marked.get(tensor, frozenset()) | {fqn}
        return tensor

    # -- every aten op --------------------------------------------------------------------
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is _aten.bincount.default:
            return counts_shape(*args, **kwargs)
        if self.quiet:
            return func(*args, **kwargs)
        inputs = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        sharded = [t for t in inputs if t in self.shards]
        try:
            output = func(*args, **kwargs)
        except Exception as error:
            if not sharded:
                raise
            raise Refused(self._mixed(func, inputs, error)) from None
        self.effects.on_op(func, args, kwargs, inputs, output, self.stack)
        self._note_origin(func, inputs, sharded, output)
        resized = self.sizes.whole_sizes(func, args)
        if func.__name__.startswith("new_"):
            sharded = []  # a new tensor of the sizes given: a shard only when they are local
        if sharded or resized is not None:
            self._propagate(func, resized or args, kwargs, sharded, output, resized is not None)
        return output

    def _note_origin(
        self, func: Any, inputs: list[torch.Tensor], sharded: list[torch.Tensor], output: Any
    ) -> None:
        """Views and casts of a replicated parameter stay its; one meeting a shard is partial."""
        origins = [self.origin[t] for t in inputs if t in self.origin and t not in self.shards]
        if not origins:
            return
        if sharded:
            where = self.stack[-1] if self.stack else ""
            for params in origins:
                for param in params:
                    self.found.setdefault(param, (where, str(func)))
        elif len(inputs) == 1:
            for out in pytree.tree_leaves(output):
                if isinstance(out, torch.Tensor):
                    self.origin[out] = origins[0]

    def _propagate(
        self,
        func: Any,
        args: Any,
        kwargs: Any,
        sharded: list[torch.Tensor],
        output: Any,
        known: bool,
    ) -> None:
        """Run ``func`` on one device's tensors too and mark the rank's outputs as their shards.
        Sizes the model's code read off a shard become one device's (``known``:
        :mod:`~meshtrain.plan.proof.sizes`); sizes torch computed from a rank's shapes inside
        an op (``flatten``) are tried scaled to one device's, one at a time, when the op fails
        on them as given."""
        whole_args, whole_kwargs = pytree.tree_map(
            lambda t: (
                self.shards[t].whole if isinstance(t, torch.Tensor) and t in self.shards else t
            ),
            (args, kwargs),
        )
        cut = {t.shape[self.shards[t].dim] for t in sharded}
        candidates = [whole_args] if known else _scaled_sizes(whole_args, self.ways, cut)
        refusal: PlanError | None = None
        chosen = None
        for index, candidate in enumerate(candidates):
            try:  # one device's tensor may be strided where a rank's is not (an expanded dim)
                run = _aten.reshape.default if func in _RESHAPES else func
                whole_output = run(*candidate, **whole_kwargs)
            except Exception:
                continue
            verdict = self._shards_of(func, sharded, output, whole_output)
            if index == 0 and isinstance(verdict, PlanError):
                raise Refused(verdict)  # the sizes as the code gives them: one device's result
            if isinstance(verdict, PlanError):
                refusal = refusal or verdict
            elif all(outer == 1 for *_, outer in verdict):
                chosen = verdict  # a plain shard: preferred over a strided reading
                break
            elif chosen is None:
                chosen = verdict
        if chosen is None:
            raise Refused(refusal or self._lost(func, sharded, output, None, NOT_A_SHARD))
        for local, whole, dim, outer in chosen:
            self.shard(local, dim, whole, outer)

    def _shards_of(
        self, func: Any, sharded: list[torch.Tensor], output: Any, whole_output: Any
    ) -> list[tuple[torch.Tensor, torch.Tensor, int, int]] | PlanError:
        """(rank tensor, one device's, shard dim, its outer factor) per tensor output that is a
        shard, or why one is no shard."""
        found = []
        for local, whole in zip(pytree.tree_leaves(output), pytree.tree_leaves(whole_output)):
            if not isinstance(local, torch.Tensor) or not isinstance(whole, torch.Tensor):
                continue
            dim = shard_dim_of(tuple(local.shape), tuple(whole.shape), ways=self.ways)
            if dim is None and not sharded:
                continue  # a new tensor of one device's sizes: whole
            if dim is None or dim == NOT_A_SHARD:
                return self._lost(func, sharded, local, whole, dim)
            outer = next(
                (
                    self.shards[t].outer
                    for t in sharded
                    if self.shards[t].whole.shape[self.shards[t].dim] == whole.shape[dim]
                ),
                1,
            )
            if (func in _RESHAPES or func in _FLATTENS) and sharded:
                placed = self._check_reshape(func, sharded[0], whole, dim)
                if isinstance(placed, PlanError):
                    return placed
                outer = placed
            found.append((local, whole, dim, outer))
        return found

    # -- refusals -------------------------------------------------------------------------
    def where(self) -> str:
        fqn = self.stack[-1] if self.stack else ""
        module = self.model.get_submodule(fqn) if fqn else self.model
        return f"'{fqn or '<root>'}' ({type(module).__name__})"

    def _fqn(self) -> str | None:
        return self.stack[-1] if self.stack else None

    def describe(self, tensors: Sequence[torch.Tensor]) -> str:
        parts = []
        for t in tensors:
            shard = self.shards.get(t)
            if shard is None:
                parts.append(f"whole {format_shape(tuple(t.shape))}")
            else:
                parts.append(
                    f"{format_shape(tuple(t.shape))} (a shard over '{self.axis}' on dim "
                    f"{shard.dim} of one device's {format_shape(tuple(shard.whole.shape))})"
                )
        return ", ".join(parts)

    def _mixed(self, func: Any, inputs: list[torch.Tensor], error: Exception) -> PlanError:
        return mixed(
            self.where(),
            self._fqn(),
            func,
            self.axis,
            self.describe(inputs),
            str(error).splitlines()[0],
        )

    def _lost(
        self, func: Any, sharded: list[torch.Tensor], local: Any, whole: Any, dim: int | None
    ) -> PlanError:
        shapes = (
            f" (rank {format_shape(tuple(local.shape))}, one device "
            f"{format_shape(tuple(whole.shape))})"
            if isinstance(whole, torch.Tensor) and isinstance(local, torch.Tensor)
            else ""
        )
        sequence = self.sp and any(self.shards[t].dim == 1 for t in sharded)
        return lost(
            self.where(),
            self._fqn(),
            func,
            self.describe(sharded),
            shapes,
            selects=dim is None,
            sequence=sequence,
        )

    def _check_reshape(
        self, func: Any, source: torch.Tensor, whole: torch.Tensor, dim: int
    ) -> PlanError | int:
        """The shard's outer factor after a reshape, or why the reshape cuts it differently."""
        shard = self.shards[source]
        placed = reshaped_shard_dim(
            tuple(shard.whole.shape),
            tuple(whole.shape),
            shard.dim,
            ways=self.ways,
            outer=shard.outer,
        )
        if placed is not None and placed[0] == dim:
            return placed[1]
        expected = placed[0] if placed is not None else None
        return global_reshape(
            self.where(),
            self._fqn(),
            func,
            self.describe([source]),
            dim,
            format_shape(tuple(whole.shape)),
            expected,
        )


def _scaled_sizes(args: tuple[Any, ...], ways: int, cut: set[int]) -> list[tuple[Any, ...]]:
    """``args`` as given, then with one size of one size-list argument multiplied by ``ways``
    (first the sizes equal to a sharded input's local size on its sharded dim: torch computed
    them from a rank's shape)."""
    first: list[tuple[Any, ...]] = [args]
    then: list[tuple[Any, ...]] = []
    for index, arg in enumerate(args):
        if isinstance(arg, (list, tuple)) and arg and all(type(n) is int for n in arg):
            for position, size in enumerate(arg):
                if size >= 1:
                    scaled = type(arg)(n * ways if i == position else n for i, n in enumerate(arg))
                    (first if size in cut else then).append(
                        (*args[:index], scaled, *args[index + 1 :])
                    )
    return first + then


def _bound(method: Callable[..., Any], fqn: str) -> Callable[..., Any]:
    def hook(*args: Any) -> Any:
        return method(fqn, *args)

    return hook


def _signature(module: nn.Module) -> tuple[Any, ...]:
    tensors = [*module.named_parameters(), *module.named_buffers()]
    return (type(module), tuple((name, tuple(t.shape), t.dtype) for name, t in tensors))


def representative_fqn(fqn: str, copies: Mapping[str, str]) -> str:
    """``fqn`` inside the block that ran for its look-alike block (``fqn`` itself otherwise)."""
    for copy, representative in copies.items():
        if fqn == copy or fqn.startswith(copy + "."):
            return representative + fqn[len(copy) :]
    return fqn


def _order(names: list[str], fqn: str) -> int:
    return names.index(fqn) if fqn in names else len(names)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name
