"""``meshtrain train`` before any rank starts: a bad recipe or override exits 2 naming the key,
and the launcher builds the torchrun command a user would type."""

from __future__ import annotations

import pytest

from meshtrain.cli import build_parser, main
from meshtrain.errors import MeshtrainError
from meshtrain.launch import torchrun_command


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
        ["train", "debug", "--nproc", "2", "--nnodes", "2", "--node-rank", "1",
         "--rdzv-endpoint", "10.0.0.1:29500", "--set", "train.steps=5"]
    )  # fmt: skip
    assert (args.nproc, args.nnodes, args.node_rank, args.rdzv_endpoint) == (
        2,
        2,
        1,
        "10.0.0.1:29500",
    )
    command = torchrun_command(["train", "debug"], nproc=2, nnodes=2, node_rank=1,
                               rdzv_endpoint="10.0.0.1:29500")  # fmt: skip
    assert command[1:3] == ["-m", "torch.distributed.run"]
    assert "--nnodes=2" in command and "--node-rank=1" in command
    assert command[-4:] == ["-m", "meshtrain", "train", "debug"]


def test_multi_node_without_endpoint_or_with_a_bad_node_rank_is_refused() -> None:
    with pytest.raises(MeshtrainError, match="needs --rdzv-endpoint"):
        torchrun_command(["train", "debug"], nproc=2, nnodes=2)
    with pytest.raises(MeshtrainError, match=r"--node-rank=2 is not in 0\.\.1"):
        torchrun_command(["train", "debug"], nproc=2, nnodes=2, node_rank=2, rdzv_endpoint="h:1")
