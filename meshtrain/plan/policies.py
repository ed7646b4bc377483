"""Compute policies of a plan: activation checkpointing, ``torch.compile`` scope, precision axis.

Pure planning: user arguments are parsed into :class:`PlanOptions` fields and the compile scope is
chosen for the plan at hand — or refused with a ``PlanError`` naming the torch limitation.

Known torch 2.13 limitations the choice works around (each has a regression test in
``tests/test_compile_limits_spmd.py`` that fails once torch fixes it):

- per-block compile under tensor parallelism (with or without sequence parallelism) fails in
  backward (``Redistribute``: ``'Tensor' object has no attribute '_local_tensor'``); under FSDP2
  × TP it runs but the vocab-parallel embedding's gradient is wrong (relative error 1.0);
- whole-model compile under FSDP2 with ``fullgraph=True`` fails (FSDP2's hooks are skipped by
  dynamo);
- whole-model compile under FSDP2 × tensor parallel fails (``Mixing fake modes NYI``);
- whole-model compile under tensor parallel with full (non-selective) activation checkpointing
  fails in backward (the checkpoint saves a ``DeviceMesh``);
- pipeline schedules that split backward (zero bubble, DualPipeV) fail with compiled stages: the
  weight-gradient pass runs over a retained graph, which compiled backward functions refuse.

So 'auto' compiles each block for data-parallel plans and the whole model (each pipeline stage)
for tensor-parallel ones, and refuses the rest with a ``PlanError`` that says what works.

Example:
    >>> block_fqns([FSDPUnit("layers.0", ()), FSDPUnit("", ())])
    ('layers.0',)
"""

from __future__ import annotations

from collections.abc import Sequence

from meshtrain.errors import PlanError
from meshtrain.plan.ir import FSDPUnit
from meshtrain.plan.options import PlanOptions


def block_fqns(units: Sequence[FSDPUnit]) -> tuple[str, ...]:
    """FSDP units that are repeated blocks (all but the root)."""
    return tuple(unit.fqn for unit in units if unit.fqn)


def resolve_compile_scope(
    options: PlanOptions,
    *,
    sequence_parallel: bool,
    wrapped: bool,
    tp_axis: str | None,
    split_backward_schedule: str | None = None,
) -> str | None:
    """The scope ``torch.compile`` is applied at ('block' or 'model'), or None without compile.

    ``wrapped``: the plan applies FSDP2 (``fully_shard`` or ``replicate``) to the model. 'auto'
    picks 'block' without tensor parallelism and 'model' with it (see the module docstring).
    ``split_backward_schedule``: the pipeline schedule, when it splits backward in two.
    """
    if not options.compile:
        return None
    scope = options.compile_scope
    tp = "tensor parallel" + (" with sequence parallelism" if sequence_parallel else "")
    if split_backward_schedule is not None:
        raise PlanError(
            f"compile=True cannot be lowered with pipeline schedule {split_backward_schedule!r} "
            "in torch 2.13: the schedule runs backward in two passes over a retained graph, "
            "which compiled backward functions refuse (under FSDP2: 'compiled with non-empty "
            "donated buffers which requires ... retain_graph=False'; under tensor parallel: "
            "RecursionError in the backend). Use a schedule without split backward (GPipe, "
            "1F1B, Interleaved1F1B, LoopedBFS), or compile=False."
        )
    if tp_axis is not None and options.activation_checkpointing == "full":
        raise PlanError(
            f"compile=True with activation_checkpointing='full' under {tp} over '{tp_axis}' "
            "fails in torch 2.13 (the checkpointed region saves a DeviceMesh: 'expected all "
            "tensors_saved_with_vc_check to be Tensors'). Use activation_checkpointing="
            "'selective' (or {'every': k, 'mode': 'selective'}), or compile=False."
        )
    if tp_axis is not None and wrapped:
        raise PlanError(
            f"compile=True cannot be lowered for FSDP2 × {tp} over '{tp_axis}' in torch 2.13: "
            "whole-model compile fails ('Mixing fake modes NYI'), and per-block compile gives a "
            "wrong gradient for the vocab-parallel embedding (measured: relative error 1.0). "
            "Compile a plan with FSDP2 alone or tensor parallel alone, or set compile=False."
        )
    if scope == "auto":
        scope = "model" if tp_axis is not None else "block"
    if scope == "block" and tp_axis is not None:
        raise PlanError(
            f"compile scope 'block' under {tp} over '{tp_axis}' fails in torch 2.13 (backward "
            "of a compiled block: Redistribute: 'Tensor' object has no attribute "
            "'_local_tensor'). Use compile={'scope': 'model'} (or 'auto'), or compile=False."
        )
    if scope == "model" and wrapped and options.compile_fullgraph:
        raise PlanError(
            "compile={'scope': 'model', 'fullgraph': True} fails under FSDP2 in torch 2.13 (its "
            "hooks are skipped by dynamo: 'Attempted to call function marked as skipped'). Use "
            "scope 'block' (each block compiled before fully_shard), or fullgraph=False."
        )
    return scope


def plain_under_compile_note(tp_axis: str) -> str:
    """The note a plan that compiles under tensor parallelism carries: its whole parameters stay
    plain tensors (torch 2.13's compile fails on them as DTensors), so PyTorch's own clipping
    cannot mix them with the sharded ones.

    Example:
        >>> plain_under_compile_note("tp").startswith("compiled under tensor parallelism")
        True
    """
    return (
        f"compiled under tensor parallelism over '{tp_axis}': the parameters the rules leave "
        "whole stay plain tensors (torch 2.13's compile fails on them as DTensors replicated "
        f"over '{tp_axis}'), so torch.nn.utils.clip_grad_norm_ and get_total_norm raise a "
        "TrainingError on this plan: clip with meshtrain.train.clip_grad_norm_ (TrainStep "
        "does), or plan without compile"
    )
