"""What a run logs and where: :class:`LoggingConfig`.

>>> LoggingConfig(wandb="offline", log_every=10).log_every
10
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from meshtrain.errors import ConfigError

#: wandb's modes: ``offline`` writes the run locally, ``online`` streams it, ``disabled`` nothing.
WandbMode = Literal["offline", "online", "disabled"]
WANDB_MODES: tuple[WandbMode, ...] = get_args(WandbMode)


@dataclass(frozen=True)
class LoggingConfig:
    """Which sinks a run logs to; checked on construction (a :class:`~meshtrain.errors.ConfigError`
    when built from Python with a value it cannot take; a recipe's ``[logging]`` is checked
    before, by the recipe's schema).

    ``wandb`` is ``"offline"`` by default: the run is written under ``run_dir/wandb`` with no
    network and no API key, and ``wandb sync`` uploads it later. ``"online"`` streams to the
    server and needs credentials (``WANDB_API_KEY`` or ``wandb login``); ``"disabled"`` writes
    nothing. Sinks log every ``log_every``-th step, plus the first and the last.

    Example:
        >>> LoggingConfig(wandb="on")
        Traceback (most recent call last):
        ...
        meshtrain.errors.ConfigError: LoggingConfig(wandb='on'): not a wandb mode; use one of 'offline', 'online', 'disabled'.
    """

    console: bool = True
    jsonl: bool = True
    wandb: WandbMode = "offline"
    wandb_project: str = "meshtrain"
    wandb_entity: str | None = None
    log_every: int = 1

    def __post_init__(self) -> None:
        if self.wandb not in WANDB_MODES:
            choices = ", ".join(repr(mode) for mode in WANDB_MODES)
            raise ConfigError(
                f"LoggingConfig(wandb={self.wandb!r}): not a wandb mode; use one of {choices}."
            )
        if isinstance(self.log_every, bool) or not isinstance(self.log_every, int):
            raise ConfigError(
                f"LoggingConfig(log_every={self.log_every!r}): give a positive integer (log "
                "every N-th step), e.g. log_every=10."
            )
        if self.log_every < 1:
            raise ConfigError(
                f"LoggingConfig(log_every={self.log_every}): give 1 or more (1 logs every step)."
            )
        if not self.wandb_project:
            raise ConfigError(
                "LoggingConfig(wandb_project=''): name the wandb project, e.g. "
                'wandb_project="meshtrain".'
            )
