"""Packed token batches for document-masking tests: 4 rows of 32 tokens whose positions restart
at each packed document, at cuts that fall inside context-parallel chunks and on their edges;
one row is a single document and one begins with a document cut by the window's start. Module
level, so ranks can import it."""

from __future__ import annotations

import torch
from context_models import SEQ, VOCAB


def packed_positions(step: int, rows: int = 4, seq: int = SEQ) -> torch.Tensor:
    """``[rows, seq]`` positions restarting at each document (seeded by ``step``)."""
    generator = torch.Generator().manual_seed(700 + step)
    fixed = {0: [5, 13, 24], 1: [], 2: [8, 16, 17]}  # inside chunks; none; on chunk edges
    out = []
    for row in range(rows):
        cuts = fixed.get(row)
        if cuts is None:
            count = int(torch.randint(1, 6, (), generator=generator))
            cuts = sorted(set(torch.randint(1, seq, (count,), generator=generator).tolist()))
        first = 3 if row == 2 else 0  # row 2's first document began before the window
        lengths = [b - a for a, b in zip([0, *cuts], [*cuts, seq], strict=True)]
        out.append(
            torch.cat([torch.arange(n) + (first if i == 0 else 0) for i, n in enumerate(lengths)])
        )
    return torch.stack(out)


def packed_batches(step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A global batch ``(inputs, targets, token_positions)`` of packed documents."""
    generator = torch.Generator().manual_seed(300 + step)
    tokens = torch.randint(0, VOCAB, (4, SEQ + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:], packed_positions(step)
