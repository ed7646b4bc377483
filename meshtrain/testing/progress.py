"""Progress of a long equivalence check, from the ranks to the caller: rank 0 appends a line per
step to a file, and the caller passes each new line on while it waits for the ranks.

Example:
    >>> import tempfile
    >>> lines = []
    >>> with tempfile.TemporaryDirectory() as root:
    ...     steps = StepLines(f"{root}/progress.txt")
    ...     relayed(lambda: steps.say("step 1/1 compared") or 42, lines.append, steps.path)
    42
    >>> lines
    ['step 1/1 compared']
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class StepLines:
    """Where a rank writes its progress lines (picklable: it travels to the ranks)."""

    path: str

    def say(self, line: str) -> None:
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(line + "\n")


def relayed(
    work: Callable[[], T], say: Callable[[str], None], path: str, every_s: float = 0.5
) -> T:
    """``work()`` run in a thread; meanwhile, and once more when it ends, each new line of the
    file at ``path`` passed to ``say``. Returns what ``work`` returns, raises what it raises."""
    outcome: dict[str, object] = {}

    def run() -> None:
        try:
            outcome["value"] = work()
        except BaseException as error:  # re-raised in the caller's thread
            outcome["error"] = error

    thread = threading.Thread(target=run, name="meshtrain-check", daemon=True)
    thread.start()
    seen = 0
    while True:
        thread.join(every_s)
        seen = _pass_on(Path(path), seen, say)
        if not thread.is_alive():
            break
    if "error" in outcome:
        raise outcome["error"]  # type: ignore[misc]
    return outcome["value"]  # type: ignore[return-value]


def _pass_on(path: Path, seen: int, say: Callable[[str], None]) -> int:
    """Pass on the lines after the first ``seen``; return how many there are now."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError:
        return seen
    lines = text[: text.rfind("\n") + 1].splitlines()  # whole lines only: one may be half written
    for line in lines[seen:]:
        say(line)
    return len(lines)
