"""The abstract run's refusals: each a :class:`~meshtrain.PlanError` naming the module, the
operation and a fix that plans (``tests/test_refusal_fixes.py`` applies each fix).

Example:
    >>> str(refuse_partial("scale", "", "", "aten.mul.Tensor", "tp")).split(":")[0]
    "parameter 'scale' is replicated over tensor-parallel axis 'tp' and meets activations sharded over it in aten.mul.Tensor inside '<root>'"
"""

from __future__ import annotations

from meshtrain.errors import PlanError


def mixed(
    where: str, fqn: str | None, func: object, axis: str, described: str, error: str
) -> PlanError:
    return PlanError(
        f"module {where} would fail on a rank of this plan: {func} mixes tensors sharded over "
        f"tensor-parallel axis '{axis}' with whole ones ({described}: {error}); e.g. a bias or "
        "position table that always has every head added to a rank's heads. Shard that tensor "
        "with the heads, or replicate the tensor-parallel projections feeding this module "
        "(spec P()).",
        fqn=fqn,
    )


def lost(
    where: str,
    fqn: str | None,
    func: object,
    described: str,
    shapes: str,
    selects: bool,
    sequence: bool,
) -> PlanError:
    what = (
        "selects or reduces along the sharded dim (a position such as x[:, 0], or a sum "
        "over it), so each rank computes a different value than one device"
        if selects
        else "gives a tensor that is no shard of one device's"
    )
    fix = (
        "Keep this module's tensor-parallel Linears replicated (spec P()) so that meshtrain "
        "gathers the sequence before it, or drop sequence parallelism (the ('seq', ...) rule)."
        if sequence
        else "Run this module on whole activations: replicate the tensor-parallel weights feeding "
        "it (spec P())."
    )
    return PlanError(
        f"module {where} computes the wrong shard on a rank of this plan: {func} on {described} "
        f"{what}{shapes}. {fix}",
        fqn=fqn,
    )


def global_reshape(
    where: str,
    fqn: str | None,
    func: object,
    described: str,
    dim: int,
    whole: str,
    expected: int | None,
) -> PlanError:
    return PlanError(
        f"module {where} reshapes with a global size: {func} turns {described} into a shard on "
        f"dim {dim} of {whole}, where one device's shard would be on dim {expected} — e.g. "
        "view(bsz, -1, num_heads, head_dim) with the model's whole head count on a rank holding "
        "a part of the heads: the -1 absorbs the missing heads into another dim and every shape "
        "still lines up. Replicate the tensor-parallel projections of this module (spec P()), or "
        "make the module reshape with sizes read off its input (x.shape) or its per-rank head "
        "count.",
        fqn=fqn,
    )


def refuse_partial(param: str, owner: str, where: str, op: str, axis: str) -> PlanError:
    return PlanError(
        f"parameter '{param}' is replicated over tensor-parallel axis '{axis}' and meets "
        f"activations sharded over it in {op} inside '{where or '<root>'}': each rank's gradient "
        f"would be a partial sum. meshtrain all-reduces such a gradient only when its module "
        f"('{owner or '<root>'}') takes the sharded activation as its first input and has no "
        "tensor-parallel style of its own. Shard the parameter with the activation, move it into "
        "a module that takes the shard, or replicate the projections feeding it (spec P()).",
        fqn=param,
    )


def sharded_read(param: str, reader: str, owners: tuple[str, ...], axis: str) -> PlanError:
    owner = owners[0] or "<root>"
    return PlanError(
        f"parameter '{param}' is sharded over tensor-parallel axis '{axis}' (its module "
        f"'{owner}' is lowered with a tensor-parallel style) and read outside that module's "
        f"forward by '{reader or '<root>'}' (e.g. a tied head F.linear(h, embed.weight)): there "
        "each rank holds a shard, not the weight one device uses. Replicate it (spec P() for "
        f"'{param}'), or compute through '{owner}' itself.",
        fqn=param,
    )


def unproven(axis: str | None, why: str) -> PlanError:
    where = f"this tensor-parallel plan over '{axis}'" if axis else "this plan"
    return PlanError(
        f"{where} cannot be proven while planning: {why}. Without the proof, replicated "
        "parameters computing on activations sharded over the axis (per-head norms) would train "
        "with unreduced partial gradients, and buffers written from the batch would drift "
        "between ranks. Pass example_inputs= (one batch of the model's inputs), make the module "
        "run on fake tensors, or plan with unproven_shards='note' to train unproven.",
    )


def no_probe(why: str) -> PlanError:
    return PlanError(
        f"{why}: pass example_inputs= (one batch of its inputs, e.g. mt.plan(..., "
        "example_inputs=images)) so the plan can be proven while planning."
    )


def batch_buffers(found: dict[str, str], data: list[str]) -> PlanError:
    buffer, module = next(iter(found.items()))
    return PlanError(
        f"buffer '{buffer}' is written from the batch in the forward of '{module or '<root>'}' "
        f"(e.g. a running mean): under data parallelism over {data} each rank would update it "
        f"from its own rows and it would drift from one device's ({len(found)} such buffer"
        f"{'s' if len(found) > 1 else ''}: {sorted(found)}). Plan with batch_buffers='average' "
        "to average it over the data-parallel ranks after each forward (exact for a statistic "
        "linear in the batch, such as a running mean, with equal rows per rank), or make it a "
        "non-persistent value computed outside the model.",
        fqn=buffer,
    )
