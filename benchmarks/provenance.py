"""Where a benchmark's figures come from: the commit, the date and the machine, for its JSON.

Example:
    >>> sorted(provenance())
    ['commit', 'date', 'machine', 'torch']
"""

from __future__ import annotations

import platform
import subprocess
import time

import torch


def commit() -> str:
    """The checked-out commit (short hash), or "unknown" outside a git checkout."""
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def provenance() -> dict[str, str]:
    """Commit, date, machine (architecture and torch's CPU threads) and torch version."""
    return {
        "commit": commit(),
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads",
        "torch": torch.__version__,
    }
