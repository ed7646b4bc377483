"""Starting ranks: under ``torchrun`` (one node or many), or spawned locally through it.

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

from meshtrain.spec.errors import MeshtrainError

#: Environment variables torchrun sets for every worker.
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def under_torchrun() -> bool:
    """True in a process started by ``torchrun`` (or anything that sets its variables)."""
    return all(name in os.environ for name in TORCHRUN_VARIABLES)


def init_distributed(timeout_s: float = 600.0) -> torch.device:
    """Join the process group torchrun describes (NCCL on GPUs, gloo otherwise); returns this
    rank's device. Does nothing when the group already exists."""
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        if not under_torchrun():
            missing = [name for name in TORCHRUN_VARIABLES if name not in os.environ]
            raise MeshtrainError(
                f"no process group and no torchrun environment ({', '.join(missing)} unset): "
                "start with `torchrun ... -m meshtrain train RECIPE`, or let `meshtrain train "
                "RECIPE --nproc N` start the ranks."
            )
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
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
