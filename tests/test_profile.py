"""``[profile]``: a trace of exactly the chosen steps, a summary that counts collective time by
kind, nothing recorded outside the window, and nothing built when profiling is off."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from meshtrain.train.profiling import StepProfiler


@pytest.fixture
def one_rank_group() -> object:
    """A gloo group of one rank, so a collective runs without other processes."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield None
    dist.destroy_process_group()


def _steps(profiler: StepProfiler | None, count: int, collective: bool) -> None:
    model = torch.nn.Linear(32, 32)
    for step in range(1, count + 1):
        if profiler is not None:
            profiler.before(step)
        with torch.profiler.record_function(f"test_step_{step}"):
            model(torch.randn(4, 32)).sum().backward()
            if collective:
                dist.all_reduce(model.weight.grad)
        if profiler is not None:
            profiler.after(step)


def test_the_trace_holds_exactly_the_chosen_steps(tmp_path: Path, one_rank_group: object) -> None:
    profiler = StepProfiler((2, 3), tmp_path, rank=0)
    _steps(profiler, 5, collective=True)
    trace = json.loads((tmp_path / "trace_rank0.json").read_text())
    names = {event.get("name") for event in trace["traceEvents"]}
    assert {"test_step_2", "test_step_3"} <= names
    assert not names & {"test_step_1", "test_step_4", "test_step_5"}
    assert profiler.summary is not None and profiler.summary.steps == 2
    assert profiler.summary.collective_s["all_reduce"] > 0
    table = (tmp_path / "summary_rank0.txt").read_text()
    assert table.splitlines()[0].startswith("per step over 2 steps") and "all_reduce" in table


def test_a_run_ending_inside_the_window_still_writes(tmp_path: Path) -> None:
    profiler = StepProfiler((2, 10), tmp_path, rank=3)
    _steps(profiler, 4, collective=False)
    profiler.close()
    assert (tmp_path / "trace_rank3.json").is_file()
    assert profiler.summary is not None and profiler.summary.steps == 3


def test_nothing_is_profiled_outside_the_window_or_when_off(tmp_path: Path) -> None:
    with mock.patch("torch.profiler.profile", side_effect=AssertionError("profiled")):
        _steps(StepProfiler((7, 8), tmp_path, rank=0), 4, collective=False)  # window not reached
        _steps(None, 4, collective=False)  # off: no profiler at all
    assert not list(tmp_path.iterdir())


def test_a_window_that_is_not_first_to_last_is_refused() -> None:
    from meshtrain.errors import TrainingError

    with pytest.raises(TrainingError, match=r"profile.steps = \[5, 3\] must be \[first, last\]"):
        StepProfiler((5, 3), Path("unused"), rank=0)
