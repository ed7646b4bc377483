"""Parallelising one model (or one pipeline stage) in the fixed order torchtitan uses: tensor
parallel → expert parallel → context parallel → global-batch BatchNorm → the remaining parameters
replicated over tensor parallel →
activation checkpointing → per-block compile → data parallel
(FSDP2) → whole-model compile, then the scope ``mt.constrain`` reads.

Example (inside :func:`~meshtrain.lower.apply`)::

    parallelize(plan, model)
"""

from __future__ import annotations

from torch import nn

from meshtrain.lower.compute import apply_checkpointing, compile_blocks, compile_model
from meshtrain.lower.context.parallel import apply_context_parallel
from meshtrain.lower.data.batch_buffers import average_batch_buffers
from meshtrain.lower.data.batch_norm import sync_batch_norms
from meshtrain.lower.data.parallel import apply_data_parallel
from meshtrain.lower.experts.balance import install_count_reducer
from meshtrain.lower.experts.parallel import apply_expert_parallel
from meshtrain.lower.functional import track
from meshtrain.lower.groups import device_mesh
from meshtrain.lower.tensor.fresh_outputs import fresh_outputs
from meshtrain.lower.tensor.parallel import apply_tensor_parallel
from meshtrain.lower.tensor.replicated import mark_plain_parameters, replicate_whole_parameters
from meshtrain.plan.ir import Plan


def parallelize(plan: Plan, model: nn.Module) -> nn.Module:
    """Lower a plan without a pipeline onto ``model`` in place (see the module docstring): data
    parallelism also runs over size-1 axes that carry the mixed-precision policy."""
    if plan.tp_axis is not None:  # only set when its size is > 1
        apply_tensor_parallel(plan, model, device_mesh(plan.mesh)[plan.tp_axis])
    apply_expert_parallel(plan, model)
    apply_context_parallel(plan, model)
    install_count_reducer(plan, model)  # MoE balance statistics over the token ranks
    sync_batch_norms(plan, model)
    average_batch_buffers(plan, model)
    # every parameter on one mesh, so a user's own loop runs; not under compile, where torch
    # 2.13 retraces the swapping hooks and trips on the vocab-parallel embedding's cached mask
    # ("Mixing fake modes"): a compiling plan clips with meshtrain.train.clip_grad_norm_
    if plan.tp_axis is not None and plan.compile_scope is None:
        replicate_whole_parameters(model, device_mesh(plan.mesh)[plan.tp_axis], plan.readers)
    apply_checkpointing(plan, model)
    compile_blocks(plan, model)
    if plan.token_axes or plan.cast_axes:
        apply_data_parallel(plan, model)
    fresh_outputs(plan, model)  # after FSDP2's hooks: their output is the one copied
    compile_model(plan, model)
    if plan.tp_axis is not None and plan.compile_scope is not None:
        mark_plain_parameters(model, plan.tp_axis)  # PyTorch's clipping then names the fix
    track(plan, model)
    return model
