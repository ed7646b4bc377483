"""Small models that are not meshtrain's, for planner and equivalence tests."""

from __future__ import annotations

import torch
from torch import nn


class TiedMLP(nn.Module):
    """Embedding, two residual MLP blocks with biases, and an output head tied to the embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)) for _ in range(2)
        )
        self.head = nn.Linear(16, 32, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)
