"""What changed between the recipe a checkpoint was saved with and the recipe resuming it.

A resume continues a run; it must not quietly become another one. Every recipe key is compared
(absent keys read as their section's default). A change to a key that alters what training
means — the model, the data, the batch, the sequence length, the seeds, the optimizer and its
hyper-parameters, the LoRA adapters, the precision — is refused, naming each key with both values,
unless the recipe allows it (``checkpoint.allow_change``, ``meshtrain train --allow-change KEY``);
an allowed change says what it does to the data position. Safe changes — the step count, logging,
the checkpoint schedule, evaluation, profiling, the heartbeat, the mesh and the parallel layout
(DCP reshards) — pass with one line. Each key's rule is declared with the key
(:data:`meshtrain.recipes.sections.Resume`).
Torch-free: the launcher and the ranks run the same comparison.

Example:
    >>> saved = {"train": {"batch_size": 8, "steps": 10}, "mesh": {"dp": 2}}
    >>> now = {"train": {"batch_size": 16, "steps": 20}, "mesh": {"dp": 1, "tp": 2}}
    >>> changes = compare_recipes(saved, now)
    >>> [(change.key, change.safe) for change in changes]
    [('mesh.dp', True), ('mesh.tp', True), ('train.batch_size', False), ('train.steps', True)]
    >>> check_resume(saved, now, allowed=("train.batch_size",), data_step=6).refused
    ()
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from meshtrain.errors import CheckpointError
from meshtrain.recipes.sections import SECTION_TYPES, resume_rule
from meshtrain.tables import flatten_table

__all__ = ["RecipeChange", "ResumeCheck", "check_resume", "compare_recipes"]

#: What an allowed change of these keys does to the saved data position.
_DATA_EFFECT = {
    "train.batch_size": "the data position is counted in global batches, so the next batch "
    "starts at sample {step} × the new batch size: samples are skipped (larger) or repeated "
    "(smaller)",
    "train.seq_len": "the token windows are cut anew, so the saved position {step} points at "
    "other tokens",
    "data.": "the saved position (batch {step} of its epoch) now indexes the new data",
    "train.seed": "the model's initial values are not re-drawn; the step's random state comes "
    "from the checkpoint",
}


@dataclass(frozen=True)
class RecipeChange:
    """One key whose value differs: its dotted name, both values (``None``: absent and no
    default) and whether the change is safe."""

    key: str
    saved: Any
    now: Any
    safe: bool

    def describe(self) -> str:
        """``key: saved → now`` (``unset``: absent, the model's or preset's own value).

        Example:
            >>> RecipeChange("model.dim", None, 96, safe=False).describe()
            'model.dim: unset → 96'
        """
        return f"{self.key}: {_shown(self.saved)} → {_shown(self.now)}"


def _shown(value: Any) -> str:
    return "unset" if value is None else repr(value)


@dataclass(frozen=True)
class ResumeCheck:
    """The verdict on a resume: the changes that pass (with the lines to print) and those
    refused."""

    lines: tuple[str, ...]
    refused: tuple[RecipeChange, ...]

    def raise_if_refused(self, checkpoint: str) -> None:
        """A :class:`CheckpointError` naming every refused key with both values."""
        if not self.refused:
            return
        shown = "\n".join(f"  - {change.describe()}" for change in self.refused)
        keys = " ".join(f"--allow-change {change.key}" for change in self.refused)
        raise CheckpointError(
            f"the recipe differs from the one checkpoint {checkpoint} was saved with, in keys "
            f"that change what training means (saved → now):\n{shown}\nResuming would continue "
            "another run under this one's name. Put the values back, start a new run directory "
            f"(logging.run_dir), or pass {keys} to resume with the change on purpose."
        )


def _default(key: str) -> Any:
    section, _, name = key.rpartition(".")
    section_type = SECTION_TYPES.get(section)
    if not dataclasses.is_dataclass(section_type):
        return None
    for item in dataclasses.fields(section_type):
        if item.name == name and item.default is not dataclasses.MISSING:
            value = item.default
            return list(value) if isinstance(value, tuple) else value
    return None


def _is_safe(key: str) -> bool:
    """Each key's rule is declared with it (``about(..., resume=...)`` in
    :mod:`meshtrain.recipes.sections`); a key no section declares is refused."""
    return resume_rule(key) == "safe"


def compare_recipes(saved: Mapping[str, Any], now: Mapping[str, Any]) -> list[RecipeChange]:
    """Every key whose value differs between two recipes as read (defaults filled in)."""
    old, new = flatten_table(saved), flatten_table(now)
    changes = []
    for key in sorted(old.keys() | new.keys()):
        before = old.get(key, _default(key))
        after = new.get(key, _default(key))
        if before != after:
            changes.append(RecipeChange(key, before, after, _is_safe(key)))
    return changes


def _allows(allowed: Sequence[str], key: str) -> bool:
    return any(key == item or key.startswith(f"{item.rstrip('.')}.") for item in allowed)


def _batch_effect(change: RecipeChange, data_step: int) -> str:
    """What a new batch size does to the saved position, in samples (``""``: not that key).

    Example:
        >>> _batch_effect(RecipeChange("train.batch_size", 8, 16, safe=False), 6)
        'the position is counted in global batches: the next batch starts at sample 96 of its epoch instead of 48, so samples 48–95 are skipped'
    """
    saved, now = change.saved, change.now
    if change.key != "train.batch_size" or not isinstance(saved, int) or not isinstance(now, int):
        return ""
    before, after = data_step * saved, data_step * now
    if before == after:
        return "the data position is unchanged"
    gap = f"samples {min(before, after)}–{max(before, after) - 1}"
    what = "skipped" if after > before else "trained again"
    return (
        f"the position is counted in global batches: the next batch starts at sample {after} "
        f"of its epoch instead of {before}, so {gap} are {what}"
    )


def _effect(key: str, data_step: int) -> str:
    for prefix, text in _DATA_EFFECT.items():
        if key == prefix or (prefix.endswith(".") and key.startswith(prefix)):
            return text.format(step=data_step)
    return "the data position is unchanged"


def check_resume(
    saved: Mapping[str, Any],
    now: Mapping[str, Any],
    *,
    allowed: Sequence[str] = (),
    data_step: int = 0,
) -> ResumeCheck:
    """Compare the checkpoint's recipe with this run's: safe changes and allowed ones give a
    line each; the rest are refused (:meth:`ResumeCheck.raise_if_refused`)."""
    lines, refused = [], []
    for change in compare_recipes(saved, now):
        if change.key == "checkpoint.allow_change":
            continue
        if change.safe:
            lines.append(f"resuming with a changed {change.describe()} (safe: the same training)")
        elif _allows(allowed, change.key):
            effect = _batch_effect(change, data_step) or _effect(change.key, data_step)
            lines.append(f"resuming with a changed {change.describe()}, allowed: {effect}")
        else:
            refused.append(change)
    return ResumeCheck(tuple(lines), tuple(refused))
