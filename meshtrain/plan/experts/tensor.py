"""Tensor parallelism inside experts modules, read off their specs — pure.

An experts module (:func:`~meshtrain.plan.experts.axis.is_experts_module`) keeps its experts' gate
and up projections fused in ``gate_up_proj`` ``[E, 2I, H]`` (the gate's ``I`` rows, then the up's)
and its down projection in ``down_proj`` ``[E, H, I]``. Over a tensor-parallel axis ``tp`` the
specs

- ``gate_up_proj``: ``P(e, "tp", None)`` — column-wise, each of the two packed halves split
  over ``tp`` alike (rank ``r`` holds rows ``r`` of the gate *and* of the up projection, as
  transformers' ``packed_colwise`` does), so every rank forms whole ``act(gate) · up`` features;
- ``down_proj``: ``P(e, None, "tp")`` — row-wise over the same ``I``;

(``e``: the expert axis, or ``None``) make each rank compute ``I / tp`` of every expert's
intermediate features and a partial sum of its output, all-reduced over ``tp``; the input's and
the routing weights' gradients are all-reduced in backward (transformers' ``moe_tp_experts``).
Anything else on ``tp`` inside an experts module (a bias, another layout, a transposed module)
is a :class:`PlanError` naming the parameter.

Example:
    >>> import torch
    >>> from torch import nn
    >>> experts = nn.Module()
    >>> experts.num_experts = 2
    >>> experts.gate_up_proj = nn.Parameter(torch.empty(2, 8, 4))
    >>> experts.down_proj = nn.Parameter(torch.empty(2, 4, 4))
    >>> specs = {"gate_up_proj": P(None, "tp", None), "down_proj": P(None, None, "tp")}
    >>> expert_tensor_style("mlp.experts", experts, specs, "tp", 2).style
    'experts_tensor_parallel'
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from meshtrain.errors import PlanError
from meshtrain.plan.ir import ModuleStyle, TPStyle
from meshtrain.spec.partition import P, entry_axes

#: the packed (gate and up) projection and its row-wise partner, by parameter name
PACKED, ROWWISE = "gate_up_proj", "down_proj"
#: the tensor-parallel dim of each, in the module's ``[E, ...]`` layout
TENSOR_DIMS = {PACKED: 1, ROWWISE: 2}
#: how many projections ``gate_up_proj`` packs along its tensor-parallel dim
PACKED_PARTS = 2


def expert_tensor_style(
    fqn: str, module: nn.Module, specs: Mapping[str, P], axis: str, ways: int
) -> ModuleStyle:
    """The ``experts_tensor_parallel`` style of an experts module whose specs (parameter name →
    spec) shard it over tensor-parallel ``axis`` of size ``ways``, checked (see module doc)."""
    params = dict(module.named_parameters(recurse=False))
    others = sorted(set(params) - set(TENSOR_DIMS))
    where = f"experts module '{fqn}' ({type(module).__name__})"
    fix = (
        f"Shard '{PACKED}' as P(e, '{axis}', None) and '{ROWWISE}' as P(e, None, '{axis}') "
        "(e: the expert axis or None), or keep the experts whole over it (P() or P(e, None, None))"
    )
    if others or set(params) != set(TENSOR_DIMS) or getattr(module, "is_transposed", False):
        named = [f"{fqn}.{name}" if fqn else name for name in others or sorted(params)]
        what = f"also has {named}" if others else f"has {named}"
        raise PlanError(
            f"{where} is split over tensor-parallel axis '{axis}' and {what}: meshtrain splits "
            f"inside the experts only modules holding exactly '{PACKED}' [E, 2I, H] and "
            f"'{ROWWISE}' [E, H, I] (no biases, which each rank would add again to its partial "
            "sum). Keep the experts whole over it (P() or P(e, None, None)).",
            fqn=f"{fqn}.{others[0]}" if others else fqn,
        )
    for name, dim in TENSOR_DIMS.items():
        entries = specs.get(name, P()).padded(3)
        found = [d for d, entry in enumerate(entries) if axis in entry_axes(entry)]
        if found != [dim] or entries[dim] != axis:
            raise PlanError(
                f"parameter '{fqn}.{name}' {list(params[name].shape)} of {where} has spec "
                f"{specs.get(name, P())!r}: inside the experts, tensor parallelism over '{axis}' "
                f"splits dim {dim} alone. {fix}.",
                fqn=f"{fqn}.{name}",
                spec=specs.get(name, P()),
            )
    inter = params[ROWWISE].shape[2]
    if params[PACKED].shape[1] != PACKED_PARTS * inter or inter % ways:
        raise PlanError(
            f"{where} has '{PACKED}' {list(params[PACKED].shape)} and '{ROWWISE}' "
            f"{list(params[ROWWISE].shape)}: tensor parallelism over '{axis}' (size {ways}) needs "
            f"'{PACKED}' dim 1 to be twice the intermediate size ({inter}) and the intermediate "
            f"size divisible by {ways}. Use a tensor-parallel size that divides {inter}, or {fix[0].lower()}{fix[1:]}.",
            fqn=f"{fqn}.{PACKED}",
        )
    return ModuleStyle(
        fqn,
        type(module).__name__,
        TPStyle.EXPERTS_TENSOR_PARALLEL,
        axis,
        f"each expert's intermediate features split over '{axis}' ({PACKED} packed column-wise, "
        f"{ROWWISE} row-wise); outputs all-reduced, input gradients all-reduced",
    )
