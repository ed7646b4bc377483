"""The whole value of a tensor that may be a DTensor: what a test, a metric or a report reads
after a step.

Example:
    >>> import torch
    >>> full_tensor(torch.ones(2))
    tensor([1., 1.])
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

__all__ = ["full_tensor"]


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` whole: a DTensor gathered from its shards (``DTensor.full_tensor()``, a
    collective every rank of its mesh must call), any other tensor as it is."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
