"""The SPMD runner: real gloo ranks kept warm across tasks, with timeouts and restarts.

Every task function sits at module level: the runner pickles tasks by reference, and the ranks
import this module through the ``sys.path`` the parent sends with each task.
"""

from __future__ import annotations

import atexit
import os
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from meshtrain.errors import MeshtrainError
from meshtrain.testing.runner import (
    SPMDError,
    SPMDPool,
    SPMDTaskError,
    SPMDTimeoutError,
    get_pool,
    shared_pool_stats,
)

pytestmark = pytest.mark.spmd

# ---------------------------------------------------------------- tasks (run on the ranks)


def _all_reduce_rank() -> tuple[int, int, float]:
    value = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(value)
    return dist.get_rank(), dist.get_world_size(), value.item()


def _scaled_sum(values: list[float], *, scale: float) -> torch.Tensor:
    tensor = torch.tensor(values, dtype=torch.float64) * scale
    dist.all_reduce(tensor)
    return tensor


def _raise_on_rank(bad_rank: int, message: str) -> int:
    if dist.get_rank() == bad_rank:
        raise ValueError(message)
    dist.all_reduce(torch.zeros(1))  # the others block here: the bad rank never joins
    return dist.get_rank()


def _exit_on_rank(bad_rank: int) -> int:
    if dist.get_rank() == bad_rank:
        os._exit(7)
    return dist.get_rank()


def _rank0_skips_collective() -> int:
    if dist.get_rank() != 0:
        dist.all_reduce(torch.ones(1))  # hangs forever: rank 0 never enters it
    return dist.get_rank()


def _warn_on_rank(warn_rank: int, message: str) -> int:
    if dist.get_rank() == warn_rank:
        for _ in range(3):  # repeats of one warning come back once
            warnings.warn(message, RuntimeWarning, stacklevel=1)
    return dist.get_rank()


def _torchrun_env() -> dict[str, str]:
    print(f"hello from rank {dist.get_rank()}")
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    return {key: os.environ[key] for key in keys} | {"dist_rank": str(dist.get_rank())}


def _write_at_exit(directory: str) -> int:
    path = Path(directory) / f"exited-{dist.get_rank()}"
    atexit.register(path.write_text, "bye")  # like coverage.py saving its data
    return os.getpid()


def _echo_kwargs(**kwargs: object) -> dict[str, object]:
    return kwargs


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def private_pool() -> Iterator[SPMDPool]:
    """A pool the failure tests may break without slowing down the shared ones."""
    with SPMDPool(2, timeout_s=60.0) as pool:
        yield pool


def _process_gone(pid: int) -> bool:
    """True once ``pid`` is reaped: a zombie still has a /proc entry, and answers signal 0."""
    if Path("/proc").is_dir():
        return not Path(f"/proc/{pid}").exists()
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


# ---------------------------------------------------------------- tests


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_all_reduce_returns_results_in_rank_order(world_size: int) -> None:
    results = get_pool(world_size).run(_all_reduce_rank)
    expected_sum = float(world_size * (world_size + 1) // 2)
    assert results == [(rank, world_size, expected_sum) for rank in range(world_size)]


def test_pool_is_reused_across_tasks() -> None:
    pool = get_pool(2)
    pool.start()
    before = pool.stats
    began = time.perf_counter()
    for step in range(20):
        out = pool.run(_scaled_sum, [1.0, float(step)], scale=0.5)
        assert [t.tolist() for t in out] == [[1.0, float(step)]] * 2
    mean_s = (time.perf_counter() - began) / 20
    print(f"world 2: start {before.last_start_s:.2f} s, mean task latency {mean_s * 1e3:.2f} ms")
    assert pool.stats.starts == before.starts
    assert pool.stats.tasks_run == before.tasks_run + 20
    assert mean_s < 1.0  # a process launch per task costs seconds
    assert get_pool(2) is pool
    assert shared_pool_stats()[2] == pool.stats  # what tests/conftest.py reports at the end


@settings(max_examples=25, deadline=None)
@given(values=st.lists(st.floats(-1e3, 1e3), min_size=1, max_size=8))
def test_hypothesis_examples_share_one_pool(values: list[float]) -> None:
    pool = get_pool(2)
    starts = pool.stats.starts
    out = pool.run(_scaled_sum, values, scale=1.0)
    expected = torch.tensor(values, dtype=torch.float64) * 2
    for tensor in out:
        torch.testing.assert_close(tensor, expected)
    assert pool.stats.starts == max(starts, 1)


def test_user_kwargs_named_like_runner_options_pass_through() -> None:
    out = get_pool(1).run(_echo_kwargs, timeout_s=3, fn="f", _timeout_s=30.0)
    assert out == [{"timeout_s": 3, "fn": "f"}]


def test_rank_exception_names_rank_and_pool_restarts(private_pool: SPMDPool) -> None:
    private_pool.start()
    starts = private_pool.stats.starts
    began = time.perf_counter()
    with pytest.raises(SPMDTaskError) as excinfo:
        private_pool.run(_raise_on_rank, 1, "boom from rank one")
    elapsed = time.perf_counter() - began
    err = excinfo.value
    assert set(err.failures) == {1}
    assert "ValueError: boom from rank one" in err.failures[1]
    assert "raise ValueError(message)" in err.failures[1]  # the remote traceback
    message = str(err)
    assert "rank 1" in message and "boom from rank one" in message
    assert "_raise_on_rank" in message and "--- rank 1 log" in message
    assert "ranks [0] had not answered" in message  # rank 0 was left blocked in all_reduce
    assert isinstance(err, SPMDError) and isinstance(err, MeshtrainError)
    assert elapsed < 30.0  # the grace period, not the 60 s task timeout
    assert private_pool.run(_all_reduce_rank) == [(0, 2, 3.0), (1, 2, 3.0)]
    assert private_pool.stats.starts == starts + 1


def test_dead_rank_is_a_task_error(private_pool: SPMDPool) -> None:
    with pytest.raises(SPMDTaskError, match=r"exit code 7") as excinfo:
        private_pool.run(_exit_on_rank, 0)
    assert 0 in excinfo.value.failures
    assert private_pool.run(_exit_on_rank, 5) == [0, 1]


def test_mismatched_collective_times_out_and_pool_recovers(private_pool: SPMDPool) -> None:
    private_pool.start()
    starts = private_pool.stats.starts
    began = time.perf_counter()
    with pytest.raises(SPMDTimeoutError) as excinfo:
        private_pool.run(_rank0_skips_collective, _timeout_s=3.0)
    elapsed = time.perf_counter() - began
    assert 3.0 <= elapsed < 10.0
    err = excinfo.value
    assert err.pending == (1,)
    assert "_rank0_skips_collective" in str(err) and "3 s" in str(err)
    assert "rank 1 log" in str(err)
    assert private_pool.run(_all_reduce_rank) == [(0, 2, 3.0), (1, 2, 3.0)]
    assert private_pool.stats.starts == starts + 1


def test_unpicklable_tasks_are_refused_before_spawning() -> None:
    def local_task() -> int:
        return 1

    pool = SPMDPool(2)
    for task in (lambda: 1, local_task):
        with pytest.raises(SPMDError, match="module level"):
            pool.run(task)
    with pytest.raises(SPMDError, match="arguments"):
        pool.run(_echo_kwargs, lock=__import__("threading").Lock())
    assert pool.stats.starts == 0
    pool.close()


def test_rank_warnings_are_reissued_in_the_parent() -> None:
    pool = get_pool(2)
    with pytest.warns(RuntimeWarning, match=r"^\[rank 1\] mind the gap$") as record:
        assert pool.run(_warn_on_rank, 1, "mind the gap") == [0, 1]
    assert len(record) == 1
    starts = pool.stats.starts
    with warnings.catch_warnings(), pytest.raises(RuntimeWarning, match=r"\[rank 0\] strict"):
        warnings.simplefilter("error")  # what filterwarnings = error does to a test
        pool.run(_warn_on_rank, 0, "strict")
    assert pool.stats.starts == starts  # a warning is not a failure


def test_ranks_see_a_torchrun_environment_and_log_to_files() -> None:
    pool = get_pool(2)
    envs = pool.run(_torchrun_env)
    for rank, env in enumerate(envs):
        assert env["RANK"] == env["LOCAL_RANK"] == env["dist_rank"] == str(rank)
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == "2"
        assert env["MASTER_ADDR"] == "127.0.0.1"
        assert 0 < int(env["MASTER_PORT"]) < 65536
        assert f"hello from rank {rank}" in pool.log_path(rank).read_text()
    assert envs[0]["MASTER_PORT"] == envs[1]["MASTER_PORT"]
    assert not dist.is_initialized()  # only the ranks join the group


def test_close_runs_rank_exit_hooks_and_leaves_no_child_processes(tmp_path: Path) -> None:
    pool = SPMDPool(2)
    pids = pool.run(_write_at_exit, str(tmp_path))
    assert len(set(pids)) == 2 and os.getpid() not in pids
    log_dir = pool.log_path(0).parent
    began = time.perf_counter()
    pool.close()
    assert time.perf_counter() - began < 5.0
    assert all(_process_gone(pid) for pid in pids)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exited-0", "exited-1"]
    assert not log_dir.exists()
    with pytest.raises(SPMDError, match="closed"):
        pool.run(os.getpid)
