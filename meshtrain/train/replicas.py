"""Replicas cannot drift silently: replicated parameters and optimizer states compared bitwise.

A parameter replicated over a mesh axis (data-parallel replicas under ZeRO 0, norms replicated
over the tensor-parallel axis, a plain tensor in a flat plan) must hold the same bits on every
rank of that axis: the same gradient reduction and the same update keep it so. A collective one
rank skipped, a rank-seeded initialisation, a non-deterministic kernel or a memory fault makes
the copies drift apart, and the run trains on, silently wrong. :func:`verify_replicas` hashes each
replicated tensor's local bytes (two position-weighted sums with odd weights in wrapping 64-bit
integer arithmetic: exact, so equal bytes give equal digests) and compares the
digests over the replicating axes with one max-reduction of ``[digest, −digest]`` per
(mesh, axis): a maximum that is not minus the minimum is a drift. One all-reduce over the world
then makes every rank decide alike; only when something drifted do the ranks exchange their
digests to name the first tensor and the ranks that hold another value
(:class:`~meshtrain.errors.ReplicaDriftError`, raised on every rank).

The recipe key ``[train] verify_every = N`` runs it after every N-th step (0, the default: never).

Example:
    >>> import torch
    >>> a = torch.arange(6, dtype=torch.float32)
    >>> bool((tensor_digest(a) == tensor_digest(a.clone())).all())
    True
    >>> b = a.clone(); b[3] = torch.nextafter(b[3], torch.tensor(10.0))
    >>> bool((tensor_digest(a) == tensor_digest(b)).all())
    False
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from meshtrain.errors import ReplicaDriftError
from meshtrain.lower.groups import group_over, plan_device
from meshtrain.plan.ir import Plan

_CHUNK = 1 << 20
#: Two odd 64-bit multipliers (as signed int64): each word is weighted by an odd number, so a
#: change of one word always changes both sums modulo 2⁶⁴.
_MULTIPLIERS = (-7046029254386353131, 0x2545F4914F6CDD1D)


@functools.cache
def _weights(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position odd weights for one chunk (int64, wrapping): ``(2i + 1) · m``."""
    odd = torch.arange(_CHUNK, dtype=torch.int64, device=device) * 2 + 1
    first, second = (odd * m for m in _MULTIPLIERS)
    return first, second


def tensor_digest(tensor: torch.Tensor) -> torch.Tensor:
    """A 128-bit digest of ``tensor``'s bytes as int64 ``[2]``: BLAKE2b for a tensor in host
    memory; on an accelerator (no copy to the host) two position-weighted sums of its 32-bit
    words in wrapping 64-bit integer arithmetic, each chunk's sums weighted again by an odd
    number per chunk. Equal bytes give equal digests; one changed word always changes both (every weight is
    odd); a random change escapes a sum with probability about 2⁻⁶⁴.
    """
    data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    if data.device.type == "cpu":  # the bytes through BLAKE2b, in C: several times faster
        hashed = hashlib.blake2b(data.numpy().data, digest_size=16).digest()
        return torch.frombuffer(bytearray(hashed), dtype=torch.int64).clone()
    if data.numel() % 4:
        data = torch.cat([data, data.new_zeros(4 - data.numel() % 4)])
    words = data.view(torch.int32)
    first, second = _weights(words.device)
    digest = torch.zeros(2, dtype=torch.int64, device=tensor.device)
    for index, start in enumerate(range(0, words.numel(), _CHUNK)):
        chunk = words[start : start + _CHUNK].to(torch.int64)
        n, odd = chunk.numel(), 2 * index + 1
        digest[0] += (chunk * first[:n]).sum() * odd
        digest[1] += (chunk * second[:n]).sum() * odd
    return digest


@dataclass(frozen=True)
class _Replicated:
    """One replicated tensor on this rank: its name, local bytes, and the replicating groups."""

    name: str
    local: torch.Tensor
    key: tuple[Any, ...]  # (mesh, replicated dims) or ("plain",): tensors checked together
    ranks: tuple[int, ...]  # the ranks that must hold the same bits as this one


def verify_replicas(
    plan: Plan,
    params: Mapping[str, torch.Tensor],
    optimizer: torch.optim.Optimizer | None = None,
    *,
    step: int | None = None,
) -> int:
    """Check on every rank that each replicated parameter and optimizer state is bitwise equal
    on all its replicas; return how many local tensors were checked.

    Raises :class:`~meshtrain.errors.ReplicaDriftError` on every rank alike when one differs,
    naming the first such tensor, the ranks that replicate it and which of them disagree.

    Example (on every rank, after a step)::

        verify_replicas(plan, state.params, state.optimizer, step=state.step)
    """
    entries = list(_replicated(plan, params, optimizer))
    device = plan_device(plan)
    drifted = _compare(entries, device)
    count = torch.tensor([len(drifted)], dtype=torch.int64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(count)
    if int(count.item()) == 0:
        return len(entries)
    message, name = _describe(drifted, int(count.item()), step)
    raise ReplicaDriftError(message, fqn=name.split(" (optimizer state", 1)[0])


def _replicated(
    plan: Plan, params: Mapping[str, torch.Tensor], optimizer: torch.optim.Optimizer | None
) -> Iterator[_Replicated]:
    states = optimizer.state if optimizer is not None else {}
    plain = _plain_group(plan)
    for fqn, param in params.items():
        replicas = _replicas_of(param, plain)
        if replicas is None:
            continue
        key, ranks = replicas
        yield _Replicated(fqn, _local(param), key, ranks)
        for state_key, value in sorted(states.get(param, {}).items()):
            if isinstance(value, torch.Tensor):
                name = f"{fqn} (optimizer state {state_key})"
                yield _Replicated(name, _local(value), key, ranks)


def _plain_group(plan: Plan) -> tuple[Any, tuple[int, ...]] | None:
    """Where a plain (non-DTensor) tensor is replicated: every axis of the mesh but the
    pipeline's (each stage holds its own parameters)."""
    axes = tuple(a for a in plan.mesh.axis_names if not plan.pipeline or a != plan.pipeline.axis)
    group = group_over(plan, axes) if dist.is_initialized() else None
    if group is None:
        return None
    return group, tuple(dist.get_process_group_ranks(group))


def _replicas_of(
    tensor: torch.Tensor, plain: tuple[Any, tuple[int, ...]] | None
) -> tuple[tuple[Any, ...], tuple[int, ...]] | None:
    if not isinstance(tensor, DTensor):
        return None if plain is None else (("plain", plain[0]), plain[1])
    mesh = tensor.device_mesh
    dims = tuple(
        i
        for i, placement in enumerate(tensor.placements)
        if isinstance(placement, Replicate) and mesh.size(i) > 1
    )
    if not dims:
        return None
    coordinate = mesh.get_coordinate()
    assert coordinate is not None  # a DTensor's mesh holds the rank that holds it
    index = tuple(slice(None) if i in dims else c for i, c in enumerate(coordinate))
    ranks = tuple(int(r) for r in mesh.mesh[index].reshape(-1).tolist())
    return (mesh, dims), ranks


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _compare(
    entries: list[_Replicated], device: torch.device
) -> list[tuple[str, tuple[int, ...], list[int]]]:
    """Max-reduce ``[digest, −digest]`` per (mesh, dims) group; the drifted ones on this rank
    as ``(name, replica ranks, this rank's digest)``."""
    groups: dict[tuple[Any, ...], list[_Replicated]] = {}
    for entry in entries:
        groups.setdefault(entry.key, []).append(entry)
    drifted = []
    for key, members in groups.items():
        digests = torch.stack([tensor_digest(m.local).to(device) for m in members])
        both = torch.cat([digests, -digests], dim=1)
        if key[0] == "plain":
            dist.all_reduce(both, op=dist.ReduceOp.MAX, group=key[1])
        else:
            mesh, dims = key
            for dim in dims:
                dist.all_reduce(both, op=dist.ReduceOp.MAX, group=mesh.get_group(dim))
        differ = (both[:, :2] != -both[:, 2:]).any(dim=1)
        for member, digest, bad in zip(members, digests.tolist(), differ.tolist()):
            if bad:
                drifted.append((member.name, member.ranks, digest))
    return drifted


def _describe(
    drifted: list[tuple[str, tuple[int, ...], list[int]]], count: int, step: int | None
) -> tuple[str, str]:
    """Every rank's drifted tensors gathered; the message names the first (lowest rank's first)
    and, among its replicas, the ranks holding each distinct value."""
    reports: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(reports, (dist.get_rank(), drifted))
    reports = sorted(r for r in reports if r[1])
    first_name, replicas = reports[0][1][0][0], reports[0][1][0][1]
    values: dict[tuple[int, ...], list[int]] = {}
    for rank, entries in reports:
        for name, ranks, digest in entries:
            if name == first_name and ranks == replicas:
                values.setdefault(tuple(digest), []).append(rank)
    holders = sorted(values.values(), key=lambda ranks: (-len(ranks), ranks))
    split = "; ".join(
        f"ranks {ranks} hold {'one value' if i == 0 else 'another'}"
        for i, ranks in enumerate(holders)
    )
    when = f" after step {step}" if step is not None else ""
    return (
        f"replicas drifted apart{when}: {first_name!r} is not bitwise identical on its replicas "
        f"(ranks {list(replicas)}): {split}; {count} tensor copies differ in all. Replicated "
        "values must get the same reduced gradient and the same update on every rank: look for a "
        "collective one rank skipped, a rank-seeded initialisation or dropout, or a "
        "non-deterministic kernel. Resume from a checkpoint saved before the drift."
    ), first_name


__all__ = ["tensor_digest", "verify_replicas"]
