"""The one exception hierarchy of meshtrain.

Every error is raised while planning, identically on every rank, before any collective, so a
misconfiguration never turns into a hang. Messages name what broke (parameter FQN, rule, spec,
shape, mesh), the context, and the fix, in the style of JAX's sharding errors::

    SpecError: parameter 'layers.3.mlp.w1.weight' (shape 1000×512) cannot take P('tp', None)
    on mesh {dp: 2, tp: 3}: dim 0 (1000) is not divisible by tp=3. Use a tp size that divides
    1000, shard another dim, or pad the parameter to a multiple of 3.

The structured fields (``fqn``, ``spec``, ``shape``, ``mesh``, ``rule``) are kept on the exception
so tools can act on them without parsing the message.
"""

from __future__ import annotations

import difflib
import errno
from collections.abc import Sequence
from typing import Any


class MeshtrainError(Exception):
    """Root of every error meshtrain raises on purpose.

    Example:
        >>> try:
        ...     raise SpecError("bad spec")
        ... except MeshtrainError as err:
        ...     print(type(err).__name__)
        SpecError
    """

    def __init__(
        self,
        message: str,
        *,
        fqn: str | None = None,
        spec: Any = None,
        shape: Sequence[int] | None = None,
        mesh: Any = None,
        rule: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.fqn = fqn
        self.spec = spec
        self.shape = tuple(shape) if shape is not None else None
        self.mesh = mesh
        self.rule = rule


class SpecError(MeshtrainError):
    """A partition spec that cannot describe a tensor's layout on a mesh."""


class MeshError(MeshtrainError):
    """A mesh that cannot be built: bad axis names or sizes, or a product that is not the world."""


class RuleError(MeshtrainError):
    """Rules that do not map parameters to specs: unmatched parameters, unused or conflicting rules."""


class PlanError(MeshtrainError):
    """A plan that cannot be built or lowered for this model and mesh."""


class EquivalenceError(MeshtrainError):
    """A distributed run that does not match the single-device reference within its contract.

    ``report`` is the harness's :class:`~meshtrain.testing.EquivalenceReport` (when it raised).
    """

    report: Any = None


class CheckpointError(MeshtrainError):
    """A checkpoint that cannot be saved, found, trusted or resharded."""


class RecipeError(MeshtrainError):
    """A recipe with an unknown key, a wrong type or an impossible combination."""


class DeepSpeedConfigError(RecipeError):
    """A DeepSpeed config with keys that have no meshtrain equivalent, each named with the reason
    (``meshtrain recipe from-deepspeed``; :mod:`meshtrain.recipes.deepspeed`)."""


class DataError(MeshtrainError):
    """A corpus, tokenizer, token file, dataset or sampler that cannot be used as asked."""


class TrainingError(MeshtrainError):
    """A run that must stop: a non-finite loss or gradient under ``on_nonfinite="stop"``, ranks
    that disagree on their plan, a state that does not belong to the train step."""


class ReplicaDriftError(TrainingError):
    """Copies of a replicated parameter or optimizer state that are no longer bitwise identical
    (``[train] verify_every``; :func:`meshtrain.train.replicas.verify_replicas`)."""


class ConfigError(MeshtrainError):
    """A runtime configuration built with a value it cannot take (a ``LoggingConfig`` with an
    unknown wandb mode, say); a recipe's values are checked earlier, as :class:`RecipeError`."""


class GraphBreakWarning(UserWarning):
    """``torch.compile`` split a compiled region into several graphs (count and reasons given)."""


def format_shape(shape: Sequence[int]) -> str:
    """Render a shape the way error messages show it.

    Example:
        >>> format_shape((1000, 512))
        '1000×512'
        >>> format_shape(())
        'scalar'
    """
    return "×".join(str(int(size)) for size in shape) if len(shape) else "scalar"


def did_you_mean(name: str, choices: Sequence[str], what: str) -> str:
    """A parenthesised hint naming the closest choice and listing all of them.

    Example:
        >>> did_you_mean("tpp", ("dp", "tp"), "axes")
        " (did you mean 'tp'? axes: 'dp', 'tp')"
    """
    close = difflib.get_close_matches(name, list(choices), n=1)
    known = ", ".join(repr(choice) for choice in choices) or "none"
    return f" (did you mean '{close[0]}'? {what}: {known})" if close else f" ({what}: {known})"


def describe_os_error(err: OSError) -> str:
    """An OS error in a few words, naming the file, with the usual fix for permissions, a
    read-only filesystem or a full disk.

    Example:
        >>> import errno
        >>> describe_os_error(PermissionError(errno.EACCES, "Permission denied", "runs/x"))
        "Permission denied ('runs/x'); fix its permissions or choose another directory"
    """
    fixes = {
        errno.EACCES: "fix its permissions or choose another directory",
        errno.EPERM: "fix its permissions or choose another directory",
        errno.EROFS: "the filesystem is read-only: choose a directory on a writable one",
        errno.ENOSPC: "the disk is full: free space or choose another directory",
        errno.EDQUOT: "the disk quota is spent: free space or choose another directory",
    }
    reason = err.strerror or str(err)
    where = f" ({str(err.filename)!r})" if err.filename else ""
    fix = fixes.get(err.errno or 0)
    return f"{reason}{where}" + (f"; {fix}" if fix else "")
