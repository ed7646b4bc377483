"""Lowering: a :class:`~meshtrain.Plan` onto modules with PyTorch's own machinery — DTensor,
``parallelize_module``, FSDP2, ``torch.distributed.pipelining``, checkpoint wrappers and
``torch.compile`` — and the run-time primitives model code calls under a running plan.

The only package that calls those APIs or redistributes activations. It returns modules, stages
and schedules; losses and token counts belong to :mod:`meshtrain.train`.

Example (on every rank, after ``mt.init_distributed()``)::

    applied = mt.apply(plan, model)
    with mt.loss_parallel(plan):
        loss = F.cross_entropy(applied(x).flatten(0, 1), y.flatten())
"""

from meshtrain.lower.apply import apply
from meshtrain.lower.compute import CompileReport, compile_loss, compile_report
from meshtrain.lower.context.parallel import shard_batch
from meshtrain.lower.data.parallel import micro_batch
from meshtrain.lower.distribute import distribute
from meshtrain.lower.functional import constrain, shard_map
from meshtrain.lower.gather import full_tensor
from meshtrain.lower.groups import device_mesh, group_over, plan_device
from meshtrain.lower.materialise import initialise, materialise
from meshtrain.lower.pipeline import PipelinedModel
from meshtrain.lower.reference import one_device_reference
from meshtrain.lower.tensor.parallel import loss_parallel

__all__ = [
    "CompileReport",
    "PipelinedModel",
    "apply",
    "compile_loss",
    "compile_report",
    "constrain",
    "device_mesh",
    "distribute",
    "full_tensor",
    "group_over",
    "initialise",
    "loss_parallel",
    "materialise",
    "micro_batch",
    "one_device_reference",
    "plan_device",
    "shard_batch",
    "shard_map",
]
