"""A resume continues its own run: the checkpoint's recipe and run id against this run's.

:func:`check_recipe_unchanged` reads the recipe a checkpoint was saved with and compares it with
the resuming one (:mod:`~meshtrain.recipes.resume_check`); :func:`run_id` is the id every
checkpoint of a run records (drawn once, at the fresh start, and carried by each resume).

Example (on every rank, before any tensor is loaded)::

    for line in check_recipe_unchanged(recipe, point.checkpoint):
        print(line)
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch.distributed as dist

from meshtrain.errors import CheckpointError
from meshtrain.recipes.data import data_directory, document_source
from meshtrain.recipes.recipe import Recipe
from meshtrain.recipes.resume_check import check_resume
from meshtrain.train.checkpoint import find_resume_point
from meshtrain.train.checkpoint.files import read_state_file
from meshtrain.train.data.documents import FILE_SOURCES
from meshtrain.train.data.identity import (
    as_json,
    from_json,
    identity_change,
    read_identity,
    source_identity,
)

__all__ = [
    "check_before_launch",
    "check_recipe_unchanged",
    "recorded_data_files",
    "run_id",
]


def run_id(resume: Path | None) -> str:
    """The run's id: the resumed checkpoint's, else a new one drawn on rank 0 (every rank gets
    the same)."""
    if resume is not None:
        run = read_state_file(resume).get("extra", {}).get("run") or {}
        if run.get("id"):
            return str(run["id"])
    drawn = [uuid.uuid4().hex[:12] if not dist.is_initialized() or dist.get_rank() == 0 else ""]
    if dist.is_initialized():
        dist.broadcast_object_list(drawn, src=0)
    return str(drawn[0])


def check_recipe_unchanged(recipe: Recipe, checkpoint: Path) -> list[str]:
    """Compare ``recipe`` with the one ``checkpoint`` was saved with; return a line for each
    safe or allowed change, raise a :class:`CheckpointError` naming the keys and both values for
    a change of what training means, or when the checkpoint belongs to another recipe's run. The
    same on every rank (the same file, the same recipe)."""
    extra = read_state_file(checkpoint).get("extra", {})
    saved = extra.get("recipe")
    if not isinstance(saved, dict):
        return [
            f"warning: {checkpoint} holds no recipe to compare with (saved by an older meshtrain)"
        ]
    data_step = int((extra.get("data") or {}).get("step", 0))
    allowed = recipe.checkpoint.allow_change
    verdict = check_resume(saved, recipe.raw, allowed=allowed, data_step=data_step)
    run = extra.get("run") or {}
    if run.get("recipe") not in (None, recipe.name) and "recipe" not in allowed:
        raise CheckpointError(
            f"checkpoint {checkpoint} belongs to run {run.get('id')} of recipe "
            f"{run.get('recipe')!r}, not to recipe {recipe.name!r}: another run may not resume "
            "it. Give this run its own directory (logging.run_dir), or pass --allow-change "
            "recipe to continue that run under this recipe."
        )
    verdict.raise_if_refused(str(checkpoint))
    lines = [*verdict.lines, *_data_unchanged(recipe, extra.get("data_files"), checkpoint, allowed)]
    name = f" of run {run['id']}" if run.get("id") else ""
    return [line.replace("resuming", f"resuming{name}", 1) for line in lines]


def recorded_data_files(recipe: Recipe) -> list[dict[str, Any]]:
    """The files a file source's prepared tokens were made from (path, size, sha256), as a
    checkpoint records them; none for other sources."""
    if recipe.data.source not in FILE_SOURCES:
        return []
    return as_json(read_identity(data_directory(recipe)))


def _data_unchanged(
    recipe: Recipe, saved: Any, checkpoint: Path, allowed: Sequence[str]
) -> list[str]:
    """Refuse a resume whose data files changed since ``checkpoint`` (the data position would
    index other tokens), naming the file; a line when ``--allow-change data.path`` asks for it."""
    before = from_json(saved)
    if not before or recipe.data.source not in FILE_SOURCES:
        return []
    now = source_identity(document_source(recipe), read_identity(data_directory(recipe)))
    change = identity_change(before, now)
    if change is None:
        return []
    if any(item in ("data", "data.path") for item in allowed):
        return [f"resuming on changed data, allowed: {change}; the data position carries over"]
    raise CheckpointError(
        f"checkpoint {checkpoint} was trained on other data: {change}. Resuming would continue "
        "at its data position in other tokens. Restore the data, start a new run directory, or "
        "continue on the new data on purpose with --allow-change data.path."
    )


def check_before_launch(recipe: Recipe) -> None:
    """The launcher's copy of the ranks' resume checks, before any rank starts: refuse a fresh
    start over checkpoint folders, and a resume whose recipe changes what training means (sizes
    and the state file only: the ranks verify every file's checksum and check again)."""
    if not recipe.checkpoint.resume:
        return
    allow = recipe.checkpoint.allow_unverified
    point = find_resume_point(recipe.checkpoint_dir, verify=False, allow_unverified=allow)
    point.refuse_start_over(recipe.checkpoint_dir)
    if point.checkpoint is not None:
        check_recipe_unchanged(recipe, point.checkpoint)
