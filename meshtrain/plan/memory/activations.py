"""Activation memory of one micro-batch, measured by tracing the model's forward on fake tensors.

Instead of a closed formula (which fits one architecture), the planner runs the model's forward
once under ``FakeTensorMode`` (shapes only: no memory, no compute, no collectives) on a
``[batch_size, seq_len]`` batch of token ids, with the parameters swapped for fake tensors of the
compute dtype, and records per repeated block:

- ``saved``: bytes autograd keeps for backward (each storage counted once),
- ``kept_selective``: bytes of the outputs of matmul and attention ops (:data:`SAVED_OPS`), which
  selective checkpointing keeps (everything else in the block is recomputed),
- ``input``: the block's input, which a checkpointed block keeps,

each split into the part computed inside tensor-parallel modules (divided by the tensor-parallel
size per rank) and the rest (divided too under sequence parallelism). Bytes saved outside the
blocks (embedding, final norm, head) are counted once as ``other``. Storages of parameters and
buffers that autograd keeps (a weight saved for a matmul's backward) are not activations: the
memory model counts them as parameters (or gathered compute copies) and buffers.

Repeated blocks of the same class with the same parameter and buffer shapes save the same bytes
for the same input, so only the first of each kind is traced; the others pass their input through
(shape-preserving blocks only — a block whose output shape differs from its input's is traced
every time). This keeps planning Llama 3 405B's 126 layers about as fast as planning two.

Experts modules (mixtures of experts) route with data-dependent shapes: they run as a stand-in
that reports one rank's dispatch bytes under uniform routing
(:mod:`meshtrain.plan.experts.activations`), and a router's ``bincount`` gets its shape.

Peak per rank for a checkpointing mode: the kept bytes of every block + ``other`` + the largest
recomputed part of one block (its activations live again while its backward runs: all of them
under full checkpointing, the non-matmul ones under selective).

Example:
    >>> from meshtrain.models import LlamaConfig, build_llama
    >>> model = build_llama(LlamaConfig.debug(), device="meta")
    >>> profile = trace_activations(model, ("layers.0", "layers.1"), batch_size=2, seq_len=32)
    >>> profile.peak("full", ("layers.0", "layers.1")) < profile.peak("none", ())
    True
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.hooks import RemovableHandle

from meshtrain.plan.experts.activations import (
    counts_shape,
    restore_attributes,
    tensor_attributes,
    traced_experts,
)
from meshtrain.plan.experts.axis import is_experts_module
from meshtrain.plan.layers import lookalike_blocks, shared_tensors

_aten = torch.ops.aten
#: ops whose outputs selective checkpointing keeps (the expensive ones); the rest is recomputed.
SAVED_OPS = frozenset(
    {
        _aten.mm.default,
        _aten.addmm.default,
        _aten.bmm.default,
        _aten.baddbmm.default,
        _aten._scaled_dot_product_flash_attention_for_cpu.default,
        _aten._scaled_dot_product_flash_attention.default,
        _aten._scaled_dot_product_efficient_attention.default,
        _aten._scaled_dot_product_cudnn_attention.default,
    }
)
#: the attention ops among them: their keys and values are what context parallelism circulates
ATTENTION_OPS = frozenset(op for op in SAVED_OPS if "scaled_dot_product" in str(op))

#: forward hooks as torch calls them (its module arguments and outputs are untyped)
PreHook = Callable[[nn.Module, tuple[Any, ...]], None]
PostHook = Callable[[nn.Module, tuple[Any, ...], Any], None]


@dataclass(frozen=True)
class AttentionCall:
    """One attention op's query, keys and values as traced (global shapes ``[batch, heads, seq,
    head_dim]``, before tensor parallelism; ``in_tp``: inside a tensor-parallel module)."""

    query: tuple[int, ...]
    key: tuple[int, ...]
    value: tuple[int, ...]
    element_bytes: int
    in_tp: bool = False


@dataclass(frozen=True)
class Split:
    """Bytes computed inside tensor-parallel modules (``tp``), elsewhere (``rest``: sequence
    shards under sequence parallelism) and, outside tensor-parallel modules, inside blocks that
    run on the whole sequence even then (``whole``: MoE feed-forwards, ``sequence_gathered``)."""

    tp: int = 0
    rest: int = 0
    whole: int = 0

    def per_rank(self, tp_size: int, sequence_parallel: bool) -> int:
        rest = self.rest // tp_size if sequence_parallel else self.rest
        return self.tp // tp_size + rest + self.whole


@dataclass(frozen=True)
class BlockActivations:
    """One block's activation bytes for one micro-batch (global, before tensor parallelism)."""

    fqn: str
    input: int
    saved: Split
    kept_selective: Split
    gathered_inputs: int  # inputs of tensor-parallel modules: all-gathered under SP and kept
    attention: tuple[AttentionCall, ...] = ()  # its attention ops, in the order they ran


@dataclass(frozen=True)
class ActivationProfile:
    """Per-block activation bytes of one micro-batch; :meth:`peak` applies a checkpointing mode."""

    blocks: tuple[BlockActivations, ...]
    other: Split
    tp_size: int = 1
    sequence_parallel: bool = False
    #: bytes an op holds beside the saved activations while its backward runs (one layer's
    #: context-parallel ring: :func:`meshtrain.plan.context.cost.ring_in_flight`), added once
    transient: int = 0

    def peak(
        self,
        mode: str,
        checkpointed: Sequence[str],
        fqns: Sequence[str] | None = None,
        in_flight: int = 1,
    ) -> int:
        """Peak activation bytes per rank under ``mode`` for the blocks in ``checkpointed``, with
        ``in_flight`` micro-batches held at once; only the blocks in ``fqns`` when given (then
        without ``other``, which lives in the first and last pipeline stages)."""
        tp, sp = self.tp_size, self.sequence_parallel
        chosen = set(checkpointed)
        total = self.other.per_rank(tp, sp) if fqns is None else 0
        recompute = 0
        for block in self.blocks:
            if fqns is not None and block.fqn not in fqns:
                continue
            saved = block.saved.per_rank(tp, sp) + (block.gathered_inputs if sp else 0)
            if block.fqn not in chosen or mode == "none":
                total += saved
                continue
            kept = block.input // tp if sp else block.input
            if mode == "selective":
                kept += block.kept_selective.per_rank(tp, sp)
            total += kept
            recompute = max(recompute, saved - kept)  # what its backward rematerialises
        return total * in_flight + recompute + self.transient


def trace_activations(
    model: nn.Module,
    blocks: Sequence[str],
    *,
    batch_size: int,
    seq_len: int,
    dtype: torch.dtype = torch.float32,
    tp_modules: Sequence[str] = (),
    tp_size: int = 1,
    sequence_parallel: bool = False,
    whole_modules: Sequence[str] = (),
) -> ActivationProfile:
    """Trace ``model``'s forward on a fake ``[batch_size, seq_len]`` token batch (see module doc).
    ``whole_modules``: blocks that run on the whole sequence under sequence parallelism.

    Raises whatever the model's forward raises on such an input (callers report it). Profiles are
    remembered per model (while it lives) for the same blocks, batch, dtype, tensor-parallel
    modules and parameter shapes, so planning one model many ways traces it once per batch shape.
    """
    key = (
        tuple(blocks),
        batch_size,
        seq_len,
        dtype,
        frozenset(tp_modules),
        frozenset(whole_modules),
        tuple((fqn, tuple(p.shape), p.dtype) for fqn, p in model.named_parameters()),
    )
    known = _PROFILES.setdefault(model, {})
    if key not in known:
        known[key] = _trace(model, blocks, batch_size, seq_len, dtype, tp_modules, whole_modules)
    return replace(known[key], tp_size=tp_size, sequence_parallel=sequence_parallel)


#: model → traced profiles (tensor-parallel size 1, no sequence parallelism), freed with the model
_PROFILES: weakref.WeakKeyDictionary[nn.Module, dict[tuple[Any, ...], ActivationProfile]] = (
    weakref.WeakKeyDictionary()
)


def _trace(
    model: nn.Module,
    blocks: Sequence[str],
    batch_size: int,
    seq_len: int,
    dtype: torch.dtype,
    tp_modules: Sequence[str],
    whole_modules: Sequence[str] = (),
) -> ActivationProfile:
    recorder = _Recorder(set(blocks), set(tp_modules), set(whole_modules))
    handles = _register(model, recorder)
    restore = _skip_repeated_blocks(model, blocks, recorder)
    restore_experts = _stand_in_experts(model, recorder)
    attributes = tensor_attributes(model)
    try:
        shared = shared_tensors(model, lookalike_blocks(model, blocks))
        with FakeTensorMode(allow_non_fake_inputs=False) as fake:
            state = {
                name: _fake_like(fake, value, dtype, requires_grad=True)
                for name, value in model.named_parameters()
                if name not in shared
            }
            state.update(
                {
                    name: _fake_like(fake, value, None, False)
                    for name, value in model.named_buffers()
                    if name not in shared
                }
            )
            state.update({name: state[twin] for name, twin in shared.items()})
            recorder.ignore(state.values())
            tokens = torch.zeros(batch_size, seq_len, dtype=torch.long)
            with recorder, torch.autograd.graph.saved_tensors_hooks(recorder.pack, _unpack):
                torch.func.functional_call(model, state, (tokens,))
    finally:
        for handle in handles:
            handle.remove()
        restore()
        restore_experts()
        restore_attributes(model, attributes)
    return recorder.profile(blocks, 1, False)


def _stand_in_experts(model: nn.Module, recorder: _Recorder) -> Callable[[], None]:
    """Experts modules traced by their dispatch's bytes (:mod:`meshtrain.plan.experts.activations`:
    uniform routing), not by their data-dependent forward."""
    patched = []
    for fqn, module in model.named_modules():
        if is_experts_module(module) and "forward" not in vars(module):
            module.forward = traced_experts(module, fqn, recorder.report, recorder.paused)
            patched.append(module)

    def restore() -> None:
        for module in patched:
            del module.forward

    return restore


def _skip_repeated_blocks(
    model: nn.Module, blocks: Sequence[str], recorder: _Recorder
) -> Callable[[], None]:
    """Let the first block of each signature run; later look-alikes pass their input through
    when the first one preserved its input's shape (their profile is copied from it)."""
    modules = dict(model.named_modules())
    patched: list[nn.Module] = []
    for fqn, representative in lookalike_blocks(model, blocks).items():
        module = modules[fqn]
        if "forward" in vars(module):
            continue
        module.forward = _pass_through(module.forward, recorder, representative, fqn)
        patched.append(module)

    def restore() -> None:
        for module in patched:
            del module.forward

    return restore


def _pass_through(
    forward: Callable[..., Any], recorder: _Recorder, representative: str, fqn: str
) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        if representative in recorder.shape_preserving and args:
            recorder.copies[fqn] = representative
            return args[0]
        return forward(*args, **kwargs)

    return run


def _fake_like(
    fake: FakeTensorMode, value: torch.Tensor, dtype: torch.dtype | None, requires_grad: bool
) -> torch.Tensor:
    target = dtype if dtype is not None and value.is_floating_point() else value.dtype
    tensor = torch.empty(tuple(value.shape), dtype=target, device="cpu")
    return tensor.requires_grad_(requires_grad and target.is_floating_point)


def _unpack(value: Any) -> Any:
    return value


def _key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata


class _Recorder(TorchDispatchMode):
    """Attributes saved tensors and matmul outputs to the enclosing block and TP region."""

    def __init__(self, blocks: set[str], tp_modules: set[str], whole: set[str] = set()) -> None:  # noqa: B006
        super().__init__()
        self.blocks, self.tp_modules, self.whole = blocks, tp_modules, whole
        self.whole_depth = 0
        self.block: str | None = None
        self.outer: list[str | None] = []
        self.tp_depth = 0
        self.inputs: dict[str, int] = {}
        self.gathered: dict[str, int] = {}
        self.kept: dict[int, tuple[int, str | None, str]] = {}  # SAVED_OPS outputs, by region
        self.saved: dict[int, tuple[int, str | None, str]] = {}
        self.alive: list[torch.Tensor] = []  # keeps storages (and their ids) alive while tracing
        self.ignored: set[int] = set()  # parameter and buffer storages
        self.shape_preserving: set[str] = set()  # blocks whose output has their input's shape
        self.copies: dict[str, str] = {}  # block passed through → the block it copies
        self.attention: dict[str | None, list[AttentionCall]] = {}  # block → its attention ops
        self.silent = False  # inside an experts stand-in: its own tensors are not counted
        self.reported = 0  # stand-ins' reports so far (their table keys: -1, -2, ...)

    def ignore(self, tensors: Iterable[torch.Tensor]) -> None:
        self.ignored.update(_key(tensor) for tensor in tensors)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Count nothing inside (an experts stand-in reports its bytes itself)."""
        self.silent = True
        try:
            yield
        finally:
            self.silent = False

    def report(self, fqn: str, saved: int, kept: int) -> None:
        """An experts stand-in's bytes: ``saved`` for backward, ``kept`` of them matmul outputs."""
        for table, size in ((self.saved, saved), (self.kept, kept)):
            self.reported += 1
            table[-self.reported] = (size, self.block, self.region())

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is _aten.bincount.default:  # a router's counts: their shape, not their values
            return counts_shape(*args, **(kwargs or {}))
        out = func(*args, **(kwargs or {}))
        if self.silent:
            return out
        if func in SAVED_OPS:
            first = out[0] if isinstance(out, tuple) else out
            self._note(self.kept, first)
        if func in ATTENTION_OPS and len(args) >= 3:
            query, key, value = args[0], args[1], args[2]
            call = AttentionCall(
                tuple(query.shape),
                tuple(key.shape),
                tuple(value.shape),
                key.element_size(),
                self.tp_depth > 0,
            )
            self.attention.setdefault(self.block, []).append(call)
        return out

    def region(self) -> str:
        """Where ops run now: ``"tp"``, ``"whole"`` or ``"rest"`` (the :class:`Split` fields)."""
        return "tp" if self.tp_depth else "whole" if self.whole_depth else "rest"

    def _note(self, table: dict[int, tuple[int, str | None, str]], tensor: torch.Tensor) -> None:
        key = _key(tensor)
        if key not in table and key not in self.ignored:
            size = tensor.untyped_storage().nbytes()
            table[key] = (size, self.block, self.region())
            self.alive.append(tensor)

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        if not self.silent:
            self._note(self.saved, tensor)
        return tensor

    def profile(self, blocks: Sequence[str], tp_size: int, sp: bool) -> ActivationProfile:
        def split(table: dict[int, tuple[int, str | None, str]], block: str | None) -> Split:
            sizes = {"tp": 0, "rest": 0, "whole": 0}
            for size, owner, region in table.values():
                if owner == block:
                    sizes[region] += size
            return Split(**sizes)

        def block(fqn: str) -> BlockActivations:
            source = self.copies.get(fqn, fqn)
            return BlockActivations(
                fqn=fqn,
                input=self.inputs.get(fqn, 0),
                saved=split(self.saved, source),
                kept_selective=split(self.kept, source),
                gathered_inputs=self.gathered.get(source, 0),
                attention=tuple(self.attention.get(source, ())),
            )

        return ActivationProfile(
            blocks=tuple(block(fqn) for fqn in blocks),
            other=split(self.saved, None),
            tp_size=tp_size,
            sequence_parallel=sp,
        )


def _register(model: nn.Module, recorder: _Recorder) -> list[RemovableHandle]:
    """Forward hooks that tell the recorder which block and TP region ops run in."""
    handles = []
    for fqn, module in model.named_modules():
        if fqn in recorder.blocks:
            handles.append(module.register_forward_pre_hook(_block_enter(recorder, fqn)))
            handles.append(module.register_forward_hook(_block_exit(recorder)))
        elif fqn in recorder.whole:
            handles.append(module.register_forward_pre_hook(_whole_enter(recorder)))
            handles.append(module.register_forward_hook(_whole_exit(recorder)))
        elif fqn in recorder.tp_modules:
            handles.append(module.register_forward_pre_hook(_tp_enter(recorder)))
            handles.append(module.register_forward_hook(_tp_exit(recorder)))
    return handles


def _first_bytes(args: tuple[Any, ...]) -> int:
    first = args[0] if args else None
    return first.numel() * first.element_size() if isinstance(first, torch.Tensor) else 0


def _block_enter(recorder: _Recorder, fqn: str) -> PreHook:
    def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
        recorder.outer.append(recorder.block)
        recorder.block = fqn
        recorder.inputs[fqn] = recorder.inputs.get(fqn, 0) + _first_bytes(args)

    return hook


def _block_exit(recorder: _Recorder) -> PostHook:
    def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        block = recorder.block
        recorder.block = recorder.outer.pop()
        first = args[0] if args else None
        if (
            isinstance(first, torch.Tensor)
            and isinstance(output, torch.Tensor)
            and output.shape == first.shape
            and output.dtype == first.dtype
            and block is not None
        ):
            recorder.shape_preserving.add(block)

    return hook


def _tp_enter(recorder: _Recorder) -> PreHook:
    def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
        if recorder.tp_depth == 0 and recorder.whole_depth == 0 and recorder.block is not None:
            block = recorder.block
            recorder.gathered[block] = recorder.gathered.get(block, 0) + _first_bytes(args)
        recorder.tp_depth += 1

    return hook


def _whole_enter(recorder: _Recorder) -> PreHook:
    def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
        recorder.whole_depth += 1

    return hook


def _whole_exit(recorder: _Recorder) -> PostHook:
    def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        recorder.whole_depth -= 1

    return hook


def _tp_exit(recorder: _Recorder) -> PostHook:
    def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        recorder.tp_depth -= 1

    return hook
