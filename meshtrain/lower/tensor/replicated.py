"""Every parameter on the tensor-parallel mesh: the parameters a tensor-parallel plan leaves
whole (norms, unsharded embeddings and heads, any module the rules do not shard) become
DTensors replicated over the tensor-parallel axis, so all of a model's parameters share one mesh.

PyTorch's own utilities written for one device or DDP then run unchanged on a tensor-parallel
plan: ``torch.nn.utils.clip_grad_norm_`` / ``get_total_norm`` stack per-parameter norms, which
DTensor refuses across meshes (``All operands in aten.stack.default must have the same mesh``)
and across DTensors and plain tensors; ``torch.optim``'s foreach steps and DCP's
``get_state_dict`` see one kind of tensor. FSDP2 then places every parameter on the same
(data, tensor) mesh, as it does for the tensor-parallel ones.

The modules that own such parameters still compute on plain local tensors, exactly as before: a
forward pre-hook hands the module each parameter's local tensor (``to_local`` with a replicated
gradient, the gradient one device computes, as every tensor-parallel rank sees the whole
activation there) and a forward hook puts the DTensor back. No collective is added; numerics do
not change.

Not under a compiling plan: torch 2.13's ``torch.compile`` retraces the swapping hooks and then
trips on the vocab-parallel embedding's cached mask ("Mixing fake modes";
``tests/test_compiled_tp_clipping_spmd.py`` shows it), so a plan that compiles under tensor
parallelism keeps its replicated parameters plain and clips with
:func:`meshtrain.train.clip_grad_norm_`. The plan says so in its notes, and
:func:`mark_plain_parameters` makes PyTorch's clipping on such a model raise a
:class:`~meshtrain.errors.TrainingError` naming a plain parameter and the fix, instead of
DTensor's mixed-mesh error.

Example (inside :func:`~meshtrain.lower.flat.parallelize`, after tensor parallelism)::

    replicate_whole_parameters(model, device_mesh(plan.mesh)[plan.tp_axis])
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from meshtrain.errors import TrainingError
from meshtrain.plan.ir import ParamReader

#: The attribute naming, on a module, the parameters :class:`LocalParameters` swaps.
_SWAPPED = "_meshtrain_local_parameters"
#: The attribute naming, on a plain parameter of a compiled tensor-parallel plan, its FQN.
_PLAIN = "_meshtrain_plain_under_compile"
#: The tags :func:`mark_plain_parameters` handed out in this process (gradients carry none).
_MARKED: list[tuple[str, str]] = []


def replicate_whole_parameters(
    model: nn.Module, tp_mesh: DeviceMesh, readers: Sequence[ParamReader] = ()
) -> None:
    """Make every plain parameter of ``model`` a DTensor replicated over ``tp_mesh`` (no
    collective: every rank holds the same weights) and hook its owner to compute on the local
    tensor, and each of ``readers`` (a module reading another's replicated parameter in its own
    forward: a tied head ``F.linear(h, embed.weight)``) too. Tied parameters stay one tensor (one
    DTensor shared by every owner)."""
    converted: dict[int, nn.Parameter] = {}
    for module in model.modules():
        names = []
        for name, param in list(module._parameters.items()):
            if param is None or isinstance(param, DTensor):
                continue
            replicated = converted.get(id(param))
            if replicated is None:
                local = DTensor.from_local(param.detach(), tp_mesh, (Replicate(),), run_check=False)
                replicated = nn.Parameter(local, requires_grad=param.requires_grad)
                converted[id(param)] = replicated
            module.register_parameter(name, replicated)
            names.append(name)
        if names and not hasattr(module, _SWAPPED):
            _hook(module, LocalParameters(tuple((module, name) for name in names)))
    _hook_readers(model, readers)


def _hook(module: nn.Module, swap: LocalParameters) -> None:
    setattr(module, _SWAPPED, swap)
    module.register_forward_pre_hook(swap.to_local)
    module.register_forward_hook(swap.restore, always_call=True)


def _hook_readers(model: nn.Module, readers: Sequence[ParamReader]) -> None:
    """Each reader swaps every slot holding the parameters it reads (all names of a tied one)."""
    modules = dict(model.named_modules())
    slots: dict[int, list[tuple[nn.Module, str]]] = {}
    names: dict[str, int] = {}
    for fqn, param in model.named_parameters(remove_duplicate=False):
        owner, _, name = fqn.rpartition(".")
        slots.setdefault(id(param), []).append((modules[owner], name))
        names[fqn] = id(param)
    wanted: dict[str, list[tuple[nn.Module, str]]] = {}
    for reader in readers:
        if reader.reader in modules and reader.param in names:
            wanted.setdefault(reader.reader, []).extend(slots[names[reader.param]])
    for fqn, found in wanted.items():
        module = modules[fqn]
        own = getattr(module, _SWAPPED, None)
        if own is not None:  # the reader owns parameters too: one swap covers both
            own.slots = tuple(dict.fromkeys((*own.slots, *found)))
        else:
            _hook(module, LocalParameters(tuple(dict.fromkeys(found))))


class LocalParameters:
    """Forward hooks that give a module its replicated parameters (and those it reads of other
    modules: ``slots`` are (module, name) pairs) as local tensors for the duration of its forward
    (so it computes exactly as on one device) and put the DTensors back afterwards. Whatever
    holds a slot at the time (FSDP2 swaps in its gathered parameter before these hooks run and
    back after) is what is swapped and restored; a DTensor in several slots (tied) gets one local
    tensor."""

    def __init__(self, slots: tuple[tuple[nn.Module, str], ...]) -> None:
        self.slots = slots
        self.saved: list[list[tuple[nn.Module, str, Any]]] = []  # per (re-entrant) call

    def to_local(self, module: nn.Module, args: Any) -> None:
        frame: list[tuple[nn.Module, str, Any]] = []
        made: dict[int, torch.Tensor] = {}
        for owner, name in self.slots:
            param = owner._parameters.get(name)
            if isinstance(param, DTensor):
                frame.append((owner, name, param))
                # a plain tensor in the slot, for this forward only (autograd flows back to
                # the DTensor parameter with the replicated gradient)
                local = made.get(id(param))
                if local is None:
                    local = made[id(param)] = param.to_local(grad_placements=(Replicate(),))
                owner._parameters[name] = local
        self.saved.append(frame)

    def restore(self, module: nn.Module, args: Any, output: Any) -> None:
        frame = self.saved.pop() if self.saved else []
        for owner, name, param in frame:
            owner._parameters[name] = param


def mark_plain_parameters(model: nn.Module, tp_axis: str) -> None:
    """Under a plan that compiles with tensor parallelism over ``tp_axis``: tag every parameter
    not on the tensor-parallel mesh (plain, or a DTensor over other axes only) with its FQN and
    make ``torch.nn.utils.clip_grad_norm_`` / ``get_total_norm`` turn
    DTensor's mixed-mesh error on such parameters into a :class:`TrainingError` naming one of
    them and ``meshtrain.train.clip_grad_norm_`` (other errors, and every other model, pass
    through unchanged)."""
    for fqn, param in model.named_parameters():
        names = param.device_mesh.mesh_dim_names if isinstance(param, DTensor) else None
        if tp_axis not in (names or ()):
            setattr(param, _PLAIN, (fqn, tp_axis))
            _MARKED.append((fqn, tp_axis))
    _guard(torch.nn.utils, "clip_grad_norm_")
    _guard(torch.nn.utils, "get_total_norm")


def _guard(module: Any, name: str) -> None:
    original = getattr(module, name)
    if getattr(original, "_meshtrain_guarded", False):
        return

    @functools.wraps(original)
    def guarded(tensors: Any, *args: Any, **kwargs: Any) -> Any:
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        try:
            return original(tensors, *args, **kwargs)
        except RuntimeError as err:
            plain = _first_plain(tensors, str(err))
            if plain is None:
                raise
            raise _plain_error(name, plain) from err

    guarded._meshtrain_guarded = True  # type: ignore[attr-defined]
    setattr(module, name, guarded)


def _first_plain(tensors: Iterable[Any], error: str) -> tuple[str, str] | None:
    """The (FQN, axis) tag of the first plain parameter among ``tensors``; for gradients (which
    carry no tag) mixing plain tensors and DTensors or meshes, the first tag handed out; else
    ``None``."""
    tensors = list(tensors)
    for tensor in tensors:
        tag = getattr(tensor, _PLAIN, None)
        if tag is not None:
            return tag
    kinds = {isinstance(t, DTensor) for t in tensors if isinstance(t, torch.Tensor)}
    mixed = kinds == {True, False} or "same mesh" in error
    return _MARKED[0] if _MARKED and mixed else None


def _plain_error(name: str, plain: tuple[str, str]) -> TrainingError:
    fqn, axis = plain
    return TrainingError(
        f"torch.nn.utils.{name} cannot mix this model's parameters: the plan compiles under "
        f"tensor parallelism over '{axis}', so the parameters the rules leave whole stay plain "
        f"tensors (e.g. {fqn!r}; torch 2.13's compile fails on them as DTensors) beside DTensors "
        "sharded over the mesh. Clip with meshtrain.train.clip_grad_norm_(model.parameters(), "
        "max_norm) (TrainStep does), or plan without compile to use PyTorch's clipping."
    )
