"""What a run logs and where: :class:`LoggingConfig`.

>>> LoggingConfig(wandb="offline", log_every=10).log_every
10
"""

from __future__ import annotations

from dataclasses import dataclass

from meshtrain.errors import RecipeError

WANDB_MODES = ("offline", "online", "disabled")


@dataclass(frozen=True)
class LoggingConfig:
    """Which sinks a run logs to; checked on construction.

    ``wandb`` is ``"offline"`` by default: the run is written under ``run_dir/wandb`` with no
    network and no API key, and ``wandb sync`` uploads it later. ``"online"`` streams to the
    server and needs credentials (``WANDB_API_KEY`` or ``wandb login``); ``"disabled"`` writes
    nothing. Sinks log every ``log_every``-th step, plus the first and the last.

    Example:
        >>> LoggingConfig(wandb="on")
        Traceback (most recent call last):
        ...
        meshtrain.errors.RecipeError: logging.wandb = 'on' is not a wandb mode; use one of 'offline', 'online', 'disabled'.
    """

    console: bool = True
    jsonl: bool = True
    wandb: str = "offline"
    wandb_project: str = "meshtrain"
    wandb_entity: str | None = None
    log_every: int = 1

    def __post_init__(self) -> None:
        if self.wandb not in WANDB_MODES:
            choices = ", ".join(repr(mode) for mode in WANDB_MODES)
            raise RecipeError(
                f"logging.wandb = {self.wandb!r} is not a wandb mode; use one of {choices}."
            )
        if isinstance(self.log_every, bool) or not isinstance(self.log_every, int):
            raise RecipeError(
                f"logging.log_every = {self.log_every!r} must be a positive integer "
                "(log every N-th step), e.g. log_every = 10."
            )
        if self.log_every < 1:
            raise RecipeError(
                f"logging.log_every = {self.log_every} must be >= 1 (1 logs every step)."
            )
        if not self.wandb_project:
            raise RecipeError(
                "logging.wandb_project is empty; name the wandb project, e.g. "
                'wandb_project = "meshtrain".'
            )
