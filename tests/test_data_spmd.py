"""Distributed batches on real ranks: separate processes that open the same memory-mapped token
file agree on every epoch's shuffle, split each global batch between them, and give ranks that
share a data-parallel index the same batch."""

from __future__ import annotations

from itertools import islice

import pytest
import torch
import torch.distributed as dist

from meshtrain.testing.runner import get_pool
from meshtrain.train.batch import DataPosition
from meshtrain.train.data import DistributedBatches, TokenWindows, prepare_corpus

pytestmark = pytest.mark.spmd

_SEQ_LEN, _GLOBAL_BATCH, _SEED = 16, 8, 11


def _rank_batches(
    token_dir: str, dp_rank: int, dp_size: int, start: DataPosition, steps: int
) -> list[tuple[torch.Tensor, torch.Tensor, DataPosition]]:
    windows = TokenWindows(token_dir, _SEQ_LEN)
    loader = DistributedBatches(windows, _GLOBAL_BATCH, dp_rank, dp_size, seed=_SEED)
    return [
        (batch.inputs, batch.targets, batch.position)
        for batch in islice(loader.batches(start), steps)
    ]


def _data_parallel_batches(
    token_dir: str, start: DataPosition, steps: int
) -> list[tuple[torch.Tensor, torch.Tensor, DataPosition]]:
    return _rank_batches(token_dir, dist.get_rank(), dist.get_world_size(), start, steps)


def _tensor_parallel_batches(
    token_dir: str, steps: int
) -> list[tuple[torch.Tensor, torch.Tensor, DataPosition]]:
    return _rank_batches(token_dir, 0, 1, DataPosition(), steps)  # dp 1 × tp 2: one dp index


@pytest.fixture(scope="module")
def token_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    directory = tmp_path_factory.mktemp("corpus")
    prepare_corpus(directory, limit_bytes=12_000)
    return str(directory)


def test_data_parallel_ranks_split_the_global_batches_of_one_process(token_dir: str) -> None:
    steps_per_epoch = len(TokenWindows(token_dir, _SEQ_LEN)) // _GLOBAL_BATCH
    start = DataPosition(0, steps_per_epoch - 2)  # resume mid-epoch, run into the next epoch
    reference = _rank_batches(token_dir, 0, 1, start, 4)
    per_rank = get_pool(2).run(_data_parallel_batches, token_dir, start, 4)
    assert [position for *_, position in reference][1:3] == [DataPosition(1, 0), DataPosition(1, 1)]
    for step, (inputs, targets, position) in enumerate(reference):
        assert all(batches[step][2] == position for batches in per_rank)
        for rank, batches in enumerate(per_rank):
            assert batches[step][0].shape == (_GLOBAL_BATCH // 2, _SEQ_LEN)
            assert torch.equal(batches[step][0], inputs[rank::2])
            assert torch.equal(batches[step][1], targets[rank::2])


def test_ranks_of_one_data_parallel_index_get_the_same_batches(token_dir: str) -> None:
    first, second = get_pool(2).run(_tensor_parallel_batches, token_dir, 3)
    for (inputs, targets, position), (other_inputs, other_targets, other_position) in zip(
        first, second, strict=True
    ):
        assert torch.equal(inputs, other_inputs) and torch.equal(targets, other_targets)
        assert position == other_position
