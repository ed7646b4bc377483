"""``mt.apply(plan, model)``: lower a plan onto a model — the only step that touches
``torch.distributed``'s parallel APIs.

Example (on every rank of a 4-rank job, after ``mt.init_distributed()``)::

    plan = mt.plan(model, mt.make_mesh(dp=2, tp=2), rules)
    model = mt.apply(plan, model)        # model holds full, identically initialised weights
"""

from __future__ import annotations

from typing import Any

from torch import nn

from meshtrain.adapters.nf4 import require_nf4
from meshtrain.errors import PlanError, format_shape
from meshtrain.lower.flat import parallelize
from meshtrain.lower.groups import device_mesh
from meshtrain.lower.pipeline import PipelinedModel, apply_pipeline
from meshtrain.plan.ir import Plan


def apply(plan: Plan, model: nn.Module) -> nn.Module | PipelinedModel:
    """Parallelise ``model`` in place as ``plan`` says and return it (under a pipeline: this
    rank's stages as a :class:`~meshtrain.lower.pipeline.PipelinedModel`).

    ``model`` must hold its full, initialised weights on every rank (the same on all ranks), or be
    on the meta device (then call ``to_empty`` and initialise afterwards). The plan's mesh is
    bound to the running ranks here (:func:`~meshtrain.lower.groups.device_mesh`).
    """
    _check_model(plan, model)
    require_nf4(model)  # a QLoRA base planned without torchao cannot train
    if plan.mesh.is_abstract:
        raise PlanError(
            f"cannot apply a plan on the abstract mesh {plan.mesh}: describe the mesh with "
            "mt.make_mesh(...) without abstract=True on every rank, then plan again."
        )
    device_mesh(plan.mesh)  # bound before anything else, on every rank in the same order
    if plan.pipeline is not None:
        return apply_pipeline(plan, model)
    return parallelize(plan, model)


def _check_model(plan: Plan, model: Any) -> None:
    shapes = {fqn: tuple(param.shape) for fqn, param in model.named_parameters()}
    planned = {p.fqn: p.shape for p in plan.params}
    if shapes != planned:
        missing = sorted(set(planned) - set(shapes))[:3]
        extra = sorted(set(shapes) - set(planned))[:3]
        changed = [
            f"'{f}' {format_shape(shapes[f])} vs planned {format_shape(planned[f])}"
            for f in shapes
            if f in planned and shapes[f] != planned[f]
        ][:3]
        raise PlanError(
            f"the model does not match the plan: missing {missing}, unexpected {extra}, shapes "
            f"{changed}. Plan and apply the same model (build it the same way on every rank)."
        )
