"""Sizes in bytes as people write them: ``"80GiB"`` in, ``"1.50 GiB"`` out.

Example:
    >>> format_bytes(parse_bytes("1.5GiB"))
    '1.50 GiB'
"""

from __future__ import annotations

import math

from meshtrain.errors import PlanError

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
GiB = 2**30


def parse_bytes(text: str | int | float) -> int:
    """``"80GiB"``, ``"80 GB"``, ``"1.5TiB"`` or a number of bytes → bytes.

    Example:
        >>> parse_bytes("80GiB"), parse_bytes("80GB")
        (85899345920, 80000000000)
    """
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value, unit = float(text), ""
    else:
        cleaned = str(text).strip().lower().replace(" ", "")
        number = cleaned.rstrip("abcdefghijklmnopqrstuvwxyz")
        value, unit = (float(number) if number else -1.0), cleaned[len(number) :]
    if unit not in _UNITS or value <= 0 or not math.isfinite(value):
        raise PlanError(
            f"device memory {text!r} is not a size: give a positive number with a unit such as "
            "80GiB, 80GB, 512MiB (or plain bytes)."
        )
    return int(value * _UNITS[unit])


def format_bytes(value: int, unit: str | None = None) -> str:
    """``value`` bytes in ``unit`` ("GiB", "MiB", "KiB", "B"), or the largest unit it reaches.

    Example:
        >>> format_bytes(3 * 2**29), format_bytes(2**20, "GiB")
        ('1.50 GiB', '0.00 GiB')
    """
    scales = {"GiB": GiB, "MiB": 2**20, "KiB": 2**10}
    if unit is None:
        unit = next((name for name, scale in scales.items() if value >= scale), "B")
    return f"{value} B" if unit == "B" else f"{value / scales[unit]:,.2f} {unit}"
