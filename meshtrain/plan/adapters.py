"""What the planner makes of LoRA adapters (:mod:`meshtrain.adapters`): their layouts, derived
from their base weight's spec so the low-rank path computes on the same shards as the base,
whichever rules the user wrote; which parameters are frozen; which weights are stored in NF4.

==================  ===================  ======================  =====================
base weight         ``lora_A`` [r, in]   ``lora_B`` [out, r]     tensor-parallel style
==================  ===================  ======================  =====================
``P(o, i)``         ``P(None, i)``       ``P(o, None)``          the base's
column-wise (o=tp)  replicated           sharded along out       column-wise
row-wise (i=tp)     sharded along in     replicated              row-wise
==================  ===================  ======================  =====================

FSDP shards the adapters over the data axes like any other parameter. Rules need not cover the
adapters: a rule that matches only adapters is unused (a :class:`RuleError`, as any unused rule).

Example:
    >>> import torch, meshtrain as mt
    >>> from meshtrain.adapters import lora
    >>> model = lora(torch.nn.Sequential(torch.nn.Linear(8, 8)), rank=2, alpha=2, targets=["0"])
    >>> mesh = mt.make_mesh(tp=2, world_size=2, abstract=True)
    >>> resolution = resolve_with_adapters(mt.Rules({"0.weight": mt.P("tp"), ".*": mt.P()}),
    ...                                    model, mesh)
    >>> resolution.specs["0.lora_A"], resolution.specs["0.lora_B"]
    (P(), P('tp'))
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from torch import nn

from meshtrain.adapters.lora import ADAPTERS, LoRALinear, adapter_names
from meshtrain.adapters.nf4 import BLOCK_SIZE, SCALER_BLOCK_SIZE
from meshtrain.errors import PlanError, format_shape
from meshtrain.plan.ir import ParamLayout
from meshtrain.spec.layout import validate_spec
from meshtrain.spec.logical import named_logical_axes
from meshtrain.spec.mesh import Mesh
from meshtrain.spec.partition import P
from meshtrain.spec.rules import ParamSpec, Resolution, Rules


def resolve_with_adapters(rules: Rules, model: nn.Module, mesh: Mesh) -> Resolution:
    """``rules.resolve(model, mesh)`` with each adapter's spec derived from its base weight's
    (the table above) instead of matched by the rules."""
    adapters = adapter_names(model)
    if not adapters:
        return rules.resolve(model, mesh)
    shapes = {fqn: tuple(p.shape) for fqn, p in model.named_parameters() if fqn not in adapters}
    resolved = rules.resolve(shapes, mesh, logical_axes=named_logical_axes(model))
    by_fqn = {param.fqn: param for param in resolved.params}
    params = []
    for fqn, param in model.named_parameters():
        if fqn not in adapters:
            params.append(by_fqn[fqn])
            continue
        base = by_fqn[adapters[fqn]]
        out_entry, in_entry = base.spec.padded(2)[:2]
        entries = [None, in_entry] if fqn.endswith(ADAPTERS[0]) else [out_entry]
        while entries and entries[-1] is None:
            entries.pop()
        spec = P(*entries)
        source = f"lora of '{base.fqn}' ({base.spec!r})"
        validate_spec(spec, tuple(param.shape), mesh, fqn=fqn, rule=source)
        params.append(ParamSpec(fqn, tuple(param.shape), spec, source))
    _check_quantized(model, by_fqn, mesh)
    return dataclasses.replace(resolved, params=tuple(params))


def check_nf4_shards(layouts: Sequence[ParamLayout], ways: int, sharded: bool) -> None:
    """NF4 base weights under data parallelism: FSDP2 must shard them (``sharded``: the ZeRO
    stage shards parameters, :func:`~meshtrain.plan.decisions.fsdp_decisions`; its replicate path
    cannot gather torchao's NF4 tensor), evenly along dim 0, each shard a whole number of NF4
    scale groups (torchao splits its codes, scales and factors with the shard).
    ``ways``: the data-parallel ranks FSDP would shard a parameter over (1: none)."""
    group = BLOCK_SIZE * SCALER_BLOCK_SIZE
    for layout in layouts:
        if layout.storage != "nf4" or ways == 1:
            continue
        if not sharded:
            raise PlanError(
                f"parameter '{layout.fqn}' is an NF4 (QLoRA) base weight and the plan replicates "
                "it over the data-parallel ranks (zero=0), which FSDP2's replicate cannot do for "
                "torchao's NF4 tensor. Use zero=2 or zero=3: FSDP shards the frozen base (which "
                "is QLoRA's point) and still reduces only the adapters' gradients.",
                fqn=layout.fqn,
            )
        rows, numel = layout.local_shape[0], layout.local_numel
        if rows % ways or (numel // ways) % group:
            raise PlanError(
                f"parameter '{layout.fqn}' ({format_shape(layout.local_shape)}) is an NF4 "
                f"(QLoRA) base weight and FSDP shards it {ways} ways: each shard must hold whole "
                f"rows and a multiple of {group} elements (torchao's NF4 scale groups), but "
                f"{format_shape(layout.local_shape)} / {ways} does not. Shard over a data-parallel "
                "size that divides it, or leave this module out of the LoRA targets.",
                fqn=layout.fqn,
                shape=layout.local_shape,
            )


def trainable(model: nn.Module) -> dict[str, bool]:
    """FQN → whether the parameter requires a gradient."""
    return {fqn: param.requires_grad for fqn, param in model.named_parameters()}


def storage(model: nn.Module) -> dict[str, str]:
    """Weight FQN → "nf4" for every LoRA base stored (or to be stored) as NF4."""
    return {
        f"{fqn}.weight" if fqn else "weight": module.quantized
        for fqn, module in model.named_modules()
        if isinstance(module, LoRALinear) and module.quantized
    }


def _check_quantized(model: nn.Module, by_fqn: dict[str, ParamSpec], mesh: Mesh) -> None:
    """An NF4 base cannot be tensor-parallel: torchao's NF4 tensor is not a DTensor shard (a
    spec over axes of size 1 shards nothing and is allowed)."""
    for fqn in storage(model):
        spec = by_fqn[fqn].spec
        if any(mesh.size(axis) > 1 for axis in spec.axes):
            raise PlanError(
                f"parameter '{fqn}' is an NF4 (QLoRA) base weight and its rule shards it as "
                f"{spec!r}: torchao's NF4 tensor composes with FSDP2 (data-parallel shards) but "
                "not with tensor parallelism. Replicate it over the model axes (P()) and shard "
                "it with FSDP, or do not quantize the base.",
                fqn=fqn,
                spec=spec,
            )
