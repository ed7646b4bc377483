"""The compiler: specs → an inspectable :class:`Plan` (``ir``, ``infer``, ``cost``) → modules (``lower``).

Only ``meshtrain.plan.lower`` touches ``torch.distributed`` parallel APIs; ``functional`` holds
the primitives model code calls under a running plan (``constrain``, ``shard_map``).
"""

from meshtrain.plan.api import plan
from meshtrain.plan.functional import constrain, shard_map
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
    "constrain",
    "plan",
    "shard_map",
]
