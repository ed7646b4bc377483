"""Distributed checkpoints: save on every rank, resume under any mesh, verify them, and hold a run
directory for one job.

Modules: :mod:`~meshtrain.train.checkpoint` (save, resume, export), ``files`` (a checkpoint on
disk, no collectives), ``state`` (what goes into a checkpoint) and ``integrity`` (checksums);
one run per directory is :mod:`meshtrain.files.lock`.

    >>> CheckpointConfig("runs/x/checkpoints", interval=50).interval
    50
"""

from typing import Any

from meshtrain.train.checkpoint.dcp import (
    CheckpointConfig,
    Checkpointer,
    ResumePoint,
    find_resume_point,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    verify_checkpoint,
)


def __getattr__(name: str) -> Any:
    """``export_safetensors`` and ``load_safetensors`` live in :mod:`meshtrain.train.hf.single_file`
    (imported on first use here: that package reads checkpoint files, so importing it eagerly
    would be a cycle)."""
    if name in ("export_safetensors", "load_safetensors"):
        from meshtrain.train.hf import single_file

        return getattr(single_file, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "CheckpointConfig",
    "Checkpointer",
    "ResumePoint",
    "export_safetensors",
    "find_resume_point",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "load_safetensors",
    "verify_checkpoint",
]
