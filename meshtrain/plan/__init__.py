"""The compiler: specs → an inspectable :class:`Plan` (``ir``, ``infer``, ``cost``), pure.

Nothing here touches ``torch.distributed`` or imports lowering: the plan is data, and
:mod:`meshtrain.lower` applies it.
"""

from meshtrain.plan.api import plan
from meshtrain.plan.decisions import FSDPDecisions, fsdp_decisions
from meshtrain.plan.ir import (
    Collective,
    FSDPUnit,
    Memory,
    ModuleStyle,
    ParamLayout,
    PipelinePlan,
    Plan,
    StagePlan,
    TPStyle,
)
from meshtrain.plan.options import PlanOptions
from meshtrain.plan.pipeline.schedule import SCHEDULES, Pipeline

__all__ = [
    "SCHEDULES",
    "Collective",
    "FSDPDecisions",
    "FSDPUnit",
    "Memory",
    "ModuleStyle",
    "ParamLayout",
    "Pipeline",
    "PipelinePlan",
    "Plan",
    "PlanOptions",
    "StagePlan",
    "TPStyle",
    "fsdp_decisions",
    "plan",
]
