"""Context parallelism lowered onto models as they are: each rank of the plan's context axis
computes its share of every sequence, attention included.

Three things change, none of them the model's code:

- **attention**: meshtrain's Llama gets an ``attention_fn`` on each attention module; a
  ``transformers`` model gets an attention function registered in ``ALL_ATTENTION_FUNCTIONS``
  (with a mask function that builds no mask: the visibility is computed from true positions)
  and its config's ``_attn_implementation`` pointed at it. Both call
  :func:`~meshtrain.lower.context.ring_attention.context_attention`, which gives this rank's queries one
  device's attention over the whole sequence (ring or all-gather over the context group), with
  the module's causality, sliding window, scaling and grouped-query heads. Being the module's
  own call, it runs again as it should when activation checkpointing recomputes a block.
- **positions**: a forward pre-hook passes the rank's true positions (``positions`` to
  meshtrain's Llama, ``position_ids`` to a ``transformers`` model), so rotary tables are those
  of the chunks the rank holds.
- **packed documents**: when the caller passes ``[batch, seq]`` positions (the rank's chunks
  of positions that restart at each packed document, cut by :func:`shard_batch`), the hook
  gathers the whole sequences' positions over the context group (one all-gather of
  ``B·S`` int64 per forward), reads the document ids from them
  (:func:`~meshtrain.spec.packing.document_ids`, the rule of ``transformers``) and passes this
  rank's share to attention, which then sees keys only within each query's document: the
  block-diagonal causal mask one device applies.
- **the batch**: :func:`shard_batch` (``mt.shard_batch``) slices inputs and targets of a step
  along the sequence into the rank's chunks (the train step calls it, see
  :mod:`meshtrain.train.step`; a loop of one's own calls it before the forward).

Example (on every rank of a 4-rank job, inside :func:`~meshtrain.lower.apply`)::

    plan = mt.plan(model, mt.make_mesh(dp=2, cp=2), rules_with_seq_on_cp)
    apply_context_parallel(plan, model)
"""

from __future__ import annotations

import functools
import importlib
import inspect
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed import ProcessGroup

from meshtrain.errors import PlanError, format_shape
from meshtrain.lower.compute import eager_island
from meshtrain.lower.context.layout import chunk_positions, shard_sequence, unshard_sequence
from meshtrain.lower.context.ring_attention import context_attention
from meshtrain.lower.groups import axis_group
from meshtrain.plan.context.axis import check_context_model
from meshtrain.plan.ir import Plan
from meshtrain.spec.packing import document_ids

#: the name the attention (and mask) function is registered under in ``transformers``
HF_ATTENTION = "meshtrain_context"
#: the keyword that carries a rank's document ids through a ``transformers`` model's forward
#: to :func:`hf_context_attention` (its keyword arguments reach the attention function)
HF_DOCUMENTS = "meshtrain_documents"


@dataclass(frozen=True)
class ContextGroup:
    """This rank's place in its context group: the group, its size, this rank's index in it,
    the load balancer and the attention method."""

    group: ProcessGroup
    size: int
    rank: int
    balance: str
    method: str

    def positions(self, local_len: int, device: torch.device) -> torch.Tensor:
        """The true positions of this rank's ``local_len`` tokens of a sequence."""
        return _positions(local_len * self.size, self.size, self.rank, self.balance).to(device)

    def documents(self, positions: torch.Tensor) -> torch.Tensor:
        """The document ids ``[B, S_local]`` of this rank's tokens, from their positions
        ``[B, S_local]`` (this rank's chunks of positions restarting at each document): the
        whole sequences' positions are gathered, split into documents as one device does
        (:func:`~meshtrain.spec.packing.document_ids`), and this rank's chunks kept."""
        rows = positions.to(torch.int64).contiguous()
        if self.size > 1:
            gathered = funcol.wait_tensor(funcol.all_gather_single(rows, 0, self.group))
            rows = gathered.view(self.size, *rows.shape).permute(1, 0, 2).flatten(1)
        whole = unshard_sequence(rows, 1, self.size, self.balance)  # type: ignore[arg-type]
        ids = document_ids(whole)
        return shard_sequence(ids, 1, self.size, self.rank, self.balance)  # type: ignore[arg-type]

    # An eager island under torch.compile, the positions' cached lookup included.
    @eager_island
    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        causal: bool = True,
        window: int | None = None,
        scale: float | None = None,
        documents: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One device's attention for this rank's queries (``[B, H, S_local, D]``); with
        ``documents`` (``[B, S_local]`` ids, :meth:`documents`), within each document."""
        return context_attention(
            q,
            k,
            v,
            group=self.group,
            positions_q=self.positions(q.shape[2], q.device),
            causal=causal,
            window=window,
            scale=scale,
            method=self.method,  # type: ignore[arg-type]
            documents=documents,
        )


@functools.lru_cache(maxsize=64)
def _positions(seq_len: int, cp: int, rank: int, balance: str) -> torch.Tensor:
    return chunk_positions(seq_len, cp, rank, balance)  # type: ignore[arg-type]


def context_group(plan: Plan) -> ContextGroup | None:
    """This rank's :class:`ContextGroup` under ``plan`` (``None`` without a context axis)."""
    if plan.context_axis is None:
        return None
    group = axis_group(plan.mesh, plan.context_axis)
    options = plan.options
    return ContextGroup(
        group,
        dist.get_world_size(group),
        dist.get_rank(group),
        options.context_balance,
        options.context_method,
    )


def apply_context_parallel(plan: Plan, model: nn.Module) -> None:
    """Point ``model``'s attention at context attention and feed it true positions (see the
    module docstring); nothing without a context axis."""
    context = context_group(plan)
    if context is None:
        return
    assert plan.context_axis is not None
    if check_context_model(model, plan.context_axis) == "meshtrain":
        for module in model.modules():
            if hasattr(module, "attention_fn"):
                setattr(module, "attention_fn", functools.partial(context.attend, causal=True))  # noqa: B010
        model.register_forward_pre_hook(
            _PositionsHook(context, "positions", "documents"), with_kwargs=True
        )
        return
    register_hf_attention()
    model.config._attn_implementation = HF_ATTENTION  # type: ignore[union-attr]
    for module in model.modules():
        module._meshtrain_context = context  # type: ignore[assignment]
    model.register_forward_pre_hook(
        _PositionsHook(context, "position_ids", HF_DOCUMENTS), with_kwargs=True
    )


class _PositionsHook:
    """Adds the rank's true positions to the model's forward keywords (``[S_local]`` for
    meshtrain's Llama, ``[B, S_local]`` position ids for ``transformers``). Positions the caller
    passes as ``[B, S_local]`` are kept (packed sequences: they restart at each document), and
    the document ids read from them are added under ``documents_keyword``."""

    def __init__(self, context: ContextGroup, keyword: str, documents_keyword: str) -> None:
        self.context, self.keyword, self.documents_keyword = context, keyword, documents_keyword

    def __call__(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        tokens = args[0] if args else kwargs.get("input_ids", kwargs.get("tokens"))
        given = kwargs.get(self.keyword)
        if isinstance(given, torch.Tensor) and given.dim() == 2:
            if kwargs.get(self.documents_keyword) is not None:
                return args, kwargs
            documents = self.context.documents(given)
            return args, {**kwargs, self.documents_keyword: documents}
        if not isinstance(tokens, torch.Tensor) or self.keyword in kwargs:
            return args, kwargs
        positions = self.context.positions(tokens.shape[1], tokens.device)
        if self.keyword == "position_ids":
            positions = positions.unsqueeze(0).expand(tokens.shape[0], -1)
        return args, {**kwargs, self.keyword: positions}


def shard_batch(
    plan: Plan, *tensors: torch.Tensor, rank: int | None = None
) -> tuple[torch.Tensor, ...]:
    """This rank's chunks of each ``[batch, seq, ...]`` tensor (token ids, targets, a loss
    mask) under the plan's context axis, cut along dim 1 as the plan's balance says; the tensors
    themselves without a context axis. The train step calls it; a loop of your own calls it on
    every rank before the forward. ``rank`` (this rank's index on the context axis, taken from
    the running group by default) makes it pure, e.g. to cut a batch ahead of time.

    Example (an abstract plan: rank 1 of cp 2, head-tail chunks)::

        >>> import meshtrain as mt
        >>> from meshtrain.models import LlamaConfig, build_llama
        >>> model = build_llama(LlamaConfig.debug(), device="meta")
        >>> rules = mt.Rules({".*": mt.P()}, logical=[("seq", "cp")])
        >>> plan = mt.plan(model, mt.make_mesh(cp=2, world_size=2, abstract=True), rules)
        >>> inputs, targets = torch.arange(8).view(1, 8), torch.arange(1, 9).view(1, 8)
        >>> [t.tolist() for t in mt.shard_batch(plan, inputs, targets, rank=1)]
        [[[2, 3, 4, 5]], [[3, 4, 5, 6]]]
    """
    if plan.context_axis is None:
        return tensors
    for tensor in tensors:
        if tensor.dim() < 2:
            raise PlanError(
                f"shard_batch cuts [batch, seq, ...] tensors along dim 1 over the context axis "
                f"'{plan.context_axis}'; got one of shape {format_shape(tuple(tensor.shape))}: "
                "pass batched sequences (unsqueeze(0) a single sequence)."
            )
    cp = plan.mesh.size(plan.context_axis)
    if rank is None:  # a MeshError, naming the fix, without a process group
        rank = dist.get_rank(axis_group(plan.mesh, plan.context_axis))
    balance = plan.options.context_balance
    return tuple(shard_sequence(t, 1, cp, rank, balance) for t in tensors)


def positions_keyword(model: Any) -> str:
    """The forward keyword that takes per-token positions: ``positions`` (meshtrain's
    models) or ``position_ids`` (``transformers``); a :class:`PlanError` for a model with
    neither, which cannot be given packed sequences' positions.

    Example:
        >>> from meshtrain.models import LlamaConfig, build_llama
        >>> positions_keyword(build_llama(LlamaConfig.debug(), device="meta"))
        'positions'
    """
    parameters = inspect.signature(model.forward).parameters
    for name in ("positions", "position_ids"):
        if name in parameters:
            return name
    raise PlanError(
        f"{type(model).__name__}.forward takes neither 'positions' (meshtrain's models) nor "
        "'position_ids' (transformers), so the positions of packed documents cannot reach it: "
        "train it without document positions (data.document_mask = false), or give its "
        "forward one of those arguments."
    )


# ----------------------------------------------------------------------------- transformers


def register_hf_attention() -> None:
    """Register :func:`hf_context_attention` and a mask function that builds no mask under
    :data:`HF_ATTENTION` in ``transformers`` (idempotent)."""
    masking = importlib.import_module("transformers.masking_utils")
    modeling = importlib.import_module("transformers.modeling_utils")
    modeling.ALL_ATTENTION_FUNCTIONS.register(HF_ATTENTION, hf_context_attention)
    masking.ALL_MASK_ATTENTION_FUNCTIONS.register(HF_ATTENTION, _no_mask)


def _no_mask(*args: Any, **kwargs: Any) -> None:
    """Context attention computes visibility from true positions: no mask tensor."""
    return None


def hf_context_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    sliding_window: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """A ``transformers`` attention function (the signature of its SDPA one): this rank's
    queries' attention over the whole sequence, ``[B, S_local, H, D]``; within each packed
    document when the model's forward carried :data:`HF_DOCUMENTS` (see :class:`_PositionsHook`)."""
    context = _context_of(module)
    if attention_mask is not None or (dropout and module.training):
        raise PlanError(
            f"context attention in {type(module).__name__} got "
            f"{'an attention mask' if attention_mask is not None else f'dropout={dropout}'}, "
            "which context parallelism does not split: train without a padding mask (pack "
            "sequences) and with attention_dropout=0."
        )
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    documents = kwargs.get(HF_DOCUMENTS)
    out = context.attend(
        query,
        key,
        value,
        causal=bool(causal),
        window=sliding_window,
        scale=scaling,
        documents=documents,
    )
    return out.transpose(1, 2).contiguous(), None


def _context_of(module: nn.Module) -> ContextGroup:
    """The context group :func:`apply_context_parallel` gave the modules of ``module``'s model."""
    found = getattr(module, "_meshtrain_context", None)
    if not isinstance(found, ContextGroup):
        raise PlanError(
            f"{type(module).__name__} calls meshtrain's context attention, but its model was not "
            "lowered with context parallelism (mt.apply with a plan whose context axis is set). "
            "Set config._attn_implementation back to 'sdpa', or apply the plan."
        )
    return found
