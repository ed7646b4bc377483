"""Fused expert weights from per-expert checkpoints: ``save_pretrained`` and the published
Qwen2-MoE, Qwen3-MoE (and DeepSeek-style) and Mixtral checkpoints store one 2-D tensor per expert
and projection, while transformers 5.24's models (and meshtrain's MoE) hold them fused over the
experts:

==========================================  ==================================================
fused parameter                             per-expert checkpoint tensors (expert ``e``)
==========================================  ==================================================
``<mlp>.experts.gate_up_proj`` [E, 2I, H]   ``<mlp>.experts.<e>.gate_proj.weight`` then ``up_proj`` (rows
                                            ``0:I`` and ``I:2I``); Mixtral: ``<moe>.experts.<e>.w1``
                                            then ``w3``
``<mlp>.experts.down_proj`` [E, H, I]       ``<mlp>.experts.<e>.down_proj.weight``; Mixtral: ``w2``
==========================================  ==================================================

(Mixtral's ``<moe>`` is ``block_sparse_moe`` where transformers names the module ``mlp``; its
router ``block_sparse_moe.gate.weight`` is read for ``mlp.gate.weight`` by :func:`renamed`.) The
layout is as transformers' own conversion (``MergeModulelist(dim=0)`` then
``Concatenate(dim=1)``). Each rank reads, of each piece, only the rows and columns it holds of
the experts it holds (a rank of ``ep`` reads its experts and no other).

Example:
    >>> files = {f"m.experts.{e}.{p}.weight": (2, 3) for e in range(2) for p in ("gate_proj", "up_proj")}
    >>> [(p.name, p.expert, p.row) for p in expert_pieces("m.experts.gate_up_proj", (2, 4, 3), files)][:2]
    [('m.experts.0.gate_proj.weight', 0, 0), ('m.experts.0.up_proj.weight', 0, 2)]
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["ExpertPiece", "expert_pieces", "fill_pieces", "renamed"]

#: fused tensor name suffix → per-expert tensor names concatenated along dim 1, per layout
_LAYOUTS: dict[str, tuple[tuple[str, ...], ...]] = {
    "gate_up_proj": (("gate_proj.weight", "up_proj.weight"), ("w1.weight", "w3.weight")),
    "down_proj": (("down_proj.weight",), ("w2.weight",)),
}
_MIXTRAL = (".mlp.", ".block_sparse_moe.")

#: reads ``name``'s elements at per-dim indices: (the tensor, the bytes read)
ReadSlice = Callable[[str, list[Tensor]], tuple[Tensor, int]]


@dataclass(frozen=True)
class ExpertPiece:
    """One checkpoint tensor ``name`` ``[rows, cols]`` of a fused parameter: it fills
    ``fused[expert, row : row + rows, :]``."""

    name: str
    expert: int
    row: int
    rows: int


def expert_pieces(
    name: str, shape: tuple[int, ...], files: Mapping[str, tuple[int, ...]]
) -> tuple[ExpertPiece, ...] | None:
    """The per-expert tensors that make up the fused ``name`` of ``shape`` (3-D) in a checkpoint
    whose tensors are ``files`` (name → shape), in the first layout (module docstring) whose
    expert 0 the checkpoint holds; ``None`` when it holds none."""
    stem, _, suffix = name.rpartition(".")
    if len(shape) != 3 or suffix not in _LAYOUTS or not stem.endswith("experts"):
        return None
    stems = [stem, stem.replace(*_MIXTRAL)] if _MIXTRAL[0] in f".{stem}." else [stem]
    for parts in _LAYOUTS[suffix]:
        for base in stems:
            if f"{base}.0.{parts[0]}" not in files or shape[1] % len(parts):
                continue
            rows = shape[1] // len(parts)
            return tuple(
                ExpertPiece(f"{base}.{expert}.{part}", expert, j * rows, rows)
                for expert in range(shape[0])
                for j, part in enumerate(parts)
            )
    return None


def renamed(name: str, files: Mapping[str, tuple[int, ...]]) -> str | None:
    """Mixtral's checkpoint name for a tensor transformers holds under ``mlp`` (its router),
    when the checkpoint has it; else ``None``.

    Example:
        >>> renamed("model.layers.0.mlp.gate.weight", {"model.layers.0.block_sparse_moe.gate.weight": (4, 8)})
        'model.layers.0.block_sparse_moe.gate.weight'
    """
    other = f".{name}".replace(*_MIXTRAL)[1:]
    return other if other != name and other in files else None


def fill_pieces(
    local: Tensor, indices: list[Tensor], pieces: tuple[ExpertPiece, ...], read: ReadSlice
) -> int:
    """Copy into ``local`` (this rank's part of a fused parameter, whose elements are the fused
    indices ``indices``, one tensor per dim) the pieces' elements it holds; the bytes read.
    Pieces of experts this rank does not hold are not read."""
    experts, rows, cols = indices
    done = 0
    for piece in pieces:
        at = torch.nonzero(experts == piece.expert).flatten().tolist()
        inside = torch.nonzero((rows >= piece.row) & (rows < piece.row + piece.rows)).flatten()
        if not at or not inside.numel():
            continue
        data, count = read(piece.name, [rows[inside] - piece.row, cols])
        done += count
        for position in at:
            local[position].index_copy_(0, inside.to(local.device), data.to(local))
    return done
