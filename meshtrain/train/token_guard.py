"""Every step's token ids inside the model's vocabulary, and the token file unchanged under a
running job.

A token id outside the vocabulary is silent under vocabulary-parallel embeddings (each shard
masks the ids it does not hold, so an id past every shard embeds as zeros) and an ``IndexError``
deep in a plain embedding: :meth:`TokenGuard.check` looks at each batch before the step, and
all ranks agree on the verdict (one small all-reduce), so every rank raises the same
:class:`~meshtrain.errors.DataError`, naming the file, the data position, the row and column
and the id. :meth:`TokenGuard.check_file` stats the memory-mapped token file between steps: a
file truncated or replaced under the job is named before the next read of a page past its new end
(which would end the process with SIGBUS).

Example:
    >>> import torch
    >>> from meshtrain.train.batch import Batch
    >>> guard = TokenGuard(vocab=8, source="tokens.bin")
    >>> guard.check(Batch(torch.tensor([[1, 2]]), torch.tensor([[2, -100]])))
    >>> guard.check(Batch(torch.tensor([[1, 9]]), torch.tensor([[9, 3]])))
    Traceback (most recent call last):
    meshtrain.errors.DataError: tokens.bin: token id 9 at row 0, column 1 of the inputs of the batch before data position (epoch 0, step 0) is outside the model's 8-token vocabulary, so no embedding row holds it. Re-tokenise the data with the model's tokenizer, or give the model a larger vocabulary (model.vocab_size).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from meshtrain.errors import DataError
from meshtrain.train.batch import Batch

__all__ = ["TokenGuard"]

_IGNORE_INDEX = -100


class TokenGuard:
    """Checks a run's batches against ``vocab`` and its token file (``bin_path`` of
    ``expected_bytes``) against its size; ``source`` names where the tokens come from."""

    def __init__(
        self,
        vocab: int,
        source: str,
        bin_path: Path | None = None,
        expected_bytes: int = 0,
    ) -> None:
        self.vocab, self.source = vocab, source
        self.bin_path, self.expected_bytes = bin_path, expected_bytes

    @classmethod
    def of(cls, dataset: Any, vocab: int) -> TokenGuard:
        """The guard for a run's dataset (a :class:`~meshtrain.train.data.TokenWindows` names
        its file; other datasets are checked by id only)."""
        token_file = getattr(dataset, "token_file", None)
        bin_path = getattr(token_file, "bin_path", None)
        if token_file is None or bin_path is None:
            return cls(vocab, type(dataset).__name__)
        info = token_file.info
        return cls(vocab, str(bin_path), Path(bin_path), info.num_tokens * info.itemsize)

    def check(self, batch: Batch, device: torch.device | None = None) -> None:
        """Raise :class:`DataError` on every rank alike when any rank's batch holds an id
        outside ``[0, vocab)`` (targets may hold the ignore index). ``device``: where the
        process group's collectives run (a CUDA device under NCCL)."""
        _agree(self._problem(batch), device, "batch")

    def check_file(self, device: torch.device | None = None) -> None:
        """Raise :class:`DataError` on every rank alike when the token file no longer has the
        size it was opened with (truncated, replaced or removed under the running job): call it
        between steps, before the next batch is read."""
        _agree(self._file_problem(), device, "token file")

    def before_read(self) -> bool:
        """Stat the token file before the next batch is read, on this rank alone (agreed in
        :meth:`agree`): whether the batch may be read (a file truncated under the job would end
        the process with SIGBUS on a page past its new end)."""
        self._pending = self._file_problem()
        return self._pending is None

    def agree(self, batch: Batch | None, stop: int, device: torch.device | None = None) -> int:
        """The one collective of a step's checks: the highest stop signal any rank received
        (returned; it wins over the rest), and — when none — a :class:`DataError` on every rank
        alike when any rank's token file (:meth:`before_read`) or batch is bad. ``batch`` is
        None where the file was not read."""
        problems = (
            getattr(self, "_pending", None),
            self._problem(batch) if batch is not None else None,
        )
        flags = [stop, *(0 if p is None else 1 for p in problems)]
        if dist.is_initialized() and dist.get_world_size() > 1:
            agreed = torch.tensor(flags, dtype=torch.int64, device=device)
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
            flags = [int(v) for v in agreed.tolist()]
        if flags[0]:
            return flags[0]
        for index, what in ((1, "token file"), (2, "batch")):
            if flags[index]:
                _raise_agreed(problems[index - 1], what)
        return 0

    def _problem(self, batch: Batch) -> str | None:
        if self.vocab <= 0:  # no vocabulary to check against
            return None
        for name, ids in (("inputs", batch.inputs), ("targets", batch.targets)):
            bad = (ids < 0) | (ids >= self.vocab)
            if name == "targets":
                bad &= ids != _IGNORE_INDEX
            if bool(bad.any()):
                row, column = (int(index) for index in bad.nonzero()[0][:2])
                value = int(ids[row, column])
                where = batch.position
                return (
                    f"{self.source}: token id {value} at row {row}, column {column} of the {name} "
                    f"of the batch before data position (epoch {where.epoch}, step {where.step}) "
                    f"is outside the model's {self.vocab}-token vocabulary, so no embedding row "
                    "holds it. Re-tokenise the data with the model's tokenizer, or give the model "
                    "a larger vocabulary (model.vocab_size)."
                )
        return None

    def _file_problem(self) -> str | None:
        if self.bin_path is None:
            return None
        try:
            size = os.stat(self.bin_path).st_size
        except OSError as err:
            return (
                f"token file {str(self.bin_path)!r} disappeared while the job ran ({err}). Put "
                "it back (or prepare it again) and run the same command to resume."
            )
        if size != self.expected_bytes:
            return (
                f"token file {str(self.bin_path)!r} changed size while the job ran: "
                f"{size:,} bytes, it was opened with {self.expected_bytes:,}. Something "
                "truncated or rewrote it; restore it and run the same command to resume from "
                "the last checkpoint."
            )
        return None


def _raise_agreed(problem: str | None, what: str) -> None:
    """Every rank raises the first rank's problem (the ranks that found one named)."""
    found: list[Any] = [None] * dist.get_world_size() if dist.is_initialized() else [problem]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_gather_object(found, problem)
    ranks = [rank for rank, text in enumerate(found) if text is not None]
    text = found[ranks[0]]
    if len(ranks) < len(found):
        text = f"{text} (found by rank {', '.join(map(str, ranks))}, on its {what})"
    raise DataError(text)


def _agree(problem: str | None, device: torch.device | None, what: str) -> None:
    """Every rank raises the same :class:`DataError` when any rank found a problem (one small
    all-reduce; the messages are gathered only then)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        flag = torch.tensor([0 if problem is None else 1], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if int(flag.item()):
            found: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(found, problem)
            ranks = [rank for rank, text in enumerate(found) if text is not None]
            problem = found[ranks[0]]
            if len(ranks) < len(found):
                problem = f"{problem} (found by rank {', '.join(map(str, ranks))}, on its {what})"
    if problem is not None:
        raise DataError(problem)
