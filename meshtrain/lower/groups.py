"""Meshes bound to the running ranks: the ``DeviceMesh`` a mesh description stands for, the
process group over several of its axes, and the device a plan computes on.

A :class:`~meshtrain.Mesh` is a description; the first lowering step that needs processes binds
it here (``init_device_mesh`` over the axes larger than 1, once per description and process
group, then cached), so every rank creates the same groups in the same order.

Example (on every rank of a 4-rank job, after ``mt.init_distributed()``)::

    mesh = mt.make_mesh(dp=2, tp=2)
    device_mesh(mesh)["tp"].size()     # 2
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from meshtrain.errors import MeshError
from meshtrain.plan.ir import Plan
from meshtrain.spec.mesh import Mesh

_BOUND: dict[tuple[tuple[str, ...], tuple[int, ...], str], tuple[object, DeviceMesh]] = {}


def device_mesh(mesh: Mesh) -> DeviceMesh:
    """The ``DeviceMesh`` over the running ranks that ``mesh`` describes (its axes larger than 1),
    created on first use by every rank alike and cached for this process group.

    Raises :class:`~meshtrain.MeshError` for a planning-only mesh, without a process group, or
    when the mesh does not span the world.
    """
    if mesh.is_abstract:
        raise MeshError(
            f"mesh {mesh} was made for planning only (abstract=True) and cannot be bound to "
            "processes: make it with mt.make_mesh(...) without abstract=True on every rank, and "
            "plan again."
        )
    if not dist.is_initialized():
        raise MeshError(
            f"mesh {mesh} needs running ranks, but no process group exists: call "
            "mt.init_distributed() first (under torchrun, or alone for one rank)."
        )
    if dist.get_world_size() != mesh.world_size:
        raise MeshError(
            f"mesh {mesh} spans {mesh.world_size} ranks but the process group has "
            f"{dist.get_world_size()}: make the sizes multiply to {dist.get_world_size()}, or "
            f"launch {mesh.world_size} ranks."
        )
    key = (mesh.axis_names, mesh.axis_sizes, mesh.device_type)
    world = dist.group.WORLD
    bound = _BOUND.get(key)
    if bound is None or bound[0] is not world:
        axes = mesh.device_axes
        created = init_device_mesh(
            mesh.device_type, tuple(mesh.size(axis) for axis in axes), mesh_dim_names=axes
        )
        bound = _BOUND[key] = (world, created)
    return bound[1]


def axis_group(mesh: Mesh, axis: str) -> ProcessGroup:
    """This rank's process group along one axis (larger than 1) of ``mesh``."""
    return device_mesh(mesh).get_group(axis)


def group_over(plan: Plan, axes: Sequence[str]) -> ProcessGroup | None:
    """This rank's process group over ``axes`` of the plan's mesh together, so one collective
    reduces over all of them; ``None`` when they span this rank alone. One axis is its own group;
    several are the ``DeviceMesh`` flattened over them (created by every rank on first use, then
    cached on the mesh by torch), named as :meth:`~meshtrain.spec.mesh.Mesh.joined` names it.
    ``DeviceMesh._flatten`` is private in torch 2.13 (FSDP2's HSDP and torchtitan use it too);
    :func:`mesh_over` is meshtrain's only call of it.
    """
    name = plan.mesh.joined(tuple(axes))
    if not name:
        return None
    return mesh_over(plan, axes).get_group()


def mesh_over(plan: Plan, axes: Sequence[str]) -> DeviceMesh:
    """The one-dimensional ``DeviceMesh`` over ``axes`` (those larger than 1) together: one axis's
    own, or the bound mesh flattened over several (see :func:`group_over`)."""
    name = plan.mesh.joined(tuple(axes))
    names = tuple(name.split("+"))
    bound = device_mesh(plan.mesh)
    if len(names) == 1:
        return bound[names[0]]
    return bound[names]._flatten(name)


def hsdp_mesh_over(plan: Plan, replicate: str, shard_axes: Sequence[str]) -> DeviceMesh:
    """The two-dimensional ``DeviceMesh`` FSDP2 runs HSDP over: ``replicate`` (dim 0), then
    ``shard_axes`` flattened into one dim (dim 1, :func:`mesh_over`), as torchtitan's
    ``dp_replicate`` × ``dp_shard_cp``. It is put together the way FSDP2 puts its own HSDP mesh
    together (``DeviceMesh._concatenate``, private in torch 2.13: slicing a flattened dim off the
    root mesh is deprecated), so the axes may come in any order in the mesh (a slice of the root
    mesh must keep the mesh's order: ``{dp, rep}`` could not give ``[rep, dp]``).

    Example (on every rank of an 8-rank job)::

        plan = mt.plan(model, mt.make_mesh(rep=2, dp=2, ep=2), rules)  # fsdp=("rep", "dp")
        hsdp_mesh_over(plan, "rep", ("dp", "ep")).mesh_dim_names        # ('rep', 'dp+ep')
    """
    replicated = device_mesh(plan.mesh)[replicate]
    return DeviceMesh._concatenate([replicated, mesh_over(plan, shard_axes)])


def plan_device(plan: Plan) -> torch.device:
    """The device this rank computes on under ``plan`` (the current CUDA device on a CUDA mesh);
    scalars that go through the plan's collectives live there (NCCL reduces CUDA tensors only)."""
    if plan.mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(plan.mesh.device_type)
