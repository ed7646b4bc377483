"""The wandb sink: a wandb run under ``run_dir/wandb``, offline by default, with the plan
attached, and the credential check that ``"online"`` needs (no network, no wandb import).

    >>> check_wandb_credentials(LoggingConfig(wandb="disabled"))
"""

from __future__ import annotations

import configparser
import contextlib
import logging
import netrc
import os
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from meshtrain.errors import ConfigError, MeshtrainError
from meshtrain.files import write_text_atomically
from meshtrain.train.metrics.config import LoggingConfig
from meshtrain.train.metrics.values import (
    MetricValue,
    _is_number,
    _parse_plan_json,
    _plain_value,
    _with_newline,
    _writing,
)

_LOGGER = logging.getLogger(__name__)
#: The file in a run directory that keeps its wandb run id, so a resumed run continues that run.
WANDB_RUN_ID_FILE = "wandb_run_id"
_DEFAULT_WANDB_HOST = "https://api.wandb.ai"


class WandbSink:
    """A wandb run under ``run_dir/wandb``, offline by default, with the plan attached.

    ``start`` calls ``wandb.init(project, entity, name, dir=run_dir, mode, config)`` with the
    recipe as config and the parsed plan JSON under ``config["plan"]``, quiet (``silent``) and
    without console capture; ``plan.txt`` and ``plan.json`` are saved into the run's files. Offline
    runs need no network and no key; upload one later with ``wandb sync run_dir/wandb/offline-run-*``.
    wandb is imported here, not when meshtrain is.

    Example::

        sink = WandbSink(LoggingConfig(), run_dir="runs/debug", run_name="debug")
        sink.start(config={"train": {"lr": 1e-3}}, plan_text=plan.explain(), plan_json=plan.to_json())
    """

    def __init__(
        self, config: LoggingConfig, *, run_dir: Path | str, run_name: str, resume: bool = False
    ) -> None:
        if config.wandb == "disabled":
            raise ConfigError(
                "WandbSink was built with logging.wandb = 'disabled'; build no WandbSink for a "
                "disabled run (make_sinks leaves it out)."
            )
        if config.wandb == "online":
            check_wandb_credentials(config)
        self.config = config
        self.run_dir = Path(run_dir)
        self.run_name = run_name
        self.resume = resume
        self.run: Any = None

    def start(self, *, config: Mapping[str, object], plan_text: str, plan_json: str) -> None:
        import wandb

        if "plan" in config:
            raise ConfigError(
                "the run config already has a 'plan' key, where WandbSink puts the parsed plan "
                "JSON; rename that key in the config passed to Sinks.start."
            )
        run_config = {**config, "plan": _parse_plan_json(plan_json)}
        mode: Literal["online", "offline"] = (
            "online" if self.config.wandb == "online" else "offline"
        )
        with _writing(self.run_dir):
            self.run_dir.mkdir(parents=True, exist_ok=True)
            run_id = self._run_id()
        try:
            self.run = wandb.init(
                project=self.config.wandb_project,
                entity=self.config.wandb_entity,
                name=self.run_name,
                id=run_id,
                resume="allow",
                dir=str(self.run_dir),
                mode=mode,
                config=run_config,
                settings=wandb.Settings(silent=True, console="off"),
            )
        except Exception as error:
            raise MeshtrainError(
                f"wandb.init failed for project {self.config.wandb_project!r} in mode "
                f"{self.config.wandb!r} (run dir {self.run_dir}): {error}. Fix the wandb "
                "settings, or set logging.wandb = 'offline' to log without a server."
            ) from error
        files_dir = Path(self.run.dir)
        for name, text in (("plan.txt", plan_text), ("plan.json", plan_json)):
            # Written inside the run's files dir, so wandb saves it without linking or warning.
            (files_dir / name).write_text(_with_newline(text), encoding="utf-8")
            self.run.save(str(files_dir / name), base_path=str(files_dir), policy="now", glob=False)
        if mode == "online":  # silent hides wandb's own banner; the URL is still worth a log line
            _LOGGER.info("wandb run %s: %s", self.run_name, self.run.url)

    def _run_id(self) -> str:
        """The wandb run id of this run directory (``WANDB_RUN_ID_FILE`` in it): kept when the
        run resumes, a new one for a fresh start."""
        path = self.run_dir / WANDB_RUN_ID_FILE
        if self.resume and path.is_file():
            run_id = path.read_text(encoding="utf-8").strip()
            if run_id:
                return run_id
        run_id = uuid.uuid4().hex[:12]
        write_text_atomically(path, run_id + "\n")
        return run_id

    def log(self, step: int, metrics: Mapping[str, MetricValue]) -> None:
        if self.run is None:
            return
        numbers = {key: value for key, value in metrics.items() if _is_number(value)}
        self.run.log({key: _plain_value(key, value) for key, value in numbers.items()}, step=step)

    def close(self, *, failed: bool = False) -> None:
        if self.run is None:
            return
        run, self.run = self.run, None
        run.finish(exit_code=1 if failed else 0)
        if self.config.wandb == "offline":
            sync_dir = run.settings.sync_dir
            _LOGGER.info(
                "wandb offline run in %s; upload it with `wandb sync %s`", sync_dir, sync_dir
            )

    def abandon(self) -> None:
        """Drop the run after a failure (the service gone): wandb's teardown, whose errors are
        the dead service's, so that nothing waits on it at exit."""
        self.run = None
        import wandb

        with contextlib.suppress(Exception):
            wandb.teardown()

    @property
    def sync_dir(self) -> Path | None:
        """The run's directory (``run_dir/wandb/offline-run-…``) while the run is open."""
        return None if self.run is None else Path(self.run.settings.sync_dir)


def check_wandb_credentials(config: LoggingConfig) -> None:
    """Raise :class:`~meshtrain.errors.ConfigError` when wandb ``"online"`` has no credentials to log in with.

    Looks, without importing wandb or touching the network, where wandb looks: the
    ``WANDB_API_KEY`` and ``WANDB_IDENTITY_TOKEN_FILE`` variables, then a netrc entry (what
    ``wandb login`` writes) for the server's host. A key that the server would reject is not
    caught here; ``wandb.init`` reports it.

    Example:
        >>> check_wandb_credentials(LoggingConfig(wandb="offline"))  # offline needs nothing
    """
    if config.wandb != "online":
        return
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return
    host = urlsplit(_wandb_base_url()).netloc
    if host and _netrc_has_password(host):
        return
    raise ConfigError(
        f"logging.wandb = 'online' for project {config.wandb_project!r}, but no wandb "
        f"credentials were found (no WANDB_API_KEY and no netrc entry for {host!r}). Set "
        "WANDB_API_KEY, run `wandb login` on every node, or set logging.wandb = 'offline' and "
        "upload later with `wandb sync`."
    )


def _wandb_base_url() -> str:
    if url := os.environ.get("WANDB_BASE_URL"):
        return url
    config_dir = os.environ.get("WANDB_CONFIG_DIR") or os.path.expanduser("~/.config/wandb")
    settings = configparser.ConfigParser()
    try:
        settings.read(os.path.join(config_dir, "settings"))
    except configparser.Error:
        return _DEFAULT_WANDB_HOST
    return settings.get("default", "base_url", fallback=_DEFAULT_WANDB_HOST)


def _netrc_has_password(host: str) -> bool:
    """Whether the netrc file wandb reads (``$NETRC``, else ``~/.netrc`` or ``~/_netrc``) has a
    password for ``host``."""
    if explicit := os.environ.get("NETRC"):
        candidates = [Path(explicit).expanduser()]
    else:
        candidates = [Path("~/.netrc").expanduser(), Path("~/_netrc").expanduser()]
    path = next((candidate for candidate in candidates if candidate.is_file()), None)
    if path is None:
        return False
    try:
        entry = netrc.netrc(path).authenticators(host)
    except (netrc.NetrcParseError, OSError):
        return False
    return bool(entry and entry[2])
