"""What a data loader hands the train step: one step's tokens for this rank, and where the data
stream stands after them.

The position travels with the batch so the train step can record it in the
:class:`~meshtrain.train.state.TrainState`; a checkpoint then resumes the stream exactly there,
whatever the data-parallel degree of the resumed run.

Example:
    >>> import torch
    >>> batch = Batch(torch.zeros(2, 4, dtype=torch.long), torch.ones(2, 4, dtype=torch.long),
    ...               DataPosition(epoch=0, step=1))
    >>> batch.position.step, batch.inputs.shape[0]
    (1, 2)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, order=True)
class DataPosition:
    """Where the data stream stands: ``step`` global batches of ``epoch`` have been consumed."""

    epoch: int = 0
    step: int = 0

    def to_json(self) -> dict[str, int]:
        return {"epoch": self.epoch, "step": self.step}

    @classmethod
    def from_json(cls, data: dict[str, int]) -> DataPosition:
        return cls(epoch=int(data["epoch"]), step=int(data["step"]))


@dataclass(frozen=True)
class Batch:
    """One optimizer step's data on this rank: ``inputs`` and ``targets`` (``[batch, seq]``
    token ids; ``targets`` may hold ``ignore_index`` for tokens without a loss), the stream
    position after this batch, and optionally ``token_positions`` (``[batch, seq]``, each
    token's position in its document: packed documents, whose positions restart at each one,
    attend only within themselves; ``None``: ``0..seq-1``, one causal sequence per row)."""

    inputs: torch.Tensor
    targets: torch.Tensor
    position: DataPosition = DataPosition()
    token_positions: torch.Tensor | None = None

    def to(self, device: torch.device | str) -> Batch:
        """This batch with its tensors on ``device``."""
        positions = self.token_positions
        return Batch(
            self.inputs.to(device),
            self.targets.to(device),
            self.position,
            None if positions is None else positions.to(device),
        )
