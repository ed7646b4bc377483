"""Expert parallelism read off the specs: which mesh axis splits the experts, which modules are
the experts, and every combination that cannot lower refused while planning.

An *experts module* has the interface of transformers' fused experts (``Qwen3MoeExperts``,
``MixtralExperts``, Qwen2-MoE's, meshtrain's ``GroupedExperts``): an int ``num_experts``, 3-D
expert weights with the experts on dim 0 (``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I])
and ``forward(hidden [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]``. A spec
``P("ep", None, None)`` on its weights makes ``ep`` the *expert axis*: each rank holds
``E / ep`` experts and tokens travel to their expert's rank by all-to-all. The expert axis also
splits the batch (it is carved out of the data ranks, as torchtitan's is), so the plan's
:attr:`~meshtrain.plan.ir.Plan.batch_axes` are its data axes and ``ep``.

Example:
    >>> import torch
    >>> from torch import nn
    >>> class Experts(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.num_experts = 4
    ...         self.gate_up_proj = nn.Parameter(torch.empty(4, 8, 2))
    ...         self.down_proj = nn.Parameter(torch.empty(4, 2, 4))
    ...     def forward(self, hidden_states, top_k_index, top_k_weights):
    ...         return hidden_states
    >>> is_experts_module(Experts()), is_experts_module(nn.Linear(2, 2))
    (True, False)
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import replace

from torch import nn

from meshtrain.errors import PlanError
from meshtrain.plan.ir import ExpertGroup, ParamLayout
from meshtrain.plan.options import PlanOptions
from meshtrain.spec.mesh import Mesh
from meshtrain.spec.partition import P, entry_axes
from meshtrain.spec.rules import ParamSpec, Resolution

#: the forward an experts module must have (after ``self``), by position
EXPERTS_FORWARD = ("hidden_states", "top_k_index", "top_k_weights")


def is_experts_module(module: nn.Module) -> bool:
    """A module with an int ``num_experts`` and a 3-D parameter whose dim 0 is that many."""
    count = getattr(module, "num_experts", None)
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        return False
    return any(p.ndim == 3 and p.shape[0] == count for p in module.parameters(recurse=False))


def expert_axis_of(resolution: Resolution, model: nn.Module) -> str | None:
    """The mesh axis (larger than 1) that shards dim 0 of an experts module's 3-D weight, if any."""
    modules = dict(model.named_modules())
    mesh = resolution.mesh
    for param in resolution.params:
        owner = modules.get(_owner(param.fqn))
        if owner is None or not is_experts_module(owner) or len(param.shape) != 3:
            continue
        first = param.spec.padded(3)[0]
        axes = (first,) if isinstance(first, str) else tuple(first or ())
        sized = [axis for axis in axes if mesh.size(axis) > 1]
        if sized:
            return sized[0]
    return None


def plan_experts(
    model: nn.Module,
    resolution: Resolution,
    expert_axis: str,
    *,
    data_axes: Sequence[str],
    tp_axis: str | None,
    options: PlanOptions,
    context_axis: str | None = None,
) -> tuple[ExpertGroup, ...]:
    """The experts modules the specs shard over ``expert_axis``, checked: every parameter on
    that axis belongs to an experts module with the known forward, shards its experts dim (dim 0)
    and nothing else, over a divisor of ``num_experts``; the axes around it lower (one or two
    data axes, compile without fullgraph, ZeRO 1 to 3; a tensor-parallel axis outside the
    experts and, with its specs, inside them). Raises :class:`PlanError` naming the module or parameter and the fix."""
    mesh = resolution.mesh
    modules = dict(model.named_modules())
    grouped: dict[str, list[str]] = {}
    for param in resolution.params:
        if expert_axis not in param.spec.axes:
            continue
        fqn = _owner(param.fqn)
        _check_param(param, modules.get(fqn), fqn, expert_axis, mesh, tp_axis)
        grouped.setdefault(fqn, []).append(param.fqn)
    _check_combination(expert_axis, mesh, data_axes, tp_axis, options, context_axis)
    specs = {param.fqn: param for param in resolution.params}
    groups = []
    for fqn, names in grouped.items():
        module = modules[fqn]
        _check_module(fqn, module, names, specs, expert_axis, mesh)
        count = _count(module)
        inside = tp_axis if any(tp_axis in specs[name].spec.axes for name in names) else None
        groups.append(
            ExpertGroup(
                fqn,
                count,
                count // mesh.size(expert_axis),
                tuple(names),
                _top_k(model, module),
                inside,
            )
        )
    return tuple(groups)


def expert_shards(
    layouts: Sequence[ParamLayout], groups: Sequence[ExpertGroup], ways: int
) -> tuple[ParamLayout, ...]:
    """The layouts with each expert weight's FSDP shard taken over ``ways`` data ranks (those
    outside the expert axis: torchtitan's ``efsdp``); the others keep theirs (the data axes and
    the expert axis together).

    Example:
        >>> from meshtrain.plan.ir import ExpertGroup, ParamLayout
        >>> w = ParamLayout("e.w", (8, 4, 2), P("ep", None, None), "", (4, 4, 2), (1, 4, 2))
        >>> expert_shards([w], [ExpertGroup("e", 8, 4, ("e.w",))], 2)[0].shard_shape
        (2, 4, 2)
    """
    expert = {fqn for group in groups for fqn in group.params}
    return tuple(
        replace(p, shard_shape=(-(-p.local_shape[0] // ways), *p.local_shape[1:]))
        if p.fqn in expert
        else p
        for p in layouts
    )


def _count(module: nn.Module) -> int:
    """An experts module's ``num_experts`` (checked an int by :func:`is_experts_module`)."""
    count = getattr(module, "num_experts")  # noqa: B009  (an attribute nn.Module types loosely)
    assert isinstance(count, int)
    return count


def _owner(fqn: str) -> str:
    return fqn.rpartition(".")[0]


def _check_combination(
    axis: str,
    mesh: Mesh,
    data_axes: Sequence[str],
    tp_axis: str | None,
    options: PlanOptions,
    context_axis: str | None = None,
) -> None:
    """The combinations expert parallelism lowers with: data parallelism over one axis or two
    (HSDP: the experts replicated over the first data axis and sharded over the second, the
    other parameters sharded over the second and the expert axis together), FSDP2's ZeRO 1 to 3,
    checkpointing, mixed precision, pipelines (each stage dispatches its own layers' tokens over
    the expert ranks of its pipeline rank) and tensor parallelism on another axis for the layers
    outside the experts (the ranks of one tensor-parallel index dispatch among themselves; the
    experts stay whole over it) and torch.compile, the dispatch left eager between compiled
    graphs (so not with fullgraph=True). HSDP together with a pipeline, tensor or context
    parallelism is refused."""
    if options.compile and options.compile_fullgraph:
        raise PlanError(
            f"expert parallelism over '{axis}' on mesh {mesh} with compile fullgraph=True is "
            "not supported: the token dispatch exchanges data-dependent counts and runs eagerly "
            "between compiled graphs (a deliberate graph break). Compile with "
            "{'fullgraph': False}, or train the expert-parallel plan eagerly (compile=False).",
            mesh=mesh,
        )
    if options.decisions.wrapper == "replicate":
        raise PlanError(
            f"expert parallelism over '{axis}' on mesh {mesh} with zero=0 is not supported: "
            "the experts are data-parallel under FSDP2 over the data ranks outside the expert "
            "axis. Use zero=1, 2 or 3.",
            mesh=mesh,
        )
    sized = [a for a in data_axes if mesh.size(a) > 1]
    tp = tp_axis if tp_axis is not None and mesh.size(tp_axis) > 1 else None
    beside = (
        f"a pipeline over '{options.pipeline.axis}'"
        if options.pipeline is not None
        else f"tensor parallelism over '{tp}'"
        if tp is not None
        else f"context parallelism over '{context_axis}'"
        if context_axis
        else None
    )
    if beside is not None and len(sized) > 1:
        raise PlanError(
            f"expert parallelism over '{axis}' with HSDP over {sized} and {beside} on mesh "
            f"{mesh} is not supported in this version of meshtrain: it would not be proven to "
            "train like one device (it takes 16 ranks). Drop one of them (one data axis, "
            "fsdp='dp', beside the pipeline, tensor or context parallelism; or HSDP without "
            "them).",
            mesh=mesh,
        )


def _check_param(
    param: ParamSpec,
    module: nn.Module | None,
    fqn: str,
    axis: str,
    mesh: Mesh,
    tp_axis: str | None = None,
) -> None:
    """A parameter on the expert axis: an experts module's, sharded on its experts dim over it
    (and inside, over the tensor-parallel axis alone, as :mod:`~meshtrain.plan.experts.tensor`
    checks)."""
    if module is None or not is_experts_module(module):
        what = type(module).__name__ if module is not None else "the model"
        raise PlanError(
            f"parameter '{param.fqn}' of {what} is sharded over '{axis}', the expert axis of "
            f"mesh {mesh}, but '{fqn}' is not an experts module (an int num_experts and 3-D "
            "weights [num_experts, ...]); only experts split over the expert axis. Give it "
            f"P() (or shard it over a tensor-parallel axis), or name the experts module.",
            fqn=param.fqn,
            mesh=mesh,
        )
    spec = param.spec.padded(len(param.shape))
    count = _count(module)
    inner = [_sized(entry, mesh) for entry in spec[1:]]  # size-1 axes split nothing
    whole = tuple(not axes or (tp_axis is not None and axes == (tp_axis,)) for axes in inner)
    if spec[0] != axis or not all(whole) or param.shape[0] != count:
        inside = (
            f" and, inside each expert, the tensor-parallel axis '{tp_axis}'" if tp_axis else ""
        )
        raise PlanError(
            f"parameter '{param.fqn}' {list(param.shape)} of experts module '{fqn}' has spec "
            f"{param.spec!r}: expert parallelism shards the experts dim (dim 0, "
            f"{count} experts) over '{axis}'{inside}, nothing else. Use "
            f"P('{axis}', {', '.join(['None'] * (len(param.shape) - 1))}).",
            fqn=param.fqn,
            mesh=mesh,
        )


def _sized(entry: str | tuple[str, ...] | None, mesh: Mesh) -> tuple[str, ...]:
    """The axes larger than 1 of a spec entry."""
    return tuple(axis for axis in entry_axes(entry) if mesh.size(axis) > 1)


def _check_module(
    fqn: str,
    module: nn.Module,
    names: list[str],
    specs: dict[str, ParamSpec],
    axis: str,
    mesh: Mesh,
) -> None:
    """The whole experts module split alike, over a divisor of its experts, with the forward the
    dispatch calls."""
    count, ways = _count(module), mesh.size(axis)
    if count % ways:
        raise PlanError(
            f"experts module '{fqn}' has {count} experts, which do not split evenly over expert "
            f"axis '{axis}' of size {ways} on mesh {mesh}. Use an expert axis that divides "
            f"{count} (e.g. {max(d for d in range(1, ways + 1) if count % d == 0)}).",
            fqn=fqn,
            mesh=mesh,
        )
    prefix = f"{fqn}." if fqn else ""
    missing = [
        prefix + name
        for name, p in module.named_parameters()
        if prefix + name not in names and p.ndim >= 1 and p.shape[0] == count
    ]
    if missing:
        raise PlanError(
            f"experts module '{fqn}' has {names} sharded over expert axis '{axis}' but not "
            f"{missing} (spec {specs[missing[0]].spec!r} if resolved): every rank computes only "
            f"its own experts, so all their weights split alike. Give {missing} P('{axis}', ...).",
            fqn=missing[0],
            mesh=mesh,
        )
    params = list(inspect.signature(module.forward).parameters.values())
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) < 3 or any(p.kind == p.VAR_POSITIONAL for p in params[:3]):
        raise PlanError(
            f"experts module '{fqn}' ({type(module).__name__}) has forward{tuple(positional)}, "
            f"not forward{EXPERTS_FORWARD} -> [tokens, hidden], the one expert-parallel "
            "dispatch calls on each rank's tokens. Wrap the experts in a module with that "
            "forward, or keep them whole (P()).",
            fqn=fqn,
            mesh=mesh,
        )


def _top_k(model: nn.Module, module: nn.Module) -> int:
    """Experts per token from the module's or the model's config, 0 when neither says."""
    for source in (module, getattr(module, "config", None), getattr(model, "config", None)):
        for name in ("top_k", "num_experts_per_tok"):
            value = getattr(source, name, None)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
    return 0


def expert_spec(axis: str = "ep") -> P:
    """The spec of a 3-D expert weight split over ``axis``.

    Example:
        >>> expert_spec()
        P('ep', None, None)
    """
    return P(axis, None, None)
