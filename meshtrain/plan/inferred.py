"""What inference decides about a plan before it is costed (the hand-off between the steps of
:mod:`meshtrain.plan.build`).

Example:
    >>> Inferred((), None, False, (), (), (), (), (), None, 0, None, ()).data_axes
    ()
"""

from __future__ import annotations

from dataclasses import dataclass

from meshtrain.plan.ir import (
    ExpertGroup,
    FSDPUnit,
    ModuleStyle,
    ParamLayout,
    ParamReader,
    PartialGrad,
)
from meshtrain.plan.memory.activations import ActivationProfile


@dataclass(frozen=True)
class Inferred:
    """What inference decides before costing: axes, per-parameter layouts, module styles, FSDP
    units, blocks, compute policies, the activation profile and the notes so far."""

    data_axes: tuple[str, ...]  # data axes larger than 1
    tp_axis: str | None
    sequence_parallel: bool
    params: tuple[ParamLayout, ...]
    styles: tuple[ModuleStyle, ...]
    units: tuple[FSDPUnit, ...]
    blocks: tuple[str, ...]
    cast_axes: tuple[str, ...]
    compile_scope: str | None
    buffers: int
    profile: ActivationProfile | None
    notes: tuple[str, ...]
    tied: tuple[tuple[str, ...], ...] = ()
    batch_norms: tuple[str, ...] = ()
    partial_grads: tuple[PartialGrad, ...] = ()
    context_axis: str | None = None
    expert_axis: str | None = None
    experts: tuple[ExpertGroup, ...] = ()
    readers: tuple[ParamReader, ...] = ()
    fresh_outputs: tuple[str, ...] = ()
    averaged_buffers: tuple[tuple[str, str], ...] = ()
