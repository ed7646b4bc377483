"""JAX-style primitives for model code: ``constrain`` (``with_sharding_constraint``) and
``shard_map`` (per-shard code), both no-ops on one device so the reference runs the same code.

Under an applied plan, activations live on the tensor-parallel axis only: the batch dim is
already split by the data loader (data axes in a spec are satisfied by construction), so a spec
is reduced to its tensor-parallel part before it is applied. Between the plan's tensor-parallel
blocks, the plain tensors model code sees have a known layout — sequence shards
(``P(None, tp)``) under sequence parallelism, replicated otherwise — and ``constrain`` starts from
it. Inside a column-/row-wise pair's parent (attention, MLP) activations are rank-local head or
hidden shards whose layout the plan does not track: constrain a DTensor there, or use
``shard_map``.

Example (model code; the same on one device and under any plan)::

    h = mt.constrain(h, ("batch", "seq", "embed"))       # logical names, via activation rules
    y = mt.shard_map(torch.sin, in_specs=P(None, "tp"), out_specs=P(None, "tp"))(x)
"""

from __future__ import annotations

import contextvars
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import optree
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard
from torch.distributed.tensor.experimental import local_map

from meshtrain.errors import SpecError, format_shape
from meshtrain.lower.groups import device_mesh
from meshtrain.plan.ir import Plan, TPStyle
from meshtrain.spec.layout import validate_spec
from meshtrain.spec.mesh import Mesh
from meshtrain.spec.partition import P, entry_axes
from meshtrain.spec.rules import Rules

Spec = P | Sequence[str | None]
F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class _Active:
    """The plan whose model is running forward, and its activation mesh (the TP axis)."""

    plan: Plan
    tp_mesh: Mesh | None
    tp_device_mesh: DeviceMesh | None
    region: str | None = None  # FQN of the pair parent whose forward is running, if any

    @property
    def stream(self) -> Placement:
        return Shard(1) if self.plan.sequence_parallel else Replicate()


_ACTIVE: contextvars.ContextVar[_Active | None] = contextvars.ContextVar(
    "meshtrain_active_plan", default=None
)


def track(plan: Plan, model: nn.Module) -> None:
    """Make ``constrain``/``shard_map`` see ``plan`` while ``model`` runs forward (lowering calls
    this once; the hooks set and reset a context variable, so nothing leaks between models)."""
    tp_mesh, tp_device_mesh = None, None
    if plan.tp_axis is not None:
        tp_mesh = Mesh((plan.tp_axis,), (plan.mesh.size(plan.tp_axis),), plan.mesh.device_type)
        tp_device_mesh = device_mesh(plan.mesh)[plan.tp_axis]
    modules = dict(model.named_modules())
    _scope(model, _Active(plan, tp_mesh, tp_device_mesh))
    if plan.compile_scope is not None:
        # Hooks inside compiled code would be traced, and setting a context variable breaks the
        # graph: compiled plans skip the inside-a-pair check below (constrain still works).
        return
    for style in plan.styles:
        if style.style == TPStyle.PREPARE_INPUT and style.fqn:
            _scope(modules[style.fqn], _Active(plan, tp_mesh, tp_device_mesh, style.fqn))


def _scope(module: nn.Module, active: _Active) -> None:
    tokens: list[contextvars.Token[_Active | None]] = []

    def enter(_module: nn.Module, _args: Any) -> None:
        tokens.append(_ACTIVE.set(active))

    def leave(_module: nn.Module, _args: Any, _output: Any) -> None:
        if tokens:
            _ACTIVE.reset(tokens.pop())

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave, always_call=True)


def constrain(x: torch.Tensor, spec: Spec) -> torch.Tensor:
    """Lay ``x`` out as ``spec`` under the running plan; return ``x`` unchanged on one device.

    ``spec`` is a :class:`P` or a tuple of logical names (resolved with the plan's activation
    rules). A DTensor is redistributed and stays a DTensor. A plain tensor between the plan's
    blocks is taken in the layout the plan gives it there: if ``spec`` asks for that layout it is
    returned as is (an assertion, like explicit axes in JAX); otherwise it comes back as a
    DTensor in the new layout (code that then mixes it with plain tensors fails loudly, never
    silently). Raises :class:`SpecError` for a spec that does not fit ``x`` or the mesh.

    Example:
        >>> import torch
        >>> x = torch.ones(2, 8, 4)
        >>> constrain(x, P(None, "tp")) is x      # no plan running: a no-op
        True
    """
    active = _ACTIVE.get()
    if active is None:
        _check_rank(spec, x)
        return x
    tp_spec = _tp_spec(active, spec, x)
    if active.tp_mesh is None:
        return x
    placements = _activation_placements(tp_spec)
    if isinstance(x, DTensor):
        validate_spec(tp_spec, tuple(x.shape), active.tp_mesh)
        return x if x.placements == placements else x.redistribute(placements=placements)
    if active.region is not None:
        raise SpecError(
            f"constrain({format_shape(tuple(x.shape))} tensor, {spec!r}) runs inside "
            f"'{active.region}', whose activations are rank-local tensor-parallel shards the plan "
            "does not track. Constrain the module's input or output instead, pass a DTensor, or "
            "write per-shard code with mt.shard_map.",
            spec=tp_spec,
            mesh=active.tp_mesh,
        )
    if placements == (active.stream,):
        return x
    current = DTensor.from_local(x, active.tp_device_mesh, (active.stream,), run_check=False)
    validate_spec(tp_spec, tuple(current.shape), active.tp_mesh)
    return current.redistribute(placements=placements)


def shard_map(fn: F, *, in_specs: Any, out_specs: Any) -> F:
    """Run ``fn`` on each rank's local shards (``jax.shard_map``); a plain call on one device.

    ``in_specs`` is a pytree prefix of the positional arguments (one :class:`P` per argument, or
    one per leaf); ``out_specs`` is one :class:`P` for a single output or a tuple with one per
    flattened output (``None`` for a non-tensor). Under a plan, every tensor argument must
    already have its spec — a DTensor's own layout, or for a plain tensor between the plan's
    blocks the layout the plan gives it there; a mismatch is a :class:`SpecError`, never a silent
    redistribution (use ``constrain`` first). Outputs are DTensors with ``out_specs``, except that
    when every input was a plain tensor, outputs in the plan's between-blocks layout come back
    plain, so model code reads the same as on one device. Like ``local_map``, meshtrain does not
    check that outputs declared replicated really are equal across ranks.

    Example:
        >>> import torch
        >>> double = shard_map(lambda t: 2 * t, in_specs=P(None, "tp"), out_specs=P(None, "tp"))
        >>> double(torch.ones(2, 4)).sum().item()
        16.0
    """

    @functools.wraps(fn)
    def wrapped(*args: Any) -> Any:
        active = _ACTIVE.get()
        leaves: list[Any]
        leaves, treedef = optree.tree_flatten(args, none_is_leaf=True)  # type: ignore[arg-type]
        specs = _broadcast(in_specs, args, "in_specs")
        if active is None or active.tp_mesh is None:
            _check_unplanned(active, leaves, specs)
            return fn(*args)
        inputs = [
            _local_input(active, index, leaf, spec)
            for index, (leaf, spec) in enumerate(zip(leaves, specs))
        ]

        def flat_fn(*flat: Any) -> Any:
            return fn(*optree.tree_unflatten(treedef, list(flat)))

        mapped = local_map(
            flat_fn,
            out_placements=_out_placements(active, out_specs),
            in_placements=tuple(placements for _, placements in inputs),
            device_mesh=active.tp_device_mesh,
        )
        result = mapped(*(value for value, _ in inputs))
        if any(isinstance(leaf, DTensor) for leaf in leaves):
            return result
        return _plain_between_blocks(active, result)

    return wrapped  # type: ignore[return-value]


def _check_unplanned(active: _Active | None, leaves: list[Any], specs: list[P | None]) -> None:
    """``shard_map`` without a tensor-parallel plan running: specs must fit the tensors' ranks,
    and DTensors only come from a running plan."""
    for leaf, spec in zip(leaves, specs):
        if isinstance(leaf, torch.Tensor) and spec is not None:
            _check_rank(spec, leaf)
    if active is None and any(isinstance(leaf, DTensor) for leaf in leaves):
        raise SpecError(
            "shard_map got DTensor arguments outside a running plan; call it from the "
            "forward of a model the plan was applied to."
        )


def _local_input(
    active: _Active, index: int, leaf: Any, spec: P | None
) -> tuple[Any, tuple[Placement, ...] | None]:
    """One flattened argument as ``local_map`` takes it, with its placements (None for a
    non-tensor): a DTensor already laid out as its spec says, or a plain tensor between blocks
    taken in the plan's layout there. A mismatch is a SpecError, never a redistribution."""
    if not isinstance(leaf, torch.Tensor):
        return leaf, None
    mesh = active.tp_mesh
    assert mesh is not None  # shard_map calls this only under a tensor-parallel plan
    tp_spec = _tp_spec(active, _need_spec(spec, index), leaf)
    wanted = _activation_placements(tp_spec)
    if not isinstance(leaf, DTensor):
        if active.region is not None:
            raise SpecError(
                f"shard_map input {index} is a plain {format_shape(tuple(leaf.shape))} "
                f"tensor inside '{active.region}', whose activations are rank-local "
                "tensor-parallel shards the plan does not track, so in_specs "
                f"{tp_spec!r} cannot be checked. Pass a DTensor, or call shard_map on "
                "the module's input.",
                spec=tp_spec,
                shape=tuple(leaf.shape),
                mesh=mesh,
            )
        leaf = DTensor.from_local(leaf, active.tp_device_mesh, (active.stream,), run_check=False)
    if leaf.placements != wanted:
        raise SpecError(
            f"shard_map input {index} (global shape {format_shape(tuple(leaf.shape))}) is "
            f"laid out as {leaf.placements} but in_specs says {tp_spec!r} ({wanted}) on "
            f"mesh {mesh}; shard_map does not redistribute. Call mt.constrain(x, spec) "
            "before it, or fix in_specs.",
            spec=tp_spec,
            shape=tuple(leaf.shape),
            mesh=mesh,
        )
    validate_spec(tp_spec, tuple(leaf.shape), mesh)
    return leaf, wanted


def _out_placements(active: _Active, out_specs: Any) -> tuple[tuple[Placement, ...] | None, ...]:
    """``local_map``'s output placements: one per output spec (None for a non-tensor)."""
    outs = out_specs if isinstance(out_specs, tuple) else (out_specs,)
    return tuple(
        None if spec is None else _activation_placements(_tp_spec(active, spec, None))
        for spec in outs
    )


def _plain_between_blocks(active: _Active, result: Any) -> Any:
    """Plain tensors in, between blocks: outputs in the plan's layout there come back plain."""
    return optree.tree_map(
        lambda out: (
            out.to_local()
            if isinstance(out, DTensor) and out.placements == (active.stream,)
            else out
        ),
        result,
    )


def _activation_placements(tp_spec: P) -> tuple[Placement, ...]:
    """Placements on the one-axis activation mesh (the spec holds only the TP axis, or none)."""
    if tp_spec.unreduced:
        return (Partial("sum"),)
    for dim, entry in enumerate(tp_spec):
        if entry_axes(entry):
            return (Shard(dim),)
    return (Replicate(),)


def _broadcast(prefix: Any, tree: Any, name: str) -> list[P | None]:
    """Broadcast a spec pytree prefix to the leaves of ``tree`` (P and None are leaves)."""
    is_leaf = lambda node: node is None or isinstance(node, P)  # noqa: E731
    try:
        broadcast = optree.tree_broadcast_prefix(prefix, tree, is_leaf=is_leaf, none_is_leaf=True)
        return optree.tree_leaves(broadcast, is_leaf=is_leaf, none_is_leaf=True)
    except ValueError as err:
        raise SpecError(
            f"{name}={prefix!r} is not a pytree prefix of the arguments: {err}. Give one P per "
            "argument (a tuple for several), or one per leaf."
        ) from None


def _need_spec(spec: P | None, index: int) -> P:
    if spec is None:
        raise SpecError(f"shard_map input {index} is a tensor but its spec is None; give a P.")
    return spec


def _tp_spec(active: _Active, spec: Spec, x: torch.Tensor | None) -> P:
    """``spec`` (or logical names) with data axes and size-1 axes dropped: the activation layout."""
    plan = active.plan
    if not isinstance(spec, P):
        spec = Rules(logical=plan.activation_rules).logical_spec(tuple(spec), plan.mesh)
    if x is not None:
        _check_rank(spec, x)
    for axis in (*spec.axes, *spec.unreduced):
        if axis not in plan.mesh:
            raise SpecError(
                f"{spec!r} names axis '{axis}', which mesh {plan.mesh} does not have.",
                spec=spec,
                mesh=plan.mesh,
            )
    keep = {plan.tp_axis} if plan.tp_axis is not None else set()
    entries = []
    for entry in spec:
        axes = tuple(axis for axis in entry_axes(entry) if axis in keep)
        entries.append(axes[0] if len(axes) == 1 else (axes or None))
    return P(*entries, unreduced=[axis for axis in spec.unreduced if axis in keep])


def _check_rank(spec: Spec, x: torch.Tensor) -> None:
    if len(spec) > x.dim():
        raise SpecError(
            f"{spec!r} has {len(spec)} entries but the tensor (shape "
            f"{format_shape(tuple(x.shape))}) has {x.dim()} dims; give at most one entry per dim.",
            shape=tuple(x.shape),
        )
