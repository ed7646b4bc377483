"""Small helpers the metrics sinks share: writing into the run directory with errors that name
the path, and turning metric values into plain JSON numbers.

    >>> _plain_value("loss", 2.5)
    2.5
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from meshtrain.errors import ConfigError, MeshtrainError, describe_os_error

#: One step's metric as the sinks take it: a number (ints and bools are numbers here), or a line
#: of text (the MoE routers' token counts per expert).
MetricValue = float | str


def _parse_plan_json(plan_json: str) -> Any:
    try:
        return json.loads(plan_json)
    except (TypeError, json.JSONDecodeError) as error:
        raise MeshtrainError(
            f"plan_json passed to Sinks.start is not JSON ({error}); pass plan.to_json()."
        ) from error


@contextlib.contextmanager
def _writing(path: Path) -> Iterator[None]:
    """OS errors while writing the run directory (permissions, a read-only filesystem, a full
    disk) become a :class:`~meshtrain.errors.ConfigError` naming the path and ``logging.run_dir``."""
    try:
        yield
    except OSError as err:
        raise ConfigError(
            f"cannot write {str(path)!r}: {describe_os_error(err)} (logging.run_dir sets the run "
            "directory)."
        ) from None


def _with_newline(text: str) -> str:
    return text if text.endswith("\n") else text + "\n"


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) or (hasattr(value, "item") and _size(value) == 1)


def _size(value: Any) -> int:
    size = getattr(value, "size", None)
    if callable(size):  # torch tensors: .size() is the shape
        return math.prod(value.shape)
    return int(size) if size is not None else 1


def _plain_value(key: str, value: Any) -> Any:
    """JSON-ready value: tensors and numpy scalars of one element become Python numbers."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if hasattr(value, "item") and _size(value) == 1:
        return value.item()
    raise MeshtrainError(
        f"metric {key!r} is a {type(value).__name__}, which a metrics sink cannot record; "
        "pass numbers (call .item() on one-element tensors) or strings."
    )
