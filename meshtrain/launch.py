"""Starting ranks: under ``torchrun`` (one node or many), spawned locally through it, or joined
through a store (the SPMD test runner) — :func:`init_distributed` is the one function that starts
the process group.

``meshtrain train`` run by ``torchrun`` finds its rank in the environment and joins the process
group. Run directly, it re-executes itself under ``torchrun`` with ``--nproc`` local ranks
(``--nnodes``/``--node-rank``/``--rdzv-endpoint`` make this machine one node of several), so a
laptop and a cluster run the same command.

Example:
    >>> torchrun_command(["train", "debug"], nproc=4)[3:6]
    ['--nproc-per-node=4', '--nnodes=1', '--standalone']
    >>> torchrun_command(["train", "debug"], nproc=2, nnodes=2, node_rank=1,
    ...                  rdzv_endpoint="10.0.0.1:29500")[5:8]
    ['--node-rank=1', '--rdzv-backend=static', '--rdzv-endpoint=10.0.0.1:29500']
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
from collections.abc import Sequence

import torch
import torch.distributed as dist

from meshtrain.errors import MeshtrainError

#: Environment variables torchrun sets for every worker.
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def under_torchrun() -> bool:
    """True in a process started by ``torchrun`` (or anything that sets its variables)."""
    return all(name in os.environ for name in TORCHRUN_VARIABLES)


def init_distributed(
    *,
    backend: str | None = None,
    timeout_s: float = 600.0,
    store: dist.Store | None = None,
    rank: int | None = None,
    world_size: int | None = None,
) -> torch.device:
    """Join (or create) the default process group; returns this rank's device. The one place
    meshtrain starts its runtime: the CLI, the SPMD test runner and users' scripts call it, then
    describe meshes with :func:`~meshtrain.make_mesh`. Does nothing when the group exists.

    Under ``torchrun`` (its variables set) it joins the job's rendezvous; with ``store``,
    ``rank`` and ``world_size`` it joins through that store; alone (no launcher) it creates a
    one-rank group, so a script runs unchanged on one device. The backend is NCCL on GPUs
    (the device is ``cuda:LOCAL_RANK``), gloo otherwise.

    Example (a user's script, run with ``torchrun --nproc_per_node 4 script.py``)::

        device = mt.init_distributed()
        mesh = mt.make_mesh(dp=-1, tp=2)
    """
    if torch.cuda.is_available() and backend in (None, "nccl"):
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    backend = backend or ("nccl" if device.type == "cuda" else "gloo")
    if dist.is_initialized():
        return device
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is not None:
        if rank is None or world_size is None:
            raise MeshtrainError(
                "init_distributed(store=...) needs this process's rank and the world_size too."
            )
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size, timeout=timeout
        )
    elif under_torchrun():
        dist.init_process_group(backend, timeout=timeout)  # torchrun's env:// rendezvous
    elif int(os.environ.get("WORLD_SIZE", "1")) == 1:
        dist.init_process_group(
            backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
        )
    else:
        missing = [name for name in TORCHRUN_VARIABLES if name not in os.environ]
        raise MeshtrainError(
            f"WORLD_SIZE={os.environ['WORLD_SIZE']} is set but the rest of torchrun's "
            f"environment is not ({', '.join(missing)} unset): start the ranks with `torchrun "
            "--nproc_per_node N script.py` (or `meshtrain train RECIPE --nproc N`)."
        )
    return device


def torchrun_command(
    args: Sequence[str],
    *,
    nproc: int,
    nnodes: int = 1,
    node_rank: int = 0,
    rdzv_endpoint: str | None = None,
) -> list[str]:
    """The ``torchrun`` command line that runs ``python -m meshtrain <args>`` on ``nproc`` local
    ranks (one node standalone, or node ``node_rank`` of ``nnodes`` meeting at
    ``rdzv_endpoint``, node 0's address: node ``R`` holds global ranks ``R·nproc`` to
    ``R·nproc + nproc - 1``)."""
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}"]
    if nnodes == 1 and rdzv_endpoint is None:
        command += ["--nnodes=1", "--standalone"]
    else:
        if rdzv_endpoint is None:
            raise MeshtrainError(
                f"--nnodes={nnodes} needs --rdzv-endpoint HOST:PORT (the address every node "
                "can reach, usually node 0's), e.g. --rdzv-endpoint 10.0.0.1:29500."
            )
        if not 0 <= node_rank < nnodes:
            raise MeshtrainError(
                f"--node-rank={node_rank} is not in 0..{nnodes - 1} (--nnodes={nnodes}): give "
                "each node a distinct rank below the node count."
            )
        # Static rendezvous: node R's ranks are R·nproc … R·nproc + nproc - 1, and node 0 hosts
        # the store at the endpoint (c10d rendezvous would number nodes in joining order).
        command += [f"--nnodes={nnodes}", f"--node-rank={node_rank}", "--rdzv-backend=static",
                    f"--rdzv-endpoint={rdzv_endpoint}"]  # fmt: skip
    return [*command, "-m", "meshtrain", *args]


def run_under_torchrun(command: Sequence[str]) -> int:
    """Run a :func:`torchrun_command`; its exit status (non-zero when any rank failed)."""
    return subprocess.call(list(command))
