"""``meshtrain train`` before any rank starts: a bad recipe or override exits 2 naming the key,
and the launcher builds the torchrun command a user would type."""

from __future__ import annotations

import signal
from types import SimpleNamespace

import pytest

from meshtrain.cli import build_parser, main
from meshtrain.errors import MeshtrainError
from meshtrain.launch import (
    EXIT_ERROR,
    EXIT_FAILED,
    EXIT_OK,
    EXIT_RESTARTS_SPENT,
    EXIT_STOPPED,
    RankReport,
    _after_failure,
    _after_signal,
    torchrun_command,
)


def test_unknown_override_exits_2_before_starting_ranks(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "debug", "--nproc", "4", "--set", "train.stepz=10"]) == 2
    err = capsys.readouterr().err
    assert "RecipeError" in err and "unknown key train.stepz = 10" in err
    assert "'steps'" in err  # the allowed keys are listed


def test_wrong_type_exits_2_naming_key_and_allowed_values(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["train", "debug", "--nproc", "2", "--set", "logging.wandb=cloud"]) == 2
    err = capsys.readouterr().err
    assert 'logging.wandb = "cloud" is not allowed' in err
    assert '"offline", "online", "disabled"' in err


def test_multi_node_flags_reach_torchrun() -> None:
    args = build_parser().parse_args(
        [
            "train",
            "debug",
            "--nproc",
            "2",
            "--nnodes",
            "2",
            "--node-rank",
            "1",
            "--rdzv-endpoint",
            "10.0.0.1:29500",
            "--set",
            "train.steps=5",
        ]
    )
    assert (args.nproc, args.nnodes, args.node_rank, args.rdzv_endpoint) == (
        2,
        2,
        1,
        "10.0.0.1:29500",
    )
    command = torchrun_command(
        ["train", "debug"], nproc=2, nnodes=2, node_rank=1, rdzv_endpoint="10.0.0.1:29500"
    )
    assert command[1:3] == ["-m", "torch.distributed.run"]
    assert "--nnodes=2" in command and "--node-rank=1" in command
    assert command[-4:] == ["-m", "meshtrain", "train", "debug"]


def test_multi_node_without_endpoint_or_with_a_bad_node_rank_is_refused() -> None:
    with pytest.raises(MeshtrainError, match="needs --rdzv-endpoint"):
        torchrun_command(["train", "debug"], nproc=2, nnodes=2)
    with pytest.raises(MeshtrainError, match=r"--node-rank=2 is not in 0\.\.1"):
        torchrun_command(["train", "debug"], nproc=2, nnodes=2, node_rank=2, rdzv_endpoint="h:1")


def _report(rank: int, code: int, event: str, pid: int) -> RankReport:
    return RankReport(rank, code, event, "", pid)


def test_the_launcher_turns_how_each_rank_ended_into_one_status_and_one_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """What ``run_agent`` makes of torchrun's outcome and the ranks' reports (the real launches
    in tests/test_fault_injection.py cover the stop, error and restart paths end to end)."""
    killed, lost = SimpleNamespace(pid=11, exitcode=-9), SimpleNamespace(pid=10, exitcode=1)
    reports = {0: _report(0, EXIT_FAILED, "lost contact", pid=10)}
    assert _after_failure({0: lost, 1: killed}, reports) == EXIT_FAILED
    assert capsys.readouterr().err == (
        "meshtrain: rank 1 was killed by SIGKILL (the other ranks stopped after losing contact "
        "with it). Run the same command to resume from the newest intact checkpoint, or pass "
        "--max-restarts N to resume automatically.\n"
    )
    # The first rank to fail is named with its own first error line, not those that followed.
    crash = RankReport(
        1, EXIT_FAILED, "crash", "[rank 1] ValueError: bad (traceback: x.log)", 11, time=5.0
    )
    late = RankReport(0, EXIT_FAILED, "crash", "[rank 0] RuntimeError: later", 10, time=9.0)
    assert _after_failure({0: lost, 1: killed}, {0: late, 1: crash}) == EXIT_FAILED
    assert capsys.readouterr().err.startswith(
        "meshtrain: rank 1 failed first: ValueError: bad (traceback: x.log). Run the same"
    )
    again = RankReport(1, EXIT_FAILED, "crash", "[rank 1] ValueError: bad", 11, attempt=2)
    assert _after_failure({1: killed}, {1: again}, restarts=2) == EXIT_RESTARTS_SPENT
    assert "restarted 2 time(s) and failed again" in capsys.readouterr().err
    stale = {0: _report(0, EXIT_STOPPED, "stopped", pid=99)}  # another process's report
    assert _after_failure({0: SimpleNamespace(pid=10, exitcode=-9)}, stale) == EXIT_FAILED
    assert capsys.readouterr().err.startswith("meshtrain: rank 0 was killed by SIGKILL. ")
    errors = {rank: _report(rank, EXIT_ERROR, "error", pid=rank) for rank in (0, 1)}
    assert _after_failure({0: SimpleNamespace(pid=0, exitcode=2)}, errors) == EXIT_ERROR
    stopped = {rank: _report(rank, EXIT_STOPPED, "stopped", pid=rank) for rank in (0, 1)}
    assert _after_signal(signal.SIGTERM, stopped, nproc=2) == EXIT_STOPPED
    assert _after_signal(signal.SIGTERM, {**stopped, 1: errors[1]}, nproc=2) == EXIT_ERROR
    assert capsys.readouterr().err == ""
    assert _after_signal(signal.SIGINT, {0: stopped[0]}, nproc=2) == EXIT_FAILED
    assert "SIGINT reached the ranks; rank(s) 1 ended without saying how" in capsys.readouterr().err
    assert _after_signal(signal.SIGINT, {0: stopped[0]}, nproc=2, elapsed_s=400) == EXIT_FAILED
    assert "rank(s) 1 did not stop within 300 s" in capsys.readouterr().err
    # A signal during the final save: every rank finished and said so; no false timeout line.
    done = {rank: _report(rank, EXIT_OK, "done", pid=rank) for rank in (0, 1)}
    assert _after_signal(signal.SIGTERM, done, nproc=2, elapsed_s=8) == EXIT_OK
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(
    ("flag", "value", "wanted"),
    [
        *[("--temperature", v, "a number ≥ 0") for v in ("nan", "-1", "inf", "-0.5", "hot")],
        *[("--top-k", v, "a whole number ≥ 0") for v in ("-1", "2.5", "nan", "many")],
        *[("--top-p", v, "a number in (0, 1]") for v in ("0", "1.5", "-0.1", "nan")],
        *[("--repetition-penalty", v, "a number > 0") for v in ("0", "-1", "inf")],
    ],
)
def test_a_sampling_setting_out_of_its_range_is_refused_in_one_line(
    flag: str, value: str, wanted: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--temperature nan`` used to end in ``RuntimeError: probability tensor contains either
    inf, nan or element < 0`` after the model loaded; now argparse refuses it (exit 2), and so
    every sampling setting out of its range."""
    with pytest.raises(SystemExit) as refusal:
        build_parser().parse_args(["generate", "runs/x", "--prompt", "a", flag, value])
    assert refusal.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: {value!r} is not {wanted}" in err
    assert "Traceback" not in err


def test_generate_takes_every_sampling_setting_several_prompts_and_stop_strings() -> None:
    prompts = ["--prompt", "a", "--prompt", "bc", "--stop", "\n"]
    sampling = ["--temperature", "0.7", "--top-k", "5", "--top-p", "0.9"]
    args = build_parser().parse_args(
        ["generate", "runs/x", *prompts, *sampling, "--repetition-penalty", "1.2"]
    )
    assert (args.prompt, args.stop) == (["a", "bc"], ["\n"])
    assert (args.temperature, args.top_k, args.top_p, args.repetition_penalty) == (0.7, 5, 0.9, 1.2)
