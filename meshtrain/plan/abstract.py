"""The plan-time abstract run: proves, before any collective, that each module computes on a
rank the shard of the activation one device computes, and finds every replicated parameter
whose gradient is a partial sum over the tensor-parallel axis.

The model runs once on fake tensors (no memory, no process group) as a rank of the plan: its
parameters at their tensor-parallel local shapes, a ``[batch, seq]`` token batch (both sizes no dimension of the model) (``seq`` a multiple
of the tensor-parallel size that is no dimension of the model, so sizes are unambiguous), and the
styles' boundaries emulated in module hooks (a column-wise output stays local, a row-wise output
is reduced, sequence-parallel regions gather and scatter). Every aten op on a sharded tensor runs
twice, on the rank's tensors and on one device's (kept beside each sharded tensor), and:

- the rank's output must be a shard of one device's along one dim (else a shape error: a sharded
  tensor mixed with a whole one, T5's position bias);
- a reshape must put the shard where a contiguous shard of its input lands (else the module
  reshapes with a global size: OPT's ``view(bsz, -1, num_heads, head_dim)`` on half the heads);
- an op whose output is no longer sharded selects or reduces along the sharded dim (the CLS token
  of a sequence-sharded activation);

each refused with a :class:`~meshtrain.PlanError` naming the module, the op and the fix. A
trainable parameter replicated over the axis that meets a sharded activation in an op has a
partial gradient: it is returned as a :class:`~meshtrain.plan.ir.PartialGrad` (the lowering
all-reduces it) when its module takes the sharded activation as its first input, and refused
otherwise. Ops inside a styled module (its lowering owns them) are not looked at. Repeated blocks
of one signature run once (the others pass their input through when the first keeps its shape
and its shard), so planning a 126-layer model costs about what planning two does.

Example:
    >>> import meshtrain as mt
    >>> from meshtrain.models import LlamaConfig, build_llama, default_rules
    >>> model = build_llama(LlamaConfig.debug(), device="meta")
    >>> mesh = mt.make_mesh(dp=2, tp=2, world_size=4, abstract=True)
    >>> mt.plan(model, mesh, default_rules()).partial_grads
    ()
"""

from __future__ import annotations

import inspect
import logging
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

from meshtrain.errors import PlanError, format_shape
from meshtrain.plan.abstract_experts import dense_forward
from meshtrain.plan.expert_activations import counts_shape
from meshtrain.plan.experts import is_experts_module
from meshtrain.plan.ir import ModuleStyle, ParamLayout, PartialGrad, TPStyle
from meshtrain.plan.shard_dims import NOT_A_SHARD, reshaped_shard_dim, shard_dim_of
from meshtrain.plan.styles import inside

_aten = torch.ops.aten
_RESHAPES = frozenset({_aten.view.default, _aten._unsafe_view.default, _aten.reshape.default})


@dataclass(frozen=True)
class _Shard:
    """A rank's tensor is a shard of ``whole`` (one device's tensor) along ``dim`` (viewed as
    ``[outer, size / outer]``, cut on its second part: see
    :func:`~meshtrain.plan.shard_dims.reshaped_shard_dim`)."""

    dim: int
    whole: torch.Tensor
    outer: int = 1


class _Refused(Exception):
    """Carries a PlanError through the model's own code (which may catch PlanError-like errors)."""

    def __init__(self, error: PlanError) -> None:
        super().__init__(str(error))
        self.error = error


def prove_plan(
    model: nn.Module,
    params: Sequence[ParamLayout],
    styles: Sequence[ModuleStyle],
    *,
    tp_axis: str | None,
    tp_size: int,
    sequence_parallel: bool,
    blocks: Sequence[str] = (),
    unproven: str = "refuse",
) -> tuple[tuple[PartialGrad, ...], tuple[str, ...]]:
    """Run the abstract rank (see module doc): the partial gradients the lowering must reduce,
    and notes. Raises :class:`~meshtrain.PlanError` for a module that would compute the wrong
    shard, and when the model's forward cannot run on fake tokens (nothing proven, and partial
    gradients would go unreduced) unless ``unproven="note"`` (then a note says so)."""
    if tp_axis is None or tp_size == 1 or not styles:
        return (), ()
    key = (
        tuple(styles), tuple(blocks), tp_axis, tp_size, sequence_parallel,
        tuple((p.fqn, p.shape, p.spec, p.trainable) for p in params),
        tuple((fqn, tuple(t.shape), t.dtype) for fqn, t in model.named_parameters()),
    )  # fmt: skip
    known = _PROVEN.setdefault(model, {})
    if key not in known:
        known[key] = _prove(model, params, styles, tp_axis, tp_size, sequence_parallel, blocks)
    partial_grads, notes = known[key]
    if notes and unproven == "refuse":
        raise PlanError(
            f"this tensor-parallel plan over '{tp_axis}' cannot be proven while planning: "
            f"{notes[0].removeprefix('shards not proven at plan time: ')}. Without the proof, "
            "replicated parameters computing on activations sharded over the axis (per-head "
            "norms) would train with unreduced partial gradients. Make the module run on fake "
            "tensors, drop tensor parallelism (tp=None), or plan with unproven_shards='note' "
            "to train unproven.",
        )
    return partial_grads, notes


#: model → proven results per plan layout, freed with the model (planning one model many ways,
#: as sizing does per checkpointing mode, runs it once per layout)
_PROVEN: weakref.WeakKeyDictionary[
    nn.Module, dict[tuple[Any, ...], tuple[tuple[PartialGrad, ...], tuple[str, ...]]]
] = weakref.WeakKeyDictionary()


def _prove(
    model: nn.Module,
    params: Sequence[ParamLayout],
    styles: Sequence[ModuleStyle],
    tp_axis: str,
    tp_size: int,
    sequence_parallel: bool,
    blocks: Sequence[str],
) -> tuple[tuple[PartialGrad, ...], tuple[str, ...]]:
    prover = _Prover(model, params, styles, tp_axis, tp_size, sequence_parallel)
    kept = _tensor_attributes(model)
    handles = prover.hook(blocks)
    seq = probe_length(model, tp_size)
    batch = probe_batch(model, seq)
    quiet_log = logging.getLogger("torch._subclasses.fake_tensor")
    was_disabled, quiet_log.disabled = quiet_log.disabled, True  # failed candidates log errors
    try:
        with FakeTensorMode(allow_non_fake_inputs=False) as fake, torch.no_grad():
            state = prover.fake_state()
            tokens = _probe_input(model, batch, seq)
            with prover:
                torch.func.functional_call(model, state, (tokens,), _extra_inputs(model, tokens))
            del fake
    except _Refused as refused:
        raise refused.error from None
    except PlanError:
        raise
    except Exception as error:  # the model's own forward on fake tokens: nothing proven
        first = str(error).splitlines()[0] if str(error) else ""
        return (), (
            f"shards not proven at plan time: the abstract forward on a fake [{batch}, {seq}] token "
            f"batch failed in {prover._where()} ({type(error).__name__}: {first[:200]})",
        )
    finally:
        quiet_log.disabled = was_disabled
        for handle in handles:
            handle.remove()
        prover.restore()
        _drop_fake_attributes(model, kept)
    return prover.partial_grads(), ()


def _tensor_attributes(model: nn.Module) -> dict[tuple[str, str], Any]:
    """Every module's plain attributes by module and name: a forward may store a tensor in one
    (an MoE layer's last balance loss)."""
    return {(fqn, name): value for fqn, module in model.named_modules()
            for name, value in vars(module).items()}  # fmt: skip


def _drop_fake_attributes(model: nn.Module, kept: dict[tuple[str, str], Any]) -> None:
    """Undo what the abstract forward stored on modules: each fake tensor attribute is given its
    value from before the run back, or removed (the model is trained, copied and saved later)."""
    for fqn, module in model.named_modules():
        for name, value in list(vars(module).items()):
            if isinstance(value, FakeTensor):
                if (fqn, name) in kept:
                    setattr(module, name, kept[fqn, name])
                else:
                    delattr(module, name)


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


def _probe_input(model: nn.Module, batch: int, seq: int) -> torch.Tensor:
    """``[batch, seq]`` token ids; a vision model's ``[batch, channels, size, size]`` images (a
    transformers model whose forward takes ``pixel_values`` first, sized by its config); a model
    without embeddings, ``[batch, seq, features]`` activations for its first Linear.

    Example:
        >>> _probe_input(nn.Sequential(nn.Linear(4, 8)), 3, 6).shape
        torch.Size([3, 6, 4])
    """
    config = getattr(model, "config", None)
    first = next(iter(inspect.signature(model.forward).parameters), "")
    size, channels = getattr(config, "image_size", None), getattr(config, "num_channels", None)
    if first == "pixel_values" and isinstance(size, int) and isinstance(channels, int):
        return torch.zeros(batch, channels, size, size)
    modules = list(model.modules())
    linear = next((m for m in modules if isinstance(m, nn.Linear)), None)
    if linear is not None and not any(isinstance(m, nn.Embedding) for m in modules):
        return torch.zeros(batch, seq, linear.in_features)
    return torch.zeros(batch, seq, dtype=torch.long)


def _extra_inputs(model: nn.Module, tokens: torch.Tensor) -> dict[str, Any]:
    """An encoder-decoder's decoder tokens (the same probe batch)."""
    names = inspect.signature(model.forward).parameters
    return {"decoder_input_ids": tokens} if "decoder_input_ids" in names else {}


#: styles whose module's inner ops their lowering owns (the abstract run emulates only their
#: boundaries)
_LEAF_STYLES = frozenset(
    {
        TPStyle.COLWISE, TPStyle.ROWWISE, TPStyle.ROWWISE_REPLICATED_INPUT,
        TPStyle.COLWISE_GATHERED, TPStyle.LOSS_PARALLEL_HEAD, TPStyle.VOCAB_PARALLEL_EMBEDDING,
        TPStyle.EMBEDDING_DIM_PARALLEL, TPStyle.SEQUENCE_PARALLEL, TPStyle.EXPERTS_TENSOR_PARALLEL,
    }
)  # fmt: skip


#: styles the abstract run emulates at their module's input or output only (the module's own
#: ops are checked); every :class:`TPStyle` is in one of the two sets (a test checks it)
_REGION_STYLES = frozenset(
    {TPStyle.PREPARE_INPUT, TPStyle.SEQUENCE_SPLIT, TPStyle.SEQUENCE_SPLIT_INPUT,
     TPStyle.SEQUENCE_GATHERED}
)  # fmt: skip


class _Prover(TorchDispatchMode):
    """Propagates shards through every aten op and records where replicated parameters meet
    them (see module doc)."""

    def __init__(
        self,
        model: nn.Module,
        params: Sequence[ParamLayout],
        styles: Sequence[ModuleStyle],
        tp_axis: str,
        tp_size: int,
        sequence_parallel: bool,
    ) -> None:
        super().__init__()
        self.model, self.layouts = model, {p.fqn: p for p in params}
        self.styles = {s.fqn: s for s in styles}
        self.axis, self.ways, self.sp = tp_axis, tp_size, sequence_parallel
        self.split_at_block = any(s.style == TPStyle.SEQUENCE_SPLIT_INPUT for s in styles)
        self.whole = tuple(s.fqn for s in styles if s.style == TPStyle.SEQUENCE_GATHERED)
        self.shards: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.origin: WeakIdKeyDictionary = WeakIdKeyDictionary()  # tensor → parameter FQNs
        self.stack: list[str] = []
        self.quiet = 0
        self.first_input: dict[str, int | None] = {}
        self.found: dict[str, tuple[str, str]] = {}  # parameter → (module, op)
        self.copies: dict[str, str] = {}  # look-alike block → the block that ran
        self.kept_shard: set[str] = set()
        self._patched: list[nn.Module] = []
        self.whole_params: dict[str, dict[str, torch.Tensor]] = {}

    # -- set-up ---------------------------------------------------------------------------
    def fake_state(self) -> dict[str, torch.Tensor]:
        """Parameters at their tensor-parallel local shapes, buffers whole (created under the
        caller's fake mode); replicated trainable ones remembered by identity."""
        state: dict[str, torch.Tensor] = {}
        for fqn, param in self.model.named_parameters():
            layout = self.layouts.get(fqn)
            shape = self._local(layout) if layout is not None else tuple(param.shape)
            dtype = param.dtype if param.is_floating_point() else torch.float32
            state[fqn] = torch.empty(shape, dtype=dtype)
            if layout is not None and layout.trainable and self.axis not in layout.spec.axes:
                self.origin[state[fqn]] = frozenset({fqn})
        for fqn, buffer in self.model.named_buffers():
            state[fqn] = torch.empty(tuple(buffer.shape), dtype=buffer.dtype)
        for fqn, style in self.styles.items():
            if style.style in _LEAF_STYLES:
                module = self.model.get_submodule(fqn)
                self.whole_params[fqn] = {
                    name: torch.empty(tuple(p.shape), dtype=state[_join(fqn, name)].dtype)
                    for name, p in module.named_parameters(remove_duplicate=False)
                    if _join(fqn, name) in state
                }
        return state

    def _local(self, layout: ParamLayout) -> tuple[int, ...]:
        entries = layout.spec.padded(len(layout.shape))
        return tuple(
            -(-n // self.ways) if entry is not None and self.axis in _axes(entry) else n
            for n, entry in zip(layout.shape, entries)
        )

    def hook(self, blocks: Sequence[str]) -> list[Any]:
        """Module hooks: the module stack, the styles' boundaries, repeated blocks skipped."""
        handles = []
        for fqn, module in self.model.named_modules():
            handles.append(module.register_forward_pre_hook(
                _bound(self.enter, fqn), with_kwargs=True))  # fmt: skip
            handles.append(module.register_forward_hook(
                _bound(self.exit, fqn), with_kwargs=True))  # fmt: skip
        for fqn, style in self.styles.items():
            module = self.model.get_submodule(fqn) if fqn else self.model
            if style.style in _LEAF_STYLES and "forward" not in vars(module):
                own = dense_forward(module) if is_experts_module(module) else module.forward
                module.forward = self._on_whole(own, module, fqn)
                self._patched.append(module)
        for fqn, module in self.model.named_modules():
            if (
                is_experts_module(module)
                and fqn not in self.styles
                and "forward" not in vars(module)
            ):
                module.forward = dense_forward(module)  # routing's shapes are data-dependent
                self._patched.append(module)
        self._skip_repeated([fqn for fqn in blocks if fqn not in self.styles])
        return handles

    def _on_whole(self, forward: Callable[..., Any], module: nn.Module,
                  fqn: str) -> Callable[..., Any]:  # fmt: skip
        """A styled module computes what its lowering computes: one device's result on whole
        inputs and parameters (DTensor semantics); its boundary hooks cut or reduce it."""

        def run(*args: Any, **kwargs: Any) -> Any:
            whole = self.whole_params.get(fqn, {})
            owners = {name: module.get_submodule(name.rpartition(".")[0]) for name in whole}
            saved = {name: owner._parameters[name.rpartition(".")[2]]
                     for name, owner in owners.items()}  # fmt: skip
            for name, owner in owners.items():
                owner._parameters[name.rpartition(".")[2]] = whole[name]  # type: ignore[assignment]
            try:
                return forward(*args, **kwargs)
            finally:
                for name, owner in owners.items():
                    owner._parameters[name.rpartition(".")[2]] = saved[name]

        return run

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
                    found[copy + param[len(representative):]] = (
                        copy + module[len(representative):], op)  # fmt: skip
        result = []
        for param, (where, op) in sorted(
            found.items(), key=lambda item: _order(self.model, item[0])
        ):
            owner = param.rpartition(".")[0]
            dim = self.first_input.get(_representative_fqn(owner, self.copies))
            if dim is None or owner in self.styles:
                raise _refuse_partial(param, owner, where, op, self.axis)
            result.append(PartialGrad(param, owner, self.axis, dim, op))
        return tuple(result)

    # -- module boundaries ----------------------------------------------------------------
    def enter(self, fqn: str, module: nn.Module, args: tuple[Any, ...],
              kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:  # fmt: skip
        self.stack.append(fqn)
        first = args[0] if args else None
        if fqn not in self.first_input:
            shard = self.shards.get(first) if isinstance(first, torch.Tensor) else None
            self.first_input[fqn] = shard.dim if shard is not None else None
        style = self.styles.get(fqn)
        if style is None:
            return args, kwargs
        if style.style in _LEAF_STYLES:
            self.quiet += 1
        return _boundary_in(self, style, module, args, kwargs)

    def exit(self, fqn: str, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
             output: Any) -> Any:  # fmt: skip
        self.stack.pop()
        style = self.styles.get(fqn)
        if style is not None and style.style in _LEAF_STYLES:
            self.quiet -= 1
        result = output if style is None else _boundary_out(self, style, output)
        first = args[0] if args else kwargs.get("hidden_states")
        if isinstance(first, torch.Tensor) and isinstance(result, torch.Tensor):
            before, after = self.shards.get(first), self.shards.get(result)
            same = (before is None) == (after is None) and (
                before is None or before.dim == after.dim
            )
            if same and first.shape == result.shape:
                self.kept_shard.add(fqn)
        return result

    def shard(self, local: torch.Tensor, dim: int, whole: torch.Tensor,
              outer: int = 1) -> torch.Tensor:  # fmt: skip
        self.shards[local] = _Shard(dim, whole, outer)
        return local

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
            raise _Refused(self._mixed(func, inputs, error)) from None
        self._note_origin(func, inputs, sharded, output)
        if sharded and not func.__name__.startswith("new_"):
            self._propagate(func, args, kwargs, sharded, output)
        return output

    def _note_origin(self, func: Any, inputs: list[torch.Tensor], sharded: list[torch.Tensor],
                     output: Any) -> None:  # fmt: skip
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

    def _propagate(self, func: Any, args: Any, kwargs: Any, sharded: list[torch.Tensor],
                   output: Any) -> None:  # fmt: skip
        """Run ``func`` on one device's tensors too and mark the rank's outputs as their shards.
        Sizes the model's code took from a rank's shapes (``x.view(*x.shape[:-1], -1, 2)``)
        are tried scaled to one device's, one at a time, when the op fails on them as given."""
        whole_args, whole_kwargs = pytree.tree_map(
            lambda t: (
                self.shards[t].whole if isinstance(t, torch.Tensor) and t in self.shards else t
            ),
            (args, kwargs),
        )
        cut = {t.shape[self.shards[t].dim] for t in sharded}
        refusal: PlanError | None = None
        chosen = None
        for index, candidate in enumerate(_scaled_sizes(whole_args, self.ways, cut)):
            try:  # one device's tensor may be strided where a rank's is not (an expanded dim)
                whole_output = (_aten.reshape.default if func in _RESHAPES else func)(
                    *candidate, **whole_kwargs)  # fmt: skip
            except Exception:
                continue
            verdict = self._shards_of(func, sharded, output, whole_output)
            if index == 0 and isinstance(verdict, PlanError):
                raise _Refused(verdict)  # the sizes as the code gives them: one device's result
            if isinstance(verdict, PlanError):
                refusal = refusal or verdict
            elif all(outer == 1 for *_, outer in verdict):
                chosen = verdict  # a plain shard: preferred over a strided reading
                break
            elif chosen is None:
                chosen = verdict
        if chosen is None:
            raise _Refused(refusal or self._lost(func, sharded, output, None, NOT_A_SHARD))
        for local, whole, dim, outer in chosen:
            self.shard(local, dim, whole, outer)

    def _shards_of(self, func: Any, sharded: list[torch.Tensor], output: Any,
                   whole_output: Any) -> list[tuple[torch.Tensor, torch.Tensor, int, int]] | PlanError:  # fmt: skip
        """(rank tensor, one device's, shard dim, its outer factor) per tensor output, or why one
        is no shard."""
        found = []
        for local, whole in zip(pytree.tree_leaves(output), pytree.tree_leaves(whole_output)):
            if not isinstance(local, torch.Tensor) or not isinstance(whole, torch.Tensor):
                continue
            dim = shard_dim_of(tuple(local.shape), tuple(whole.shape), ways=self.ways)
            if dim is None or dim == NOT_A_SHARD:
                return self._lost(func, sharded, local, whole, dim)
            outer = next((self.shards[t].outer for t in sharded
                          if self.shards[t].whole.shape[self.shards[t].dim] == whole.shape[dim]),
                         1)  # fmt: skip
            if func in _RESHAPES:
                placed = self._check_reshape(func, sharded[0], whole, dim)
                if isinstance(placed, PlanError):
                    return placed
                outer = placed
            found.append((local, whole, dim, outer))
        return found

    # -- refusals -------------------------------------------------------------------------
    def _where(self) -> str:
        fqn = self.stack[-1] if self.stack else ""
        module = self.model.get_submodule(fqn) if fqn else self.model
        return f"'{fqn or '<root>'}' ({type(module).__name__})"

    def _describe(self, tensors: Sequence[torch.Tensor]) -> str:
        parts = []
        for t in tensors:
            shard = self.shards.get(t)
            if shard is None:
                parts.append(f"whole {format_shape(tuple(t.shape))}")
            else:
                parts.append(f"{format_shape(tuple(t.shape))} (a shard over '{self.axis}' on dim "
                             f"{shard.dim} of one device's {format_shape(tuple(shard.whole.shape))})")  # fmt: skip
        return ", ".join(parts)

    def _mixed(self, func: Any, inputs: list[torch.Tensor], error: Exception) -> PlanError:
        return PlanError(
            f"module {self._where()} would fail on a rank of this plan: {func} mixes tensors "
            f"sharded over tensor-parallel axis '{self.axis}' with whole ones "
            f"({self._describe(inputs)}: {str(error).splitlines()[0]}); e.g. a bias or position "
            "table that always has every head added to a rank's heads. Shard that tensor with the "
            "heads, or replicate the tensor-parallel projections feeding this module (spec P()).",
            fqn=self.stack[-1] if self.stack else None,
        )

    def _lost(self, func: Any, sharded: list[torch.Tensor], local: Any, whole: Any,
              dim: int | None) -> PlanError:  # fmt: skip
        what = ("selects or reduces along the sharded dim (a position such as x[:, 0], or a sum "
                "over it), so each rank computes a different value than one device"
                if dim is None else "gives a tensor that is no shard of one device's")  # fmt: skip
        shapes = (f" (rank {format_shape(tuple(local.shape))}, one device "
                  f"{format_shape(tuple(whole.shape))})" if isinstance(whole, torch.Tensor)
                  and isinstance(local, torch.Tensor) else "")  # fmt: skip
        return PlanError(
            f"module {self._where()} computes the wrong shard on a rank of this plan: {func} on "
            f"{self._describe(sharded)} {what}{shapes}. Run this module on whole activations: "
            "replicate the tensor-parallel weights feeding it (spec P()), or drop sequence "
            "parallelism (the ('seq', ...) rule) when the shard is the sequence.",
            fqn=self.stack[-1] if self.stack else None,
        )

    def _check_reshape(self, func: Any, source: torch.Tensor, whole: torch.Tensor,
                       dim: int) -> PlanError | int:  # fmt: skip
        """The shard's outer factor after a reshape, or why the reshape cuts it differently."""
        shard = self.shards[source]
        placed = reshaped_shard_dim(tuple(shard.whole.shape), tuple(whole.shape), shard.dim,
                                    ways=self.ways, outer=shard.outer)  # fmt: skip
        if placed is not None and placed[0] == dim:
            return placed[1]
        expected = placed[0] if placed is not None else None
        return PlanError(
            f"module {self._where()} reshapes with a global size: {func} turns "
            f"{self._describe([source])} into a shard on dim {dim} of "
            f"{format_shape(tuple(whole.shape))}, where one device's shard would be on dim "
            f"{expected} — e.g. view(bsz, -1, num_heads, head_dim) with the model's whole head "
            "count on a rank holding a part of the heads: the -1 absorbs the missing heads into "
            "another dim and every shape still lines up. Replicate the tensor-parallel "
            "projections of this module (spec P()), or make the module reshape with its per-rank "
            "head count.",
            fqn=self.stack[-1] if self.stack else None,
        )


def _boundary_in(
    prover: _Prover, style: ModuleStyle, module: nn.Module, args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> tuple[tuple[Any, ...], dict[str, Any]]:  # fmt: skip
    """A style's input as its lowering hands it to the module on a rank."""
    kind = style.style
    if kind in (TPStyle.PREPARE_INPUT, TPStyle.SEQUENCE_GATHERED):
        if args and isinstance(args[0], torch.Tensor):
            return (_gathered(prover, args[0]), *args[1:]), kwargs
        if style.argument and isinstance(kwargs.get(style.argument), torch.Tensor):
            return args, {**kwargs, style.argument: _gathered(prover, kwargs[style.argument])}
        return args, kwargs
    if not args or not isinstance(args[0], torch.Tensor):
        return args, kwargs
    x, rest = args[0], args[1:]
    if kind == TPStyle.ROWWISE:
        shard = prover.shards.get(x)
        if shard is None or shard.dim != x.dim() - 1:
            raise _Refused(_unpaired(prover, style, x))
    if kind in _LEAF_STYLES:
        return (_gathered(prover, x), *rest), kwargs
    if kind == TPStyle.SEQUENCE_SPLIT_INPUT and x not in prover.shards:
        return (prover.shard(torch.empty(_cut(x.shape, 1, prover.ways), dtype=x.dtype), 1, x),
                *rest), kwargs  # fmt: skip
    return args, kwargs


def _boundary_out(prover: _Prover, style: ModuleStyle, output: Any) -> Any:
    """A style's output as its lowering hands it on: local, reduced, gathered or scattered."""
    if not isinstance(output, torch.Tensor):
        return output
    kind, ways = style.style, prover.ways
    if kind in (TPStyle.COLWISE, TPStyle.LOSS_PARALLEL_HEAD, TPStyle.SEQUENCE_PARALLEL):
        dim = 1 if kind == TPStyle.SEQUENCE_PARALLEL else output.dim() - 1
        return prover.shard(torch.empty(_cut(output.shape, dim, ways), dtype=output.dtype),
                            dim, output)  # fmt: skip
    scattered = kind == TPStyle.ROWWISE or (
        kind == TPStyle.VOCAB_PARALLEL_EMBEDDING and not prover.split_at_block
    )
    if kind in _LEAF_STYLES:  # reduced or gathered: whole, or scattered to sequence shards
        if prover.sp and scattered and not inside(style.fqn, prover.whole):
            return prover.shard(torch.empty(_cut(output.shape, 1, ways), dtype=output.dtype),
                                1, output)  # fmt: skip
        return output
    if kind in (TPStyle.SEQUENCE_SPLIT, TPStyle.SEQUENCE_GATHERED) and output not in prover.shards:
        return prover.shard(torch.empty(_cut(output.shape, 1, ways), dtype=output.dtype), 1, output)
    return output


def _scaled_sizes(args: tuple[Any, ...], ways: int, cut: set[int]) -> list[tuple[Any, ...]]:
    """``args`` as given, then with one size of one size-list argument multiplied by ``ways``
    (first the sizes equal to a sharded input's local size on its sharded dim, likely read off a
    rank's shape; a reshape's candidate must also place the shard where one device's lands)."""
    first: list[tuple[Any, ...]] = [args]
    then: list[tuple[Any, ...]] = []
    for index, arg in enumerate(args):
        if isinstance(arg, (list, tuple)) and arg and all(type(n) is int for n in arg):
            for position, size in enumerate(arg):
                if size >= 1:
                    scaled = type(arg)(n * ways if i == position else n for i, n in enumerate(arg))
                    (first if size in cut else then).append(
                        (*args[:index], scaled, *args[index + 1:]))  # fmt: skip
    return first + then


def _gathered(prover: _Prover, x: torch.Tensor) -> torch.Tensor:
    """The whole activation of a sequence-sharded input (all-gathered by the lowering)."""
    shard = prover.shards.get(x)
    return x if shard is None else shard.whole


def _cut(shape: Sequence[int], dim: int, ways: int) -> tuple[int, ...]:
    dim %= len(shape)
    return tuple(n // ways if i == dim else n for i, n in enumerate(shape))


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _unpaired(prover: _Prover, style: ModuleStyle, x: torch.Tensor) -> PlanError:
    return PlanError(
        f"'{style.fqn}' ({style.module_type}) is lowered row-wise, which takes the local output "
        f"of column-wise Linears (sharded over tensor-parallel axis '{prover.axis}' on its last "
        f"dim), but on a rank it "
        f"receives {prover._describe([x])}. Shard the projection producing its input column-wise, "
        f"or replicate '{style.fqn}.weight' (spec P()).",
        fqn=style.fqn,
    )


def _axes(entry: Any) -> tuple[str, ...]:
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def _bound(method: Callable[..., Any], fqn: str) -> Callable[..., Any]:
    def hook(*args: Any) -> Any:
        return method(fqn, *args)

    return hook


def _signature(module: nn.Module) -> tuple[Any, ...]:
    tensors = [*module.named_parameters(), *module.named_buffers()]
    return (type(module), tuple((name, tuple(t.shape), t.dtype) for name, t in tensors))


def _representative_fqn(fqn: str, copies: Mapping[str, str]) -> str:
    for copy, representative in copies.items():
        if fqn == copy or fqn.startswith(copy + "."):
            return representative + fqn[len(copy) :]
    return fqn


def _order(model: nn.Module, fqn: str) -> int:
    names = [name for name, _ in model.named_parameters()]
    return names.index(fqn) if fqn in names else len(names)


def _refuse_partial(param: str, owner: str, where: str, op: str, axis: str) -> PlanError:
    return PlanError(
        f"parameter '{param}' is replicated over tensor-parallel axis '{axis}' and meets "
        f"activations sharded over it in {op} inside '{where or '<root>'}': each rank's gradient "
        f"would be a partial sum. meshtrain all-reduces such a gradient only when its module "
        f"('{owner or '<root>'}') takes the sharded activation as its first input and has no "
        "tensor-parallel style of its own. Shard the parameter with the activation, move it into "
        "a module that takes the shard, or replicate the projections feeding it (spec P()).",
        fqn=param,
    )
