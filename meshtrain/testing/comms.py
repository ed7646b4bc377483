"""Count the collectives a piece of code really issues, per kind and mesh axis.

A ``TorchDispatchMode`` over the c10d and functional-collective ops (what FSDP2, tensor parallel
and DTensor redistributions call), so tests can check a plan's predicted collectives against the
real ones. Point-to-point sends and receives (a pipeline's activations and their gradients)
count together as ``send/recv``. ``CommDebugMode`` would be the obvious tool, but in torch 2.13
its module tracker raises ``IndexError`` when FSDP2-wrapped modules run under it.

Example (on every rank)::

    with CollectiveCounter(mesh) as counter:
        loss.backward()
    counter.counts   # {("reduce_scatter", "dp"): 3, ...}
    counter.bytes    # payload per (kind, axis), as the plan counts it: the gathered output of an
                     # all-gather, the unreduced input of a reduce-scatter, an all-reduce's tensor
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Mapping
from typing import Any

import torch
from torch._C._distributed_c10d import _resolve_process_group
from torch.distributed import ProcessGroup
from torch.distributed.distributed_c10d import GroupName
from torch.utils._python_dispatch import TorchDispatchMode

from meshtrain.lower.groups import axis_group
from meshtrain.spec.mesh import Mesh

_KINDS = {
    "_allgather_base_": "all_gather",
    "allgather_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "allreduce_": "all_reduce",
    "all_reduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "broadcast_": "broadcast",
    "broadcast": "broadcast",
    "send": "send/recv",
    "recv_": "send/recv",
    "recv_any_source_": "send/recv",
    "alltoall_base_": "all_to_all",
    "all_to_all_single": "all_to_all",
}


class CollectiveCounter(TorchDispatchMode):
    """Counts collectives by (kind, axis); the axis is found from the process group used."""

    def __init__(self, mesh: Mesh, groups: Mapping[str, ProcessGroup] | None = None) -> None:
        """``groups`` names further process groups by axis (e.g. another library's mesh over the
        same ranks). A collective counts under the axis whose group spans the same ranks, so an
        equal group created elsewhere counts too; a group over several mesh axes together counts
        under their joined name (``"pp+dp"``, as plans name it); any other under ``"?"``."""
        super().__init__()
        self.counts: Counter[tuple[str, str]] = Counter()
        self.bytes: Counter[tuple[str, str]] = Counter()
        named: dict[str, ProcessGroup] = {}
        bound = not mesh.is_abstract and torch.distributed.is_initialized()
        if bound:
            named = {axis: axis_group(mesh, axis) for axis in mesh.device_axes}
        named.update(groups or {})
        self._axis_by_group = {str(group.group_name): axis for axis, group in named.items()}
        self._axis_by_ranks = {_ranks(group): axis for axis, group in named.items()}
        if bound:
            rank = torch.distributed.get_rank()
            axes = mesh.device_axes
            for size in range(2, len(axes) + 1):
                for subset in itertools.combinations(axes, size):
                    ranks = mesh.group_ranks(rank, subset)
                    self._axis_by_ranks.setdefault(ranks, mesh.joined(subset))

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        namespace = func.namespace
        name = func.overloadpacket.__name__
        out = func(*args, **(kwargs or {}))
        if namespace in ("c10d", "_c10d_functional", "c10d_functional") and name in _KINDS:
            key = (_KINDS[name], self._axis_of(args, kwargs or {}))
            self.counts[key] += 1
            self.bytes[key] += _payload((*args, *(kwargs or {}).values(), out))
        return out

    def _axis_of(self, args: Any, kwargs: dict[str, Any]) -> str:
        for value in (*args, *kwargs.values()):
            group: ProcessGroup | None = None
            if isinstance(value, str):
                if value in self._axis_by_group:
                    return self._axis_by_group[value]
                try:  # functional collectives name their group
                    group = _resolve_process_group(GroupName(value))
                except (RuntimeError, ValueError):
                    continue
            elif isinstance(value, torch.ScriptObject):
                try:  # c10d ops carry the process group boxed as a ScriptObject
                    group = ProcessGroup.unbox(value)
                except RuntimeError:
                    continue  # another boxed argument, e.g. the reduce op
            if group is not None:
                if group.group_name in self._axis_by_group:
                    return self._axis_by_group[group.group_name]
                return self._axis_by_ranks.get(_ranks(group), "?")
        return "?"


def _ranks(group: ProcessGroup) -> tuple[int, ...]:
    return tuple(torch.distributed.get_process_group_ranks(group))


def _payload(values: Any) -> int:
    """The largest tensor (or list of tensors, summed) among a collective's arguments and output:
    an all-gather's output, a reduce-scatter's input, an all-reduce's tensor."""
    best = 0
    for value in values:
        if isinstance(value, torch.Tensor):
            best = max(best, value.numel() * value.element_size())
        elif isinstance(value, (list, tuple)) and value:
            tensors = [v for v in value if isinstance(v, torch.Tensor)]
            if tensors:
                best = max(best, sum(t.numel() * t.element_size() for t in tensors))
            nested = [v for v in value if isinstance(v, (list, tuple))]
            if nested:
                best = max(best, _payload(nested))
    return best
