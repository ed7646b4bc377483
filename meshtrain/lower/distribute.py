"""``mt.distribute``: a full tensor, held identically on every rank, as a DTensor laid out by a
spec — each rank slices its own shard, so no collective is issued.

Example (on every rank of a 4-rank job)::

    weight = mt.distribute(torch.randn(8, 4, generator=g), mesh, P("tp", None))
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from meshtrain.errors import SpecError
from meshtrain.lower.groups import device_mesh
from meshtrain.spec.layout import shard_slices, validate_spec
from meshtrain.spec.mesh import Mesh
from meshtrain.spec.partition import P
from meshtrain.spec.placements import to_placements


def distribute(
    tensor: torch.Tensor,
    mesh: Mesh,
    spec: P,
    *,
    fqn: str | None = None,
    requires_grad: bool | None = None,
) -> DTensor:
    """Turn a full tensor held identically on every rank into a DTensor laid out as ``spec``.

    Each rank slices its own shard (see :func:`shard_slices`), so no collective is issued. This is
    the "initialise on the full tensor, then distribute" rule that makes distributed runs start
    from exactly the single-device weights.

    Example (on every rank of a 4-rank job)::

        mesh = mt.make_mesh(dp=2, tp=2)
        weight = distribute(torch.randn(8, 4, generator=g), mesh, P("tp", None))
        assert weight.to_local().shape == (4, 4)
    """
    if mesh.is_abstract:
        raise SpecError(
            f"cannot distribute {'parameter ' + repr(fqn) if fqn else 'a tensor'} on the abstract "
            f"mesh {mesh}: describe the mesh with make_mesh(...) without abstract=True.",
            fqn=fqn,
            spec=spec,
            mesh=mesh,
        )
    validate_spec(spec, tuple(tensor.shape), mesh, fqn=fqn)
    if spec.unreduced:
        what = f"parameter '{fqn}'" if fqn else "a full tensor"
        raise SpecError(
            f"cannot distribute {what} as {spec!r}: unreduced axes {sorted(spec.unreduced)} "
            "describe partial sums, which only computations produce. Drop `unreduced`.",
            fqn=fqn,
            spec=spec,
            mesh=mesh,
        )
    bound = device_mesh(mesh)
    rank = bound.get_rank()
    local = tensor.detach()[shard_slices(spec, tuple(tensor.shape), mesh, rank)].contiguous()
    dtensor = DTensor.from_local(
        local,
        bound,
        to_placements(spec, mesh, tensor.dim()),
        run_check=False,
        shape=tensor.shape,
        stride=_contiguous_stride(tuple(tensor.shape)),
    )
    grad = tensor.requires_grad if requires_grad is None else requires_grad
    result: DTensor = dtensor.detach().requires_grad_(grad)  # type: ignore[assignment]
    return result


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))
