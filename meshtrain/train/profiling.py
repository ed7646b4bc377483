"""``[profile]``: a ``torch.profiler`` trace of chosen steps on every rank, a CUDA memory snapshot
on GPUs, and a table of compute against each collective's time per step.

Why: where a step's time goes (matmuls, or waiting for an all-gather) decides what to change in
a plan, and a user should not have to edit the train loop to find out. The profiler runs only
over steps ``first..last``; a run without ``[profile]`` never builds a :class:`StepProfiler`
(nothing is imported or recorded: zero cost when off).

Files, in ``<run_dir>/profile``: ``trace_rank{r}.json`` (Chrome trace format: open it in
https://ui.perfetto.dev or ``chrome://tracing``; TensorBoard's profile plugin reads it too),
``memory_rank{r}.pickle`` on CUDA (drag it into https://pytorch.org/memory_viz) and
``summary_rank{r}.txt``, the table :func:`summary_table` prints: per step, the wall time, the
time inside each kind of collective call (CPU time of the c10d operations and their waits; on
CUDA the NCCL kernels' device time) and the rest, which is compute and everything else.

Example::

    profiler = StepProfiler((3, 5), Path("runs/debug/profile"), rank=0)
    for step in range(1, 7):
        profiler.before(step)
        ...  # the step
        profiler.after(step)
    profiler.close()
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from meshtrain.errors import TrainingError
from meshtrain.files import write_text_atomically

__all__ = ["COLLECTIVE_KINDS", "ProfileSummary", "StepProfiler", "summary_table"]

#: Each kind of collective and the substrings of the profiler event names that are one.
COLLECTIVE_KINDS: dict[str, tuple[str, ...]] = {
    "all_gather": ("allgather", "all_gather"),
    "reduce_scatter": ("reduce_scatter", "reducescatter"),
    "all_reduce": ("allreduce", "all_reduce"),
    "broadcast": ("broadcast",),
    "all_to_all": ("alltoall", "all_to_all"),
    "send/recv": ("send", "recv"),
    "wait": ("wait_tensor",),
}
_OPERATOR_PREFIXES = ("c10d::", "_c10d_functional::", "c10d_functional::")


@dataclass(frozen=True)
class ProfileSummary:
    """Per profiled step: the wall time, and seconds inside each kind of collective."""

    steps: int
    wall_s: float
    collective_s: dict[str, float]

    @property
    def compute_s(self) -> float:
        return max(0.0, self.wall_s - sum(self.collective_s.values()))


def summary_table(summary: ProfileSummary) -> str:
    """The summary as a text table (milliseconds per step).

    Example:
        >>> print(summary_table(ProfileSummary(2, 0.5, {"all_gather": 0.1})))
        per step over 2 steps      ms  share
        wall                    250.0   100%
        compute and other       200.0    80%
        all_gather               50.0    20%
    """
    per_step = summary.wall_s / summary.steps * 1e3
    rows = [("wall", per_step), ("compute and other", summary.compute_s / summary.steps * 1e3)]
    rows += [
        (kind, seconds / summary.steps * 1e3)
        for kind, seconds in summary.collective_s.items()
        if seconds > 0
    ]
    lines = [f"{f'per step over {summary.steps} steps':<22}{'ms':>7}  share"]
    for name, value in rows:
        share = value / per_step if per_step else 0.0
        lines.append(f"{name:<22}{value:>7.1f}  {share:>5.0%}")
    return "\n".join(lines)


class StepProfiler:
    """Profiles steps ``first..last`` (inclusive) on this rank; see the module docstring."""

    def __init__(
        self, steps: Sequence[int], out_dir: Path, *, rank: int, memory: bool = True
    ) -> None:
        if len(steps) != 2 or not 1 <= steps[0] <= steps[1]:
            raise TrainingError(
                f"profile.steps = {list(steps)} must be [first, last] with 1 <= first <= last "
                "(e.g. [3, 5]: skip the first steps' warm-up)."
            )
        self.first, self.last = int(steps[0]), int(steps[1])
        self.out_dir, self.rank = out_dir, rank
        self.memory = memory and torch.cuda.is_available()
        self._profile: Any = None
        self._started = 0.0
        self._steps = 0
        self.summary: ProfileSummary | None = None

    def before(self, step: int) -> None:
        """Call before training step ``step`` (1-based)."""
        if step == self.first and self._profile is None:
            self._start()

    def after(self, step: int) -> None:
        """Call after step ``step``; the last profiled step writes the files."""
        if self._profile is not None:
            self._steps += 1
            if step >= self.last:
                self.close()

    def close(self) -> None:
        """Stop and write, if profiling (a run that ends inside the window still writes)."""
        if self._profile is None:
            return
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall = time.perf_counter() - self._started
        with warnings.catch_warnings():  # torch 2.11 notes that a stopped profile keeps one cycle
            warnings.filterwarnings("ignore", message=".*Profiler clears events")
            self._profile.stop()
            self.out_dir.mkdir(parents=True, exist_ok=True)
            self._profile.export_chrome_trace(str(self.out_dir / f"trace_rank{self.rank}.json"))
            collectives = _collective_seconds(self._profile)
        if self.memory:
            path = self.out_dir / f"memory_rank{self.rank}.pickle"
            torch.cuda.memory._dump_snapshot(str(path))
            torch.cuda.memory._record_memory_history(enabled=None)
        self.summary = ProfileSummary(max(self._steps, 1), wall, collectives)
        text = summary_table(self.summary) + "\n"
        write_text_atomically(self.out_dir / f"summary_rank{self.rank}.txt", text)
        self._profile = None

    def _start(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        if self.memory:
            torch.cuda.memory._record_memory_history(max_entries=100_000)
        self._profile = profile(activities=activities)
        self._profile.start()
        self._started = time.perf_counter()


def _collective_seconds(profile: Any) -> dict[str, float]:
    """Seconds in each kind of collective: CPU time of the c10d operators (and their waits),
    or the device time of NCCL kernels where there are any."""
    totals = dict.fromkeys(COLLECTIVE_KINDS, 0.0)
    device = dict.fromkeys(COLLECTIVE_KINDS, 0.0)
    for event in profile.key_averages():
        name = event.key.lower()
        kind = next(
            (
                kind
                for kind, parts in COLLECTIVE_KINDS.items()
                if any(part in name for part in parts)
            ),
            None,
        )
        if kind is None:
            continue
        if event.key.startswith(_OPERATOR_PREFIXES):
            totals[kind] += event.cpu_time_total / 1e6
        elif "nccl" in name:
            device[kind] += getattr(event, "device_time_total", 0.0) / 1e6
    return device if any(device.values()) else totals
