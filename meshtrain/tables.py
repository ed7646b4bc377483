"""Nested tables (TOML recipes, JSON configs) as dotted keys, and values as TOML writes them:
the one flattener and the one TOML value writer of meshtrain (imports nothing of meshtrain's, so
every layer may use it).

Example:
    >>> flatten_table({"parallel": {"zero": 3, "pipeline": {"axis": "pp"}}})
    {'parallel.zero': 3, 'parallel.pipeline.axis': 'pp'}
    >>> toml_value(["dp", "tp"]), toml_value(True), toml_value(float("inf"))
    ('["dp", "tp"]', 'true', 'inf')
"""

from __future__ import annotations

import json
import math
from collections.abc import Collection, Mapping
from typing import Any


def flatten_table(
    table: Mapping[str, Any], prefix: str = "", keep: Collection[str] = ()
) -> dict[str, Any]:
    """Dotted key → value of every leaf, tuples as lists. A table whose dotted key is in ``keep``
    is flattened one level only (its entries stay whole values)."""
    flat: dict[str, Any] = {}
    for key, value in table.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping) and dotted in keep:
            flat.update((f"{dotted}.{name}", inner) for name, inner in value.items())
        elif isinstance(value, Mapping):
            flat.update(flatten_table(value, f"{dotted}.", keep))
        else:
            flat[dotted] = list(value) if isinstance(value, tuple) else value
    return flat


def toml_value(value: Any) -> str:
    """``value`` as a TOML recipe writes it: strings quoted, booleans ``true``/``false``,
    arrays in brackets, infinities and NaN as TOML spells them."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml_value(item) for item in value) + "]"
    return json.dumps(value, default=str, ensure_ascii=False)
