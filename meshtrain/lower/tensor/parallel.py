"""Tensor and sequence parallelism: the plan's module styles lowered to PyTorch's
``parallelize_module`` over the tensor-parallel axis, and the loss context for vocab-sharded
logits.

Example (inside :func:`~meshtrain.lower.apply`)::

    apply_tensor_parallel(plan, model, device_mesh(plan.mesh)[plan.tp_axis])
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Placement,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.parallel import (
    loss_parallel as torch_loss_parallel,
)

from meshtrain.errors import PlanError, format_shape
from meshtrain.lower.experts.tensor import ExpertsTensorParallel
from meshtrain.plan.ir import WHOLE_SEQUENCE, ModuleStyle, Plan, TPStyle
from meshtrain.plan.layers import linear_widths
from meshtrain.plan.tensor.styles import inside


def apply_tensor_parallel(plan: Plan, model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """``parallelize_module`` with the plan's styles over the tensor-parallel axis, the run-time
    checks of paired Linears and sequence lengths, and partial-gradient reduction without FSDP2."""
    styles = _tp_styles(plan)
    root = styles.pop("", None)
    if styles:
        parallelize_module(model, tp_mesh, styles)
    if root is not None:  # a pair directly under the root: the root prepares its own input
        parallelize_module(model, tp_mesh, root)
    _replicate_on_shards(plan, model, tp_mesh)
    retie(plan, model)
    refreeze(plan, model)
    modules = dict(model.named_modules())
    share_inputs(plan, modules)
    _sync_partial_grads(plan, modules)
    for style in plan.styles:
        if style.style == TPStyle.LOSS_PARALLEL_HEAD:
            modules[style.fqn].register_forward_hook(_gather_logits_outside_loss_parallel)
    for style in plan.styles:
        if style.style == TPStyle.ROWWISE:
            check = functools.partial(_check_pair_input, style.fqn, tp_mesh.size())
            modules[style.fqn].register_forward_pre_hook(check, prepend=True)
    if plan.sequence_parallel:
        for style in plan.styles:
            if style.module_type == "Embedding":
                check = functools.partial(_check_sequence, style.fqn, plan.tp_axis, tp_mesh.size())
                modules[style.fqn].register_forward_pre_hook(check)


def _replicate_on_shards(plan: Plan, model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """The modules whose replicated parameters compute on tensor-parallel shards (the plan's
    ``partial_grads``, found by the abstract run): their parameters become replicated DTensors
    and their sharded input a DTensor sharded on the recorded dim, so each such gradient is a
    ``Partial`` DTensor that FSDP2 (or :class:`PartialGradSync` without it) all-reduces."""
    dims = {grad.module: grad.dim for grad in plan.partial_grads}
    present = {fqn for fqn, _ in model.named_modules()}
    styles: dict[str, ParallelStyle] = {
        fqn: SequenceParallel(sequence_dim=dim, use_local_output=True)
        for fqn, dim in dims.items()
        if fqn in present  # a pipeline stage holds some of them
    }
    if styles:
        parallelize_module(model, tp_mesh, styles)


def retie(plan: Plan, model: nn.Module) -> None:
    """Tied parameters one tensor again: ``parallelize_module`` distributes each module's
    weights separately, which would leave an embedding's and its tied head's copies to train
    apart. Every name of a group gets the distributed parameter; the plan gave all of them the
    same spec, so the layouts agree."""
    for group in plan.tied:
        try:
            params = [model.get_parameter(fqn) for fqn in group]
        except AttributeError:
            continue  # not on this pipeline stage
        # the distributed copy (a module that merely holds the parameter was not parallelised)
        shared = next((p for p in params if isinstance(p, DTensor)), params[0])
        for fqn in group:
            owner, _, name = fqn.rpartition(".")
            module = model.get_submodule(owner) if owner else model
            if getattr(module, name) is not shared:
                module.register_parameter(name, shared)


def refreeze(plan: Plan, model: nn.Module) -> None:
    """Frozen parameters frozen again: PyTorch's parallel styles wrap each distributed tensor
    in a new ``nn.Parameter``, which requires a gradient whatever the original did."""
    frozen = {layout.fqn for layout in plan.params if not layout.trainable}
    for group in plan.tied:
        if group[0] in frozen:
            frozen.update(group)
    for fqn, param in model.named_parameters(remove_duplicate=False):
        if fqn in frozen and param.requires_grad:
            param.requires_grad_(False)


def _check_pair_input(fqn: str, ways: int, module: nn.Module, args: Any) -> None:
    """A row-wise Linear paired by structure must consume its column-wise siblings' local output.

    Pairs are inferred from module structure (same parent, or a projection group under it); the
    data flow is checked here, on every rank alike, before the module issues any collective.
    """
    x = args[0] if args else None
    widths = linear_widths(module)
    in_features = widths[0] if widths is not None else None
    if not isinstance(x, torch.Tensor) or in_features is None:
        return
    local = in_features // ways
    if isinstance(x, DTensor) or x.shape[-1] != local:
        parent = fqn.rpartition(".")[0]
        raise PlanError(
            f"'{fqn}' is lowered row-wise because it shares parent '{parent}' with column-wise "
            f"Linears, which assumes it consumes their sharded output (last dim {local} = "
            f"{in_features}/{ways}); it received a {'DTensor' if isinstance(x, DTensor) else 'tensor'}"
            f" of shape {format_shape(tuple(x.shape))} instead. meshtrain pairs Linears by "
            "module structure: shard the projection that reads the block's input column-wise "
            f"and the one that consumes its output row-wise, or replicate '{fqn}.weight'."
        )


def _check_sequence(
    fqn: str, axis: str | None, ways: int, module: nn.Module | None, args: Any
) -> None:
    tokens = args[0] if args else None
    if not isinstance(tokens, torch.Tensor):
        return
    if tokens.dim() < 2:
        raise PlanError(
            f"input of '{fqn}' has shape {format_shape(tuple(tokens.shape))}, but sequence "
            "parallelism slices dim 1 of every embedding's output as the sequence: feed it "
            "[batch, seq] indices (e.g. positions[None]), or drop the ('seq', ...) activation rule."
        )
    if tokens.shape[1] % ways:
        raise PlanError(
            f"input of '{fqn}' has sequence length {tokens.shape[1]} (shape "
            f"{format_shape(tuple(tokens.shape))}), which does not divide over tensor-parallel "
            f"axis '{axis}' of size {ways} under sequence parallelism. Pad or cut sequences to a "
            f"multiple of {ways}."
        )


def _sync_partial_grads(plan: Plan, modules: dict[str, nn.Module]) -> None:
    """Without FSDP2 (which reduces them itself when it wraps the model), a hook reduces the
    partial-sum gradients of replicated weights that compute on shards: the plan's
    ``partial_grads``, sequence-parallel norms, and the replicated adapter of a tensor-parallel
    LoRA Linear (``lora_A`` of a column-wise
    one, ``lora_B`` of a row-wise one: its gradient contracts over the sharded dim)."""
    if plan.data_axes:
        return
    fqns = [grad.param for grad in plan.partial_grads if grad.module in modules]
    for style in plan.styles:
        module = modules[style.fqn]
        prefix = f"{style.fqn}." if style.fqn else ""
        if style.style == TPStyle.SEQUENCE_PARALLEL and plan.sequence_parallel:
            fqns += [prefix + name for name, p in module.named_parameters() if p.requires_grad]
        elif style.module_type == "LoRALinear":
            fqns += [
                prefix + name
                for name, p in module.named_parameters()
                if name.startswith("lora_") and p.requires_grad
            ]
    if fqns:
        sync = PartialGradSync(tuple(fqns))
        sync.attach(modules[""])
        modules[""]._meshtrain_partial_grads = sync  # type: ignore[assignment]


class PartialGradSync:
    """Reduces the partial-sum gradients of sequence-parallel norm weights to replicated ones.

    A norm on sequence shards computes its weight's gradient from its shard of the sequence only
    (a ``Partial`` DTensor). Without FSDP2 (which reduces them itself) this hook all-reduces them
    over the tensor-parallel axis once per step, on the last micro-batch, so that clipping and the
    optimizer see the same gradient as one device.
    """

    def __init__(self, fqns: tuple[str, ...] = ()) -> None:
        self.enabled = True
        self.fqns = fqns  # the parameters it reduces, under the model's root

    def attach(self, root: nn.Module) -> None:
        """Hook the parameters named by :attr:`fqns` (again, after ``to_empty`` replaced them:
        ``mt.materialise`` calls this)."""
        params = dict(root.named_parameters(remove_duplicate=False))
        for fqn in self.fqns:
            params[fqn].register_post_accumulate_grad_hook(self)

    def __call__(self, param: torch.Tensor) -> None:
        grad = param.grad
        if (
            self.enabled
            and isinstance(grad, DTensor)
            and any(isinstance(p, Partial) for p in grad.placements)
        ):
            param.grad = grad.redistribute(placements=[Replicate()] * len(grad.placements))


def _tp_styles(plan: Plan) -> dict[str, ParallelStyle]:
    """PyTorch's parallel style per module FQN, each from its entry of :data:`LOWERINGS`."""
    stream: Placement = Shard(1) if plan.sequence_parallel else Replicate()
    split_at_block = any(s.style == TPStyle.SEQUENCE_SPLIT_INPUT for s in plan.styles)
    whole = tuple(s.fqn for s in plan.styles if s.style in WHOLE_SEQUENCE)

    def at(style: ModuleStyle) -> Placement:  # inside a block run whole: replicated
        return Replicate() if inside(style.fqn, whole) and style.fqn not in whole else stream

    dispatched = {group.fqn for group in plan.experts}  # split by the expert-parallel lowering
    share = plan.pair_inputs_shared
    return {
        style.fqn: LOWERINGS[style.style](style, _context(style, at(style), split_at_block, share))
        for style in plan.styles
        if style.fqn not in dispatched
    }


@dataclass(frozen=True)
class StyleContext:
    """What a style's lowering reads besides the style: the layout of activations between
    blocks (sequence shards ``Shard(1)`` under sequence parallelism, otherwise replicated),
    whether the sequence is split at the first block rather than at the embeddings, and the
    column- and row-wise classes for the module's kind (a transposed ``Conv1D``, a LoRA Linear
    or a plain Linear)."""

    stream: Placement
    split_at_block: bool
    colwise: type[ColwiseParallel]
    rowwise: type[RowwiseParallel]
    share_inputs: bool = True


def _context(
    style: ModuleStyle, stream: Placement, split_at_block: bool, share_inputs: bool
) -> StyleContext:
    transposed = style.module_type == "Conv1D"
    adapted = style.module_type == "LoRALinear"
    return StyleContext(
        stream=stream,
        split_at_block=split_at_block,
        share_inputs=share_inputs,
        colwise=_TransposedColwise
        if transposed
        else _AdapterColwise
        if adapted
        else ColwiseParallel,
        rowwise=_TransposedRowwise
        if transposed
        else _AdapterRowwise
        if adapted
        else RowwiseParallel,
    )


class _TransposedColwise(ColwiseParallel):
    """Column-wise for a Linear whose weight is ``[in, out]`` (Hugging Face's ``Conv1D``): the
    weight is sharded on dim 1, the bias on dim 0."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(
            module,
            device_mesh,
            functools.partial(
                _shard_params, {"weight": Shard(1), "bias": Shard(0)}, self.src_data_rank
            ),
            functools.partial(
                self._prepare_input_fn, self.input_layouts, self.desired_input_layouts
            ),
            functools.partial(self._prepare_output_fn, self.output_layouts, self.use_local_output),
        )


class _TransposedRowwise(RowwiseParallel):
    """Row-wise for a Linear whose weight is ``[in, out]``: the weight sharded on dim 0, the bias
    replicated, the input a shard of its last dim."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self.desired_input_layouts = (Shard(-1),)
        return distribute_module(
            module,
            device_mesh,
            functools.partial(
                _shard_params, {"weight": Shard(0), "bias": Replicate()}, self.src_data_rank
            ),
            functools.partial(
                self._prepare_input_fn, self.input_layouts, self.desired_input_layouts
            ),
            functools.partial(self._prepare_output_fn, self.output_layouts, self.use_local_output),
        )


class _AdapterColwise(ColwiseParallel):
    """Column-wise for a LoRA Linear: the base weight and bias and ``lora_B`` sharded along out
    (dim 0), ``lora_A`` replicated (see :mod:`meshtrain.plan.adapters`)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        placements = {
            "weight": Shard(0),
            "bias": Shard(0),
            "lora_A": Replicate(),
            "lora_B": Shard(0),
        }
        return _distribute_adapted(self, module, device_mesh, placements)


class _AdapterRowwise(RowwiseParallel):
    """Row-wise for a LoRA Linear: the base weight and ``lora_A`` sharded along in (dim 1), the
    bias and ``lora_B`` replicated; the low-rank path's partial sums are reduced with the base's."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self.desired_input_layouts = (Shard(-1),)
        placements = {
            "weight": Shard(1),
            "bias": Replicate(),
            "lora_A": Shard(1),
            "lora_B": Replicate(),
        }
        return _distribute_adapted(self, module, device_mesh, placements)


def _distribute_adapted(
    style: Any, module: nn.Module, device_mesh: DeviceMesh, placements: dict[str, Placement]
) -> nn.Module:
    """``distribute_module`` with ``style``'s input and output hooks and a placement per
    parameter name (the LoRA styles above)."""
    return distribute_module(
        module,
        device_mesh,
        functools.partial(_shard_params, placements, style.src_data_rank),
        functools.partial(
            style._prepare_input_fn, style.input_layouts, style.desired_input_layouts
        ),
        functools.partial(style._prepare_output_fn, style.output_layouts, style.use_local_output),
    )


def _shard_params(
    placements: dict[str, Placement],
    source: int | None,
    name: str,
    module: nn.Module,
    device_mesh: DeviceMesh,
) -> None:
    """Distribute a module's parameters as ``placements`` says (from rank ``source``, as
    PyTorch's own styles do)."""
    for param_name, param in list(module.named_parameters(recurse=False)):
        placement = placements[param_name]
        sharded = distribute_tensor(param, device_mesh, [placement], src_data_rank=source)
        module.register_parameter(
            param_name, nn.Parameter(sharded, requires_grad=param.requires_grad)
        )


class _PrepareActivation(ParallelStyle):
    """Mark a pair parent's activation input — the first positional argument, or the keyword
    ``argument`` — as one DTensor (``input_layout`` redistributed to ``desired``) that all its
    column-wise children share, so backward reduces their input gradients once (all-reduce, or
    reduce-scatter to sequence shards) instead of once per child. Other arguments (rotary
    tables, masks, caches) pass through untouched.
    """

    def __init__(
        self,
        fqn: str,
        argument: str,
        input_layout: Placement,
        desired: Placement,
        *,
        local: bool = False,
    ) -> None:
        super().__init__()
        self.fqn, self.argument = fqn, argument
        self.input_layout, self.desired, self.local = input_layout, desired, local

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        hook = functools.partial(self._prepare, device_mesh)
        module.register_forward_pre_hook(hook, with_kwargs=True)
        return module

    def _prepare(
        self,
        device_mesh: DeviceMesh,
        module: nn.Module,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if args and isinstance(args[0], torch.Tensor):
            return (self._convert(args[0], device_mesh), *args[1:]), kwargs
        value = kwargs.get(self.argument) if self.argument else None
        if isinstance(value, torch.Tensor):
            return args, {**kwargs, self.argument: self._convert(value, device_mesh)}
        got = type(args[0]).__name__ if args else "no positional arguments"
        raise PlanError(
            f"'{self.fqn}' ({type(module).__name__}) holds a column-/row-wise tensor-parallel "
            f"pair and must receive its activation as the first positional argument or as "
            f"'{self.argument or 'the first parameter'}=' (got {got}"
            f"{', keywords ' + str(sorted(kwargs)) if kwargs else ''}). Call it with the "
            "activation first, or replicate the pair's weights."
        )

    def _convert(self, tensor: torch.Tensor, device_mesh: DeviceMesh) -> torch.Tensor:
        if isinstance(tensor, DTensor):
            dtensor = tensor
        else:
            if self.local and isinstance(self.desired, Shard):
                _check_sequence(self.fqn, None, device_mesh.size(), module=None, args=(tensor,))
            dtensor = DTensor.from_local(tensor, device_mesh, (self.input_layout,), run_check=False)
        if dtensor.placements != (self.desired,):
            dtensor = dtensor.redistribute(placements=(self.desired,))
        return dtensor.to_local() if self.local else dtensor


class _SharedInput(ParallelStyle):
    """A pair parent's input shared by its column-wise children as one DTensor (replicated),
    created when the first of them receives it, so backward reduces their input gradients once;
    the parent's own code keeps its plain input (a residual added inside the parent works).
    :func:`share_inputs` hooks the children."""

    def __init__(self, argument: str) -> None:
        super().__init__()
        self.argument = argument

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        shared = SharedInput(device_mesh, self.argument)
        module._meshtrain_shared_input = shared  # type: ignore[assignment]
        module.register_forward_pre_hook(shared.enter, with_kwargs=True)
        module.register_forward_hook(shared.exit, always_call=True)
        return module


class SharedInput:
    """The input of one pair parent's forward (a stack: re-entrant calls), and its DTensor."""

    def __init__(self, device_mesh: DeviceMesh, argument: str) -> None:
        self.device_mesh, self.argument = device_mesh, argument
        self.frames: list[list[Any]] = []  # [plain input, its DTensor or None]

    def enter(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        x = args[0] if args else kwargs.get(self.argument)
        self.frames.append([x, None])

    def exit(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.frames:
            self.frames.pop()

    def child(self, module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        """A column-wise child's pre-hook: the parent's input becomes the shared DTensor."""
        if not self.frames or not args or args[0] is not self.frames[-1][0]:
            return None
        frame = self.frames[-1]
        if frame[1] is None and isinstance(frame[0], torch.Tensor):
            frame[1] = DTensor.from_local(
                frame[0], self.device_mesh, (Replicate(),), run_check=False
            )
        return (frame[1], *args[1:]) if frame[1] is not None else None


def share_inputs(plan: Plan, modules: dict[str, nn.Module]) -> None:
    """Hook each column-wise module under a pair parent lowered with :class:`_SharedInput` (the
    innermost such parent) to take its shared input."""
    parents = [
        fqn
        for fqn, m in modules.items()
        if isinstance(getattr(m, "_meshtrain_shared_input", None), SharedInput)
    ]
    for style in plan.styles:
        if style.style != TPStyle.COLWISE or style.fqn not in modules:
            continue
        around = [p for p in parents if not p or style.fqn.startswith(p + ".")]
        owner = max(around, key=len, default=None)
        if owner is not None:
            shared = modules[owner]._meshtrain_shared_input
            modules[style.fqn].register_forward_pre_hook(
                lambda module, args, shared=shared: shared.child(module, args), prepend=True
            )


class _GatherSequence(ParallelStyle):
    """A block run on the whole sequence under sequence parallelism (a MoE feed-forward): its
    activation input all-gathered from sequence shards, its output sliced back to this rank's
    shard. Inside, every rank computes the same whole-sequence result (its tensor-parallel pairs
    reduce as without sequence parallelism), so the input's gradient is the same on every rank
    and is sliced, and the output's gradient is all-gathered.
    """

    def __init__(self, fqn: str, argument: str) -> None:
        super().__init__()
        self.fqn, self.argument = fqn, argument

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        gather = _PrepareActivation(self.fqn, self.argument, Shard(1), Replicate(), local=True)
        module.register_forward_pre_hook(
            functools.partial(gather._prepare, device_mesh), with_kwargs=True
        )
        module.register_forward_hook(functools.partial(self._slice, device_mesh))
        return module

    def _slice(self, device_mesh: DeviceMesh, module: nn.Module, args: Any, output: Any) -> Any:
        if not isinstance(output, torch.Tensor):
            raise PlanError(
                f"'{self.fqn}' ({type(module).__name__}) runs on the whole sequence under "
                f"sequence parallelism and must return one activation tensor to slice back to "
                f"sequence shards; it returned {type(output).__name__}. Train it without "
                "sequence parallelism (drop the ('seq', ...) activation rule)."
            )
        whole = DTensor.from_local(output, device_mesh, (Replicate(),), run_check=False)
        return whole.redistribute(placements=(Shard(1),)).to_local()


class _LossParallel:
    """Whether :func:`loss_parallel` is active (read by the head's output hook; a plain flag, not
    a context variable, so compiled code guards on it instead of breaking its graph)."""

    active = False


@contextlib.contextmanager
def loss_parallel(plan: Plan) -> Iterator[None]:
    """Context for the loss: under it, a plan that keeps the head's logits vocab-sharded hands
    them over as a DTensor and PyTorch's ``loss_parallel()`` computes the cross-entropy on the
    shards, never gathering them. Outside it the head gathers its logits into a plain tensor, so a
    loop written for one device or for DDP runs unchanged (one all-gather more). A no-op for a
    plan without a vocab-parallel head.

    Example::

        with loss_parallel(plan):
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    """
    if not any(style.style == TPStyle.LOSS_PARALLEL_HEAD for style in plan.styles):
        yield
        return
    previous, _LossParallel.active = _LossParallel.active, True
    try:
        with torch_loss_parallel():
            yield
    finally:
        _LossParallel.active = previous


def _gather_logits_outside_loss_parallel(module: nn.Module, args: Any, output: Any) -> Any:
    if _LossParallel.active or not isinstance(output, DTensor):
        return output
    return output.full_tensor()


#: How each tensor-parallel style lowers: PyTorch's parallel style for one module (its cost is
#: ``meshtrain.plan.tensor.cost.TP_COSTS``; a test checks both cover every :class:`TPStyle`).
LOWERINGS: Mapping[TPStyle, Callable[[ModuleStyle, StyleContext], ParallelStyle]] = {
    TPStyle.COLWISE: lambda s, c: c.colwise(),
    TPStyle.ROWWISE: lambda s, c: c.rowwise(output_layouts=c.stream),
    TPStyle.ROWWISE_REPLICATED_INPUT: lambda s, c: c.rowwise(input_layouts=Replicate()),
    TPStyle.COLWISE_GATHERED: lambda s, c: c.colwise(
        input_layouts=c.stream, output_layouts=Replicate()
    ),
    TPStyle.LOSS_PARALLEL_HEAD: lambda s, c: c.colwise(
        input_layouts=c.stream, output_layouts=Shard(-1), use_local_output=False
    ),
    TPStyle.VOCAB_PARALLEL_EMBEDDING: lambda s, c: RowwiseParallel(
        input_layouts=Replicate(), output_layouts=Replicate() if c.split_at_block else c.stream
    ),
    TPStyle.EMBEDDING_DIM_PARALLEL: lambda s, c: ColwiseParallel(
        input_layouts=Replicate(), output_layouts=Replicate()
    ),
    TPStyle.PREPARE_INPUT: lambda s, c: (
        _SharedInput(s.argument)
        if c.share_inputs and not isinstance(c.stream, Shard)
        else _PrepareActivation(s.fqn, s.argument, c.stream, Replicate())
    ),
    TPStyle.SEQUENCE_PARALLEL: lambda s, c: SequenceParallel(sequence_dim=1, use_local_output=True),
    TPStyle.SEQUENCE_SPLIT: lambda s, c: PrepareModuleOutput(
        output_layouts=Replicate(), desired_output_layouts=Shard(1), use_local_output=True
    ),
    TPStyle.SEQUENCE_SPLIT_INPUT: lambda s, c: _PrepareActivation(
        s.fqn, s.argument, Replicate(), Shard(1), local=True
    ),
    TPStyle.SEQUENCE_GATHERED: lambda s, c: _GatherSequence(s.fqn, s.argument),
    TPStyle.SEQUENCE_GATHERED_TAIL: lambda s, c: _PrepareActivation(
        s.fqn, s.argument, Shard(1), Replicate(), local=True
    ),
    TPStyle.EXPERTS_TENSOR_PARALLEL: lambda s, c: ExpertsTensorParallel(),
}
