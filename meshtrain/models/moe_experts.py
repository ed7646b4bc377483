"""The routed half of a mixture-of-experts layer: :class:`Router` (top-k over per-expert scores)
and :class:`GroupedExperts` (every expert's SwiGLU, weights fused in 3-D tensors).

:class:`GroupedExperts` has transformers 5.24's expert layout and signature
(``Qwen3MoeExperts``, ``MixtralExperts``): ``gate_up_proj`` ``[experts, 2·inter, dim]``,
``down_proj`` ``[experts, dim, inter]`` and ``forward(hidden, top_k_index, top_k_weights)``. It
reads ``num_experts`` and touches experts only through the indices it is given, so a lowering
that holds a slice of the experts (local experts ``0 .. num_experts - 1``) calls the same forward
on the tokens routed to it.

The combine is the numerical contract: the pairs ``(token, slot)`` are sorted by expert with a
stable sort (so within an expert, by token, then by slot), each expert's rows run through its
SwiGLU (one grouped matrix multiply per projection with ``torch._grouped_mm``, or a loop over
experts), each result is multiplied by its weight, and token ``t``'s output is then summed over its
slots left to right in the router's order: ``((w₀·e₀ + w₁·e₁) + w₂·e₂) + …``. With top-2 the sum
is one addition, which is commutative, so any implementation that adds the two products in
either order (transformers' ``index_add_`` over experts included) gives the same bits from the
same products.

Example:
    >>> experts = GroupedExperts(4, dim=8, inter=4)
    >>> _ = torch.nn.init.normal_(experts.gate_up_proj); _ = torch.nn.init.normal_(experts.down_proj)
    >>> index, weights = torch.tensor([[0, 3], [2, 0]]), torch.full((2, 2), 0.5)
    >>> experts(torch.randn(2, 8), index, weights).shape
    torch.Size([2, 8])
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from meshtrain.errors import PlanError
from meshtrain.models.llama import _Init, _Initialised, is_dtensor
from meshtrain.spec.logical import annotate

__all__ = [
    "KERNELS",
    "CountReducer",
    "GroupedExperts",
    "Router",
    "batch_counts",
    "grouped_mm_supported",
    "load_balance_loss",
    "recomputing",
]

#: The expert kernels :class:`GroupedExperts` takes.
KERNELS: tuple[str, ...] = ("auto", "grouped_mm", "loop")
SCORE_FUNCS = ("softmax", "sigmoid")
_GROUPED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class Router(_Initialised):
    """Scores every expert for each token and picks the top ``top_k``.

    ``forward(hidden [T, dim])`` returns ``(top_k_index [T, k] int64, top_k_weights [T, k],
    scores [T, experts] fp32)``: ``scores`` are ``softmax`` or ``sigmoid`` of the logits, in
    fp32; the experts are chosen by ``scores`` (plus ``expert_bias`` under loss-free balancing,
    for the choice only); the weights are the chosen experts' scores, renormalised to sum to 1
    when ``norm_topk_prob``, times ``route_scale``, in the hidden states' dtype. Ties are broken
    by ``torch.topk``, which is deterministic for identical inputs on one device type, so every
    rank that routes the same tokens with the same weights picks the same experts.

    Counts of tokens per expert (``tokens_per_expert``: the last forward's, or under
    :meth:`begin_step` every forward of the step — a train step that accumulates micro-batches
    counts its whole batch, as one device's one forward does; ``pending_tokens``: every forward
    since the last :meth:`update_bias`) are kept for statistics and balancing; forwards in
    eval mode (``model.eval()``: an evaluation between steps) count nothing, so evaluating
    never moves the loss-free balancing bias. They are the
    whole batch's: with a ``count_reducer`` (a :data:`CountReducer`, set by the MoE layer's
    ``set_count_reducer``, which lowering installs) each forward sums its counts over the ranks
    that split the batch (one all-reduce of ``experts + 2`` integers, kept with the token and rank
    numbers in ``last_batch_counts``), so every rank holds what one device holds. A forward re-run
    in backward (activation checkpointing) neither counts nor reduces again. ``expert_bias``
    (``bias_balancing``) is created in fp32; keep it there (``model.to(torch.bfloat16)`` casts
    buffers too, and bf16 cannot resolve steps of 1e-3 around a bias of 1).

    Example:
        >>> router = Router(dim=8, num_experts=4, top_k=2)
        >>> _ = torch.nn.init.normal_(router.weight)
        >>> index, weights, scores = router(torch.randn(5, 8))
        >>> index.shape, int(router.tokens_per_expert.sum())
        (torch.Size([5, 2]), 10)
    """

    tokens_per_expert: Tensor
    pending_tokens: Tensor
    expert_bias: Tensor | None
    count_reducer: CountReducer | None
    last_batch_counts: Tensor | None

    def __init__(
        self,
        dim: int,
        num_experts: int,
        top_k: int,
        *,
        score_func: str = "softmax",
        norm_topk_prob: bool = True,
        route_scale: float = 1.0,
        bias_balancing: bool = False,
    ) -> None:
        super().__init__()
        if score_func not in SCORE_FUNCS:
            raise PlanError(f"Router score_func={score_func!r}: choose one of {SCORE_FUNCS}.")
        self.num_experts, self.top_k = num_experts, top_k
        self.score_func, self.norm_topk_prob, self.route_scale = (
            score_func,
            norm_topk_prob,
            route_scale,
        )
        self.weight = nn.Parameter(torch.empty(num_experts, dim))
        annotate(self, weight=(None, "embed"))  # never sharded over experts: every rank routes
        self.register_buffer(
            "tokens_per_expert", torch.zeros(num_experts, dtype=torch.long), persistent=False
        )
        self.register_buffer(
            "pending_tokens", torch.zeros(num_experts, dtype=torch.long), persistent=False
        )
        bias = torch.zeros(num_experts, dtype=torch.float32) if bias_balancing else None
        self.register_buffer("expert_bias", bias)  # in checkpoints: a run resumes its balance
        self.count_reducer = None
        self.last_batch_counts = None
        self.counting_step = False

    def begin_step(self) -> None:
        """A train step starts: ``tokens_per_expert`` restarts and sums this step's forwards
        (its micro-batches) from now on."""
        self.counting_step = True
        if not self.tokens_per_expert.is_meta:
            self.tokens_per_expert.zero_()

    def forward(self, hidden: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        logits = F.linear(hidden, self.weight).float()
        scores = logits.softmax(-1) if self.score_func == "softmax" else logits.sigmoid()
        choice = scores if self.expert_bias is None else scores.detach() + self.expert_bias
        top_k_index = torch.topk(choice, self.top_k, dim=-1, sorted=True).indices
        weights = scores.gather(-1, top_k_index)
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        self._count(top_k_index)
        return top_k_index, (weights * self.route_scale).to(hidden.dtype), scores

    @torch.no_grad()
    def _count(self, top_k_index: Tensor) -> None:
        if recomputing():  # counted (and reduced) by the forward it repeats
            return
        summed = batch_counts(top_k_index, self.num_experts, self.count_reducer)
        self.last_batch_counts = summed
        if not self.training:  # an evaluation's forward: no step's statistics, no balancing
            return
        if self.counting_step:
            self.tokens_per_expert.add_(summed[:-2])
        else:
            self.tokens_per_expert.copy_(summed[:-2])
        self.pending_tokens.add_(summed[:-2])

    @torch.no_grad()
    def update_bias(self, global_counts: Tensor, update_rate: float) -> None:
        """DeepSeek-V3's loss-free balancing step, after an optimizer step:
        ``expert_bias += update_rate · sign(mean load - load)``, then ``pending_tokens`` restarts.

        ``global_counts`` ``[experts]`` must already be the tokens per expert summed over every
        rank that routed a share of the step's batch (all-reduce :attr:`pending_tokens` first):
        each rank's own counts would move each rank's bias differently, and the replicas would
        route differently from then on.

        Example:
            >>> router = Router(dim=4, num_experts=3, top_k=1, bias_balancing=True)
            >>> router.update_bias(torch.tensor([6, 2, 1]), update_rate=0.5)
            >>> router.expert_bias.tolist()
            [-0.5, 0.5, 0.5]
        """
        if self.expert_bias is None:
            raise PlanError(
                "Router.update_bias on a router built without bias balancing: build the model "
                'with MoEConfig(balance="bias") to use loss-free balancing.'
            )
        load = global_counts.to(device=self.expert_bias.device, dtype=torch.float32)
        self.expert_bias.add_(update_rate * torch.sign(load.mean() - load))
        self.pending_tokens.zero_()

    def _init_table(self) -> dict[str, _Init]:
        return {"weight": _Init(std=0.02)}

    def reset_buffers(self) -> None:
        """Zero the counts and the balancing bias (a fresh model's state)."""
        for buffer in (self.tokens_per_expert, self.pending_tokens, self.expert_bias):
            if buffer is not None and not buffer.is_meta:
                buffer.zero_()


#: Sums a tensor elementwise over the ranks that split the batch (a collective: every one of
#: them calls it alike) and returns the sum; installed by lowering (``set_count_reducer``), or
#: ``None`` for one process.
CountReducer = Callable[[Tensor], Tensor]


def recomputing() -> bool:
    """Whether this forward is a recomputation inside backward (activation checkpointing reruns
    the forward while autograd's engine runs a graph task; an ordinary forward runs outside one).

    Example:
        >>> recomputing()
        False
    """
    return bool(torch._C._current_graph_task_id() != -1)


def batch_counts(top_k_index: Tensor, num_experts: int, reduce: CountReducer | None) -> Tensor:
    """``[experts + 2]`` int64: the tokens routed to each expert, the number of tokens and the
    number of ranks (1 per process), summed by ``reduce`` over the ranks that split the batch
    (one collective; without ``reduce``, this process's alone).

    Example:
        >>> batch_counts(torch.tensor([[0, 2], [2, 1]]), 3, None).tolist()
        [1, 1, 2, 2, 1]
        >>> batch_counts(torch.tensor([[0, 2], [2, 1]]), 3, lambda c: 2 * c).tolist()
        [2, 2, 4, 4, 2]
    """
    counts = torch.bincount(top_k_index.flatten(), minlength=num_experts)
    local = torch.cat([counts, counts.new_tensor([top_k_index.shape[0], 1])])
    return reduce(local) if reduce is not None else local


def load_balance_loss(
    scores: Tensor,
    top_k_index: Tensor,
    num_experts: int,
    reduce: CountReducer | None = None,
    *,
    summed: Tensor | None = None,
) -> Tensor:
    """Switch Transformer's balance loss for one layer, as transformers computes it for one:
    ``num_experts · Σₑ fₑ · Pₑ``, where ``fₑ`` is the fraction of tokens whose top-k includes
    expert ``e`` (so ``Σₑ fₑ = k``) and ``Pₑ`` the mean probability of ``e`` (scores
    renormalised to sum to 1 per token; softmax scores already do). ``k`` under uniform routing.
    Only ``Pₑ`` carries a gradient.

    With the batch split over ``R`` ranks, ``reduce`` (a :data:`CountReducer` over them) sums
    the counts and token numbers first, and each rank returns its *share*
    ``aᵣ = num_experts · Σₑ fₑᵍ · Sₑʳ · R / Tᵍ``: ``fₑᵍ`` the global fraction (a count: no
    gradient), ``Sₑʳ`` the sum of ``e``'s probabilities over this rank's ``Tʳ`` tokens, ``Tᵍ``
    the global tokens. Then ``(1/R) Σᵣ aᵣ = num_experts · Σₑ fₑᵍ · (Σᵣ Sₑʳ / Tᵍ)``, one device's
    loss on the whole batch, and since ``fₑᵍ`` is a constant, ``(1/R) Σᵣ ∂aᵣ/∂θ`` is its
    gradient: the data-parallel mean of each rank's gradient of its share is exactly one
    device's. With equal shares (``Tʳ = Tᵍ/R``) ``aᵣ = num_experts · Σₑ fₑᵍ · Pₑʳ``, the
    global fractions against the local mean probabilities. ``summed``: these indices'
    :func:`batch_counts` already reduced (a router's ``last_batch_counts``), taken instead of
    calling ``reduce`` again.

    Example:
        >>> scores = torch.full((4, 2), 0.5)
        >>> float(load_balance_loss(scores, torch.tensor([[0], [1], [0], [1]]), 2))
        1.0
        >>> float(load_balance_loss(scores, torch.tensor([[0], [1], [0], [1]]), 2, lambda c: 2 * c))
        1.0
    """
    probs = scores / scores.sum(-1, keepdim=True)
    if reduce is None and summed is None:
        counts = torch.bincount(top_k_index.flatten(), minlength=num_experts)
        fraction = counts.to(probs.dtype) / top_k_index.shape[0]
        return num_experts * (fraction * probs.mean(0)).sum()
    if summed is None:
        summed = batch_counts(top_k_index, num_experts, reduce)
    tokens, ranks = summed[-2].to(probs.dtype), summed[-1].to(probs.dtype)
    fraction = summed[:-2].to(probs.dtype) / tokens
    return num_experts * (fraction * probs.sum(0)).sum() * (ranks / tokens)


class GroupedExperts(_Initialised):
    """Every expert's SwiGLU ``down(silu(gate(x)) · up(x))``, weights fused over experts (see the
    module docstring for the layout and the combine's order).

    ``kernel``: ``"grouped_mm"`` (one ``torch._grouped_mm`` per projection over all experts),
    ``"loop"`` (one pair of matmuls per expert that has tokens) or ``"auto"`` (grouped when
    :func:`grouped_mm_supported` says torch can run it on these tensors, else the loop).
    ``out_std`` is ``down_proj``'s init std (the depth init of the block holding it).
    """

    def __init__(
        self,
        num_experts: int,
        dim: int,
        inter: int,
        *,
        kernel: str = "auto",
        out_std: float = 0.02,
    ) -> None:
        super().__init__()
        if kernel not in KERNELS:
            raise PlanError(f"GroupedExperts kernel={kernel!r}: choose one of {KERNELS}.")
        self.num_experts, self.kernel, self.out_std = num_experts, kernel, out_std
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * inter, dim))
        self.down_proj = nn.Parameter(torch.empty(num_experts, dim, inter))
        annotate(
            self,
            gate_up_proj=("expert", "expert_mlp", "embed"),
            down_proj=("expert", "embed", "expert_mlp"),
        )

    def forward(self, hidden: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        tokens, top_k = top_k_index.shape
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)  # by expert, then token, then slot
        counts = torch.bincount(flat, minlength=self.num_experts)
        routed = hidden[order // top_k]
        if self._use_grouped_mm(routed):
            out = _grouped_swiglu(routed, counts, self.gate_up_proj, self.down_proj)
        else:
            out = _looped_swiglu(routed, counts, self.gate_up_proj, self.down_proj)
        out = out * top_k_weights.reshape(-1)[order, None].to(out.dtype)
        by_slot = out[torch.argsort(order)].view(tokens, top_k, -1)  # back to (token, slot)
        combined = by_slot[:, 0]
        for slot in range(1, top_k):  # the contract's order: slots left to right
            combined = combined + by_slot[:, slot]
        return combined.to(hidden.dtype)

    def _use_grouped_mm(self, routed: Tensor) -> bool:
        if self.kernel == "loop":
            return False
        supported = grouped_mm_supported(routed, self.gate_up_proj, self.down_proj)
        if self.kernel == "grouped_mm" and not supported:
            raise PlanError(
                f"GroupedExperts(kernel='grouped_mm') cannot run torch._grouped_mm on "
                f"{routed.dtype} {routed.device.type} tensors with gate_up_proj "
                f"{tuple(self.gate_up_proj.shape)} and down_proj {tuple(self.down_proj.shape)} "
                "(it needs fp32/bf16/fp16 plain tensors, bf16 on CUDA, and dim and inter multiples "
                "of 16 bytes' worth of elements). Use kernel='auto' to fall back to the loop."
            )
        return supported

    def _init_table(self) -> dict[str, _Init]:
        return {"gate_up_proj": _Init(std=0.02), "down_proj": _Init(std=self.out_std)}


def grouped_mm_supported(routed: Tensor, gate_up_proj: Tensor, down_proj: Tensor) -> bool:
    """Whether ``torch._grouped_mm`` runs these tensors: it exists, nothing is a DTensor, one
    dtype among fp32/bf16/fp16 (bf16 alone on CUDA), and every matrix row 16-byte aligned (fp32
    widths a multiple of 4, bf16 of 8).

    Example:
        >>> w = torch.empty(2, 8, 4), torch.empty(2, 4, 4)
        >>> grouped_mm_supported(torch.empty(3, 4), *w), grouped_mm_supported(torch.empty(3, 4).double(), *w)
        (True, False)
    """
    tensors = (routed, gate_up_proj, down_proj)
    if not hasattr(torch, "_grouped_mm") or any(is_dtensor(t) for t in tensors):
        return False
    dtype = routed.dtype
    if dtype not in _GROUPED_DTYPES or any(t.dtype != dtype for t in tensors):
        return False
    if routed.device.type == "cuda" and dtype != torch.bfloat16:
        return False
    if routed.device.type not in ("cpu", "cuda"):
        return False
    per_row = 16 // routed.element_size()
    return all(size % per_row == 0 for size in (*gate_up_proj.shape[1:], down_proj.shape[2]))


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous: ``torch._grouped_mm``'s
    backward rejects an expanded gradient (what ``out.sum()`` sends back)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return grad.contiguous()


def _grouped_swiglu(routed: Tensor, counts: Tensor, gate_up: Tensor, down: Tensor) -> Tensor:
    offsets = torch.cumsum(counts, 0).to(torch.int32)
    gate_up_out = torch._grouped_mm(routed, gate_up.transpose(-2, -1), offs=offsets)
    gate, up = _ContiguousGrad.apply(gate_up_out).chunk(2, dim=-1)
    out = torch._grouped_mm(F.silu(gate) * up, down.transpose(-2, -1), offs=offsets)
    return _ContiguousGrad.apply(out)


def _looped_swiglu(routed: Tensor, counts: Tensor, gate_up: Tensor, down: Tensor) -> Tensor:
    # split/unbind rather than slicing: their backward is one cat/stack, where each slice's
    # backward would fill a zero tensor the size of the whole input
    rows = routed.split(counts.tolist())
    pieces = [
        _swiglu(block, gate_up_e, down_e)
        for block, gate_up_e, down_e in zip(rows, gate_up.unbind(0), down.unbind(0))
        if block.shape[0]
    ]
    return torch.cat(pieces) if pieces else routed.new_zeros(0, down.shape[1])


def _swiglu(rows: Tensor, gate_up: Tensor, down: Tensor) -> Tensor:
    gate, up = F.linear(rows, gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, down)
