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
trips on the vocab-parallel embedding's cached mask ("Mixing fake modes"), so a plan that compiles
under tensor parallelism keeps its replicated parameters plain and clips with
:func:`meshtrain.train.clip_grad_norm_`.

Example (inside :func:`~meshtrain.lower.flat.parallelize`, after tensor parallelism)::

    replicate_whole_parameters(model, device_mesh(plan.mesh)[plan.tp_axis])
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

#: The attribute naming, on a module, the parameters :class:`LocalParameters` swaps.
_SWAPPED = "_meshtrain_local_parameters"


def replicate_whole_parameters(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Make every plain parameter of ``model`` a DTensor replicated over ``tp_mesh`` (no
    collective: every rank holds the same weights) and hook its owner to compute on the local
    tensor. Tied parameters stay one tensor (one DTensor shared by every owner)."""
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
            swap = LocalParameters(tuple(names))
            setattr(module, _SWAPPED, swap)
            module.register_forward_pre_hook(swap.to_local)
            module.register_forward_hook(swap.restore, always_call=True)


class LocalParameters:
    """Forward hooks that give a module its replicated parameters as local tensors for the
    duration of its forward (so it computes exactly as on one device) and put the DTensors back
    afterwards. Whatever holds the parameter slot at the time (FSDP2 swaps in its gathered
    parameter before these hooks run and back after) is what is swapped and restored."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = names
        self.saved: list[dict[str, Any]] = []  # one frame per (re-entrant) call

    def to_local(self, module: nn.Module, args: Any) -> None:
        frame: dict[str, Any] = {}
        for name in self.names:
            param = module._parameters.get(name)
            if isinstance(param, DTensor):
                frame[name] = param
                # a plain tensor in the slot, for this forward only (autograd flows back to
                # the DTensor parameter with the replicated gradient)
                module._parameters[name] = param.to_local(grad_placements=(Replicate(),))
        self.saved.append(frame)

    def restore(self, module: nn.Module, args: Any, output: Any) -> None:
        frame = self.saved.pop() if self.saved else {}
        for name, param in frame.items():
            module._parameters[name] = param
