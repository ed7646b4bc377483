"""``mt.plan``: resolve specs, infer the parallel layout, cost it — no collectives, no memory.

Example:
    >>> import meshtrain as mt
    >>> from meshtrain.models import LlamaConfig, build_llama, default_rules
    >>> model = build_llama(LlamaConfig.llama3_8b(), device="meta")
    >>> mesh = mt.make_mesh(dp=-1, tp=8, world_size=1024, abstract=True)
    >>> plan = mt.plan(model, mesh, default_rules(), zero=3)
    >>> plan.tp_axis, plan.data_axes, len(plan.units)
    ('tp', ('dp',), 33)
"""

from __future__ import annotations

from typing import Any

from torch import nn

from meshtrain.plan.auto.experts import choose_expert_plan, has_experts
from meshtrain.plan.auto.search import choose_plan
from meshtrain.plan.build import build_plan
from meshtrain.plan.ir import Plan
from meshtrain.plan.options import AutoSearch, PlanOptions
from meshtrain.plan.proof.probe import example_inputs as probing
from meshtrain.spec.mesh import Mesh
from meshtrain.spec.rules import Rules


def plan(
    model: nn.Module,
    mesh: Mesh,
    rules: Rules,
    options: PlanOptions | None = None,
    *,
    example_inputs: Any = None,
    **overrides: Any,
) -> Plan:
    """Compile ``rules`` for ``model`` on ``mesh`` into a :class:`Plan` (pure; meta models work).

    ``options`` (a :class:`PlanOptions`, default all defaults) with ``overrides`` applied — any of
    its fields by name: ``zero`` (0 DDP … 3 parameters sharded), ``offload``, ``precision`` and
    ``reduce_precision`` ('fp32', 'bf16', 'fp16'; bf16/fp16 cast parameters for compute through
    FSDP2's mixed-precision policy, fp16 also needs :class:`~meshtrain.train.LossScaler`),
    ``optimizer`` (for the memory model), ``loss_parallel``, ``microbatches`` (gradient
    accumulation), ``batch_size`` (sequences per micro-batch per data-parallel rank) and
    ``seq_len`` (given, they size activations and collectives; sequence parallelism needs
    ``seq_len`` divisible by the tensor-parallel size), ``global_batch`` (sequences per optimizer
    step over all data-parallel ranks: fills in ``batch_size``), ``fsdp_units`` (overrides the
    detected repeated blocks FSDP wraps one by one), ``pipeline`` (a
    :class:`~meshtrain.Pipeline`: stages along a mesh axis; its micro-batches are the plan's),
    ``activation_checkpointing`` ('none', 'full', 'selective' or ``{"every": k, "mode": ...}``)
    and ``compile`` (True or ``{"backend", "fullgraph", "scope"}``).

    ``strategy="auto"`` (with ``device_memory``, bytes or "80GiB", and ``node_size``) chooses the
    mesh's pp/dp/tp degrees over ``mesh.world_size`` ranks, the ZeRO stage, accumulation or
    pipeline micro-batches and checkpointing so the plan fits at the least modelled step
    overhead (:mod:`meshtrain.plan.auto.search`); it needs ``global_batch`` and ``seq_len``. For a
    model with experts the expert-parallel degree (an ``ep`` axis) joins the search
    (:mod:`meshtrain.plan.auto.experts`). The returned plan's mesh is the chosen one and
    ``explain()`` says why.

    ``example_inputs`` (a tensor, a tuple of positional inputs or a mapping of keyword inputs:
    one batch the model's forward takes) feeds the plan-time proof
    (:mod:`meshtrain.plan.proof.run`); only shapes and dtypes are read. Without it meshtrain
    builds token ids, images or features where the model's first module says which
    (:mod:`meshtrain.plan.proof.probe`), and a plan that needs the proof on any other model is a
    ``PlanError`` asking for it.
    """
    search_keys = {key: overrides.pop(key) for key in AutoSearch.KEYS if key in overrides}
    options = (options or PlanOptions()).with_overrides(**overrides)
    search = AutoSearch.from_overrides(search_keys)
    with probing(example_inputs):
        if search is None:
            return build_plan(model, mesh, rules, options)
        choose = choose_expert_plan if has_experts(model) else choose_plan
        return choose(
            model,
            mesh.world_size,
            rules,
            options,
            search=search,
            device_type=mesh.device_type,
            abstract=mesh.is_abstract,
        ).plan
