"""Context parallelism in the plan: which mesh axis splits each sequence, and what it refuses.

A logical activation rule ``("seq", "cp")`` onto an axis that no parameter is sharded over, that
is neither a data axis nor the pipeline axis, makes that axis the plan's *context axis*
(``Plan.context_axis``). Every rank of a context group holds the same batch rows and one
load-balanced share of each sequence (``context_balance``: "headtail" gives rank ``r`` chunks
``r`` and ``2·cp-1-r`` of ``2·cp``, so causal attention costs every rank the same); attention
circulates keys and values around the group (``context_method="ring"``) or gathers them
(``"allgather"``). Parameters stay replicated over the axis and their gradients are reduced over
the data axes and the context axis together (FSDP shards over both, as torchtitan's
``dp_shard_cp``; under HSDP the shard axis and the context axis, replicated over the replicate
axis); the loss counts the tokens of every rank of both.

Pure: reads rules, the mesh and the model's modules; raises :class:`PlanError` while planning.

Example:
    >>> import meshtrain as mt
    >>> mesh = mt.make_mesh(dp=2, cp=2, world_size=4, abstract=True)
    >>> rules = mt.Rules({".*": mt.P()}, fsdp="dp", logical=[("seq", "cp")])
    >>> context_axis_of(rules, mesh, ("dp",), None)
    'cp'
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from meshtrain.errors import PlanError
from meshtrain.plan.options import PlanOptions
from meshtrain.spec.mesh import Mesh
from meshtrain.spec.rules import Resolution, Rules

#: the attention implementations of ``transformers`` models whose attention can be replaced
_HF_ATTENTION = ("sdpa",)


def context_axis_of(
    rules: Rules,
    mesh: Mesh,
    data_axes: Sequence[str],
    pipeline_axis: str | None,
    param_axes: Sequence[str] = (),
) -> str | None:
    """The mesh axis (larger than 1) the ``seq`` activation rule maps to that is neither a data
    axis, the pipeline axis nor an axis parameters are sharded over (``param_axes``: the tensor
    axis, whose ``seq`` entry is sequence parallelism); ``None`` when there is none."""
    if not any(name == "seq" for name, _ in rules.logical):
        return None
    axes = [axis for axis in rules.logical_spec(("seq",), mesh).axes if mesh.size(axis) > 1]
    found = [a for a in axes if a not in data_axes and a != pipeline_axis and a not in param_axes]
    if len(found) > 1:
        raise PlanError(
            f"the activation rule for 'seq' maps the sequence dim to {found} on mesh {mesh}; "
            "context parallelism splits it over one axis. Use one, e.g. ('seq', 'cp').",
            rule=f"('seq', {axes!r})",
            mesh=mesh,
        )
    return found[0] if found else None


def param_axes(resolution: Resolution) -> tuple[str, ...]:
    """The mesh axes some parameter spec shards over."""
    return tuple(sorted({axis for param in resolution.params for axis in param.spec.axes}))


def check_context(
    mesh: Mesh,
    axis: str,
    options: PlanOptions,
    *,
    data_axes: Sequence[str],
    tp_axis: str | None,
) -> None:
    """What context parallelism composes with in this version: data parallelism (FSDP over one
    data axis, or HSDP over two: replicated over the first, sharded over the second and the
    context axis together; any ZeRO stage), tensor parallelism (with or without sequence
    parallelism, on its own axis), pipelines whose schedule runs backward whole, activation
    checkpointing, bf16/fp16 and torch.compile (context attention left eager between compiled
    graphs). Schedules that split backward into input and weight halves, HSDP together with a
    pipeline or with tensor parallelism, compile with fullgraph and a sequence that does not
    split into ``2·cp`` chunks are refused, naming the combination."""
    ways = mesh.size(axis)
    pipeline = options.pipeline
    combos = [
        (
            pipeline is not None and pipeline.splits_backward,
            f"the pipeline schedule {pipeline.schedule if pipeline else ''!r}, which splits "
            "backward into input and weight halves",
        ),
        (
            pipeline is not None and len(data_axes) > 1,
            f"HSDP over {list(data_axes)} together with a pipeline over "
            f"'{pipeline.axis if pipeline else ''}' (not proven: it takes 16 ranks)",
        ),
        (
            tp_axis is not None and mesh.size(tp_axis) > 1 and len(data_axes) > 1,
            f"HSDP over {list(data_axes)} together with tensor parallelism over '{tp_axis}' "
            "(not proven: it takes 16 ranks)",
        ),
        (
            options.compile and options.compile_fullgraph,
            "torch.compile with fullgraph=True (context attention runs eagerly between "
            "compiled graphs, a deliberate graph break; compile with {'fullgraph': False})",
        ),
    ]
    for refused, what in combos:
        if refused:
            raise PlanError(
                f"context parallelism over '{axis}' (size {ways}) on mesh {mesh} does not "
                f"compose with {what} in this version of meshtrain: it would not be proven to "
                "train like one device. Drop one of them (context parallelism composes with "
                "FSDP over one data axis or HSDP over two, tensor and sequence parallelism, "
                "pipelines such as 1F1B or GPipe, activation checkpointing and bf16).",
                mesh=mesh,
            )
    check_context_length(options.seq_len, axis, mesh, options.context_balance)


def check_context_length(seq_len: int | None, axis: str, mesh: Mesh, balance: str) -> None:
    """Head-tail balancing cuts each sequence into ``2·cp`` equal chunks (``cp`` contiguous
    ones otherwise)."""
    ways = mesh.size(axis)
    chunks = 2 * ways if balance == "headtail" else ways
    if seq_len is not None and seq_len % chunks:
        raise PlanError(
            f"seq_len={seq_len} does not split into {chunks} equal chunks, which context "
            f"parallelism over '{axis}' (cp={ways}, balance={balance!r}) gives its ranks on mesh "
            f"{mesh}. Use a sequence length that is a multiple of {chunks} (e.g. "
            f"{seq_len + chunks - seq_len % chunks}).",
            mesh=mesh,
        )


def check_context_sequence_parallel(
    seq_len: int | None, axis: str, tp_axis: str, mesh: Mesh
) -> None:
    """Sequence parallelism splits each context rank's share of a sequence over ``tp_axis``."""
    ways, tp = mesh.size(axis), mesh.size(tp_axis)
    if seq_len is not None and (seq_len // ways) % tp:
        raise PlanError(
            f"seq_len={seq_len} leaves each of the cp={ways} ranks of '{axis}' {seq_len // ways} "
            f"tokens, which sequence parallelism cannot split over '{tp_axis}' (size {tp}) on "
            f"mesh {mesh}. Use a sequence length that is a multiple of {2 * ways * tp}.",
            mesh=mesh,
        )


def check_context_model(model: nn.Module, axis: str) -> str:
    """How the lowering reaches ``model``'s attention under context parallelism: ``"meshtrain"``
    (meshtrain's Llama: attention modules with an ``attention_fn`` attribute, and a
    ``positions`` argument to the model's forward) or ``"transformers"``
    (a ``transformers`` model with SDPA attention: an attention function registered and chosen
    in its config, and ``position_ids`` passed). Anything else, and modules it cannot split
    along the sequence, are a :class:`PlanError` naming them."""
    _refuse_modules(model, axis)
    if any(hasattr(module, "attention_fn") for module in model.modules()):
        return "meshtrain"
    config = getattr(model, "config", None)
    implementation = getattr(config, "_attn_implementation", None)
    if config is None or implementation is None:
        raise PlanError(
            f"context parallelism over '{axis}' cannot place the attention of "
            f"{type(model).__name__}: it replaces the attention of meshtrain's Llama and of "
            "transformers models (their attention function), and this model is neither. Train it "
            "without the ('seq', ...) context rule, or write it with one of those attentions.",
            fqn="",
        )
    if implementation not in _HF_ATTENTION and not str(implementation).startswith("meshtrain_"):
        raise PlanError(
            f"{type(model).__name__} uses attn_implementation={implementation!r}, which context "
            f"parallelism over '{axis}' does not know how to split (it replaces {_HF_ATTENTION}). "
            "Load the model with attn_implementation='sdpa'.",
            fqn="",
        )
    if getattr(config, "attention_dropout", 0.0):
        raise PlanError(
            f"{type(model).__name__} has attention_dropout={config.attention_dropout}, whose "
            f"random mask context parallelism over '{axis}' cannot draw as one device does. "
            "Set config.attention_dropout = 0.",
            fqn="",
        )
    return "transformers"


def _refuse_modules(model: nn.Module, axis: str) -> None:
    """BatchNorm (statistics over the whole sequence) and learned absolute position embeddings
    of a model that takes no ``position_ids`` cannot be split along the sequence."""
    for fqn, module in model.named_modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            raise PlanError(
                f"module '{fqn}' ({type(module).__name__}) normalises over the sequence, which "
                f"context parallelism over '{axis}' splits: each rank would use its chunk's "
                "statistics. Use a per-token normalisation (LayerNorm, RMSNorm) or drop the "
                "('seq', ...) context rule.",
                fqn=fqn,
            )
        if isinstance(module, nn.Embedding) and "position" in fqn.lower():
            forward = getattr(type(model), "forward", None)
            names = getattr(getattr(forward, "__code__", None), "co_varnames", ())
            if "position_ids" not in names:
                raise PlanError(
                    f"module '{fqn}' is a learned position embedding and "
                    f"{type(model).__name__}.forward takes no position_ids, so context "
                    f"parallelism over '{axis}' cannot give each chunk its true positions. Drop "
                    "the ('seq', ...) context rule.",
                    fqn=fqn,
                )


def attention_shape_error(q: tuple[int, ...], k: tuple[int, ...], v: tuple[int, ...]) -> str | None:
    """Why context attention cannot take queries, keys and values of these shapes (``[B, H, S,
    D]``, keys and values alike, grouped-query heads), or None. The lowering's check
    (:mod:`meshtrain.lower.context.ring_attention`) and the plan-time abstract run share it.

    Example:
        >>> attention_shape_error((2, 4, 8, 16), (2, 4, 8, 16), (2, 4, 8, 8))
        'q (2, 4, 8, 16), k (2, 4, 8, 16), v (2, 4, 8, 8): q, k, v must be [B, H, S_local, D] and k, v alike (v holds 8 features per head, k 16).'
    """
    where = f"q {q}, k {k}, v {v}"
    if len(q) != 4 or len(k) != 4 or k != v:
        detail = f" (v holds {v[-1]} features per head, k {k[-1]})" if k[:-1] == v[:-1] else ""
        return f"{where}: q, k, v must be [B, H, S_local, D] and k, v alike{detail}."
    if q[0] != k[0] or q[-1] != k[-1]:
        return f"{where}: q and k must share the batch (dim 0) and head size (dim 3)."
    if q[1] % k[1]:
        return (
            f"{where}: {q[1]} query heads are not a multiple of {k[1]} key/value heads "
            "(grouped-query attention): use a query head count divisible by it."
        )
    return None
