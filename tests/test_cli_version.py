"""``meshtrain --version`` prints the installed package's version and exits 0."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib.metadata import version

import meshtrain


def test_version_prints_the_package_version() -> None:
    process = subprocess.run(
        [sys.executable, "-m", "meshtrain", "--version"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert process.returncode == 0, process.stderr
    assert process.stdout == f"meshtrain {version('meshtrain')}\n"
    assert version("meshtrain") == meshtrain.__version__
