"""The compiler: specs → an inspectable :class:`Plan` (``ir``, ``infer``, ``cost``), pure.

Nothing here touches ``torch.distributed`` or imports lowering: the plan is data, and
:mod:`meshtrain.lower` applies it.
"""

from meshtrain.plan.api import plan
from meshtrain.plan.ir import (
    Collective,
    FSDPUnit,
    Memory,
    ModuleStyle,
    ParamLayout,
    PipelinePlan,
    Plan,
    StagePlan,
)
from meshtrain.plan.options import PlanOptions
from meshtrain.plan.pipeline import SCHEDULES, Pipeline

__all__ = [
    "SCHEDULES",
    "Collective",
    "FSDPUnit",
    "Memory",
    "ModuleStyle",
    "ParamLayout",
    "Pipeline",
    "PipelinePlan",
    "Plan",
    "PlanOptions",
    "StagePlan",
    "plan",
]
