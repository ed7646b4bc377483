"""A mixture-of-experts decoder shaped like DeepSeek-V3 and Qwen3-MoE, built from the Llama's
pieces: meshtrain's reference MoE model.

Each block is the Llama's pre-norm block (grouped-query attention with rotary embeddings,
optionally Qwen3's per-head q/k RMSNorm) whose feed-forward is either dense (the first
``first_dense_layers`` blocks, as DeepSeek's) or a :class:`MoEFeedForward`: a :class:`Router`
picks ``top_k`` of ``n_experts`` routed experts per token (:class:`GroupedExperts`, fused 3-D
weights laid out as transformers' ``Qwen3MoeExperts``), plus ``n_shared_experts`` always-on
experts fused into one SwiGLU. FQNs follow the Llama's (``layers.<i>.feed_forward.router.weight``,
``layers.<i>.feed_forward.experts.gate_up_proj``, ``layers.<i>.feed_forward.shared_expert.w1.weight``),
so a pipeline stage is this model with layers deleted, and parameters initialise from
(seed, FQN) as the Llama's do. Expert weights carry the logical axes
``("expert", "expert_mlp", "embed")``; :func:`default_rules` sends ``"expert"`` to an ``ep`` axis.

Balancing (``MoEConfig.balance``):

- ``"aux_loss"``: the Switch/Qwen balance loss (:func:`load_balance_loss`) of each MoE layer,
  trained without touching the loss function: each layer's output passes through an identity
  whose backward also sends ``aux_loss_coef · scale`` into that layer's balance loss, so one
  backward of any loss of the logits trains ``loss + aux_loss_coef · Σ_layers aux`` (Megatron's
  ``MoEAuxLossAutoScaler`` design; it works on pipeline stages, where the logits live elsewhere).
  The logits are unchanged. ``scale`` (:meth:`MoE.set_aux_loss_scale`, default 1) is what a loop
  multiplies its loss by before backward beyond the mean: ``1/N`` for ``N`` accumulated
  micro-batches each backpropagating ``loss/N``, a loss scaler's scale, and ``1/dp`` where
  data-parallel gradients are summed (meshtrain's train step sets it every step).
  :meth:`MoE.aux_loss` gives the last forward's total.
- ``"bias"``: DeepSeek-V3's loss-free balancing: a per-expert bias added to the scores for the
  choice only, moved after each optimizer step by :meth:`MoE.update_expert_bias` from global
  counts (meshtrain's train step calls it after each optimizer step).

Under data or expert parallelism each rank routes its own share of the batch, while one device
computes the balance statistics over the whole batch. ``mt.apply`` installs a count reducer
(:data:`~meshtrain.models.moe_experts.CountReducer`, summing over the plan's token ranks) on
every MoE layer, and its router sums each forward's counts with it (one all-reduce of
``experts + 2`` integers per layer and forward; none again when activation checkpointing
recomputes the forward): the routers' count buffers (``tokens_per_expert``, ``pending_tokens``)
then hold the whole batch's counts, equal to one device's, and the balance loss's token
fractions (see :func:`load_balance_loss` for why the gradient is then one device's), the
loss-free bias update and :func:`moe_stats` read them. Without a reducer (one process)
everything is local.

Example:
    >>> model = build_moe(MoEConfig.debug(), seed=0)
    >>> model(torch.zeros(2, 8, dtype=torch.long)).shape
    torch.Size([2, 8, 256])
    >>> sorted(moe_stats(model))[:2]
    ['moe/balance_loss', 'moe/load_ratio']
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from meshtrain.errors import PlanError
from meshtrain.models.llama import (
    _WRAPPER_SEGMENTS,
    Attention,
    Decoder,
    FeedForward,
    LlamaConfig,
    RMSNorm,
    _apply_rope,
    attend,
)
from meshtrain.models.llama import default_rules as llama_rules
from meshtrain.models.moe_experts import (
    KERNELS,
    SCORE_FUNCS,
    CountReducer,
    GroupedExperts,
    Router,
    load_balance_loss,
    recomputing,
)

if TYPE_CHECKING:
    from meshtrain.spec.mesh import Mesh
    from meshtrain.spec.rules import Rules

__all__ = [
    "MoE",
    "MoEBlock",
    "MoEConfig",
    "MoEFeedForward",
    "QKNormAttention",
    "build_moe",
    "default_rules",
    "moe_layers",
    "moe_stats",
    "reduce_counts",
]

BALANCES = ("none", "aux_loss", "bias")


@dataclass(frozen=True)
class MoEConfig:
    """Shapes and routing of a :class:`MoE`; validated on construction.

    ``moe_inter`` is one routed expert's hidden width; the shared experts are one SwiGLU of width
    ``n_shared_experts · moe_inter`` (DeepSeek's); ``dense_inter`` is the width of the first
    ``first_dense_layers`` blocks' dense feed-forward.

    Example:
        >>> MoEConfig.debug().num_params() > MoEConfig.debug().num_active_params()
        True
    """

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    n_experts: int
    top_k: int
    moe_inter: int
    n_shared_experts: int = 0
    first_dense_layers: int = 0
    dense_inter: int = 0
    score_func: str = "softmax"
    norm_topk_prob: bool = True
    route_scale: float = 1.0
    balance: str = "none"
    aux_loss_coef: float = 0.001
    bias_update_rate: float = 0.001
    qk_norm: bool = False
    kernel: str = "auto"
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 2048

    def __post_init__(self) -> None:
        _check_counts(self)
        _check_choices(self)
        self.llama()  # the attention's own checks (heads divide dim, even head_dim)

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.dim // self.n_heads

    def llama(self, ffn_dim: int | None = None) -> LlamaConfig:
        """The :class:`LlamaConfig` of the shared pieces (attention, norms, rope), whose
        ``ffn_dim`` is ``ffn_dim`` (default ``dense_inter``, or ``moe_inter`` without one)."""
        width = ffn_dim or self.dense_inter or self.moe_inter
        return LlamaConfig(
            dim=self.dim,
            n_layers=self.n_layers,
            n_heads=self.n_heads,
            n_kv_heads=self.n_kv_heads,
            vocab_size=self.vocab_size,
            multiple_of=width,
            ffn_dim_multiplier=width / int(8 * self.dim / 3),
            norm_eps=self.norm_eps,
            rope_theta=self.rope_theta,
            max_seq_len=self.max_seq_len,
        )

    def is_moe_layer(self, layer_id: int) -> bool:
        """Whether block ``layer_id`` routes (the first ``first_dense_layers`` are dense)."""
        return layer_id >= self.first_dense_layers

    def num_params(self) -> int:
        """Parameters of the full model from the shapes (embeddings untied)."""
        return self._count(self.n_experts)

    def num_active_params(self) -> int:
        """Parameters one token passes through: only ``top_k`` of the routed experts."""
        return self._count(self.top_k)

    def _count(self, experts: int) -> int:
        kv = self.n_kv_heads * self.head_dim
        attention = 2 * self.dim * self.dim + 2 * self.dim * kv + 2 * self.dim
        attention += 2 * self.head_dim if self.qk_norm else 0
        dense = 3 * self.dim * self.dense_inter
        routed = self.n_experts * self.dim + 3 * experts * self.dim * self.moe_inter
        moe = routed + 3 * self.dim * self.moe_inter * self.n_shared_experts
        n_moe = self.n_layers - self.first_dense_layers
        blocks = self.n_layers * attention + self.first_dense_layers * dense + n_moe * moe
        return 2 * self.vocab_size * self.dim + blocks + self.dim

    @classmethod
    def debug(cls, **overrides: Any) -> MoEConfig:
        """Tiny model for tests: dim 64, 3 layers (the first dense), 8 experts of width 32,
        top-2, one shared expert, vocab 256; every width a multiple of 8 (bf16 grouped_mm)."""
        shape = dict(
            dim=64,
            n_layers=3,
            n_heads=4,
            n_kv_heads=2,
            vocab_size=256,
            n_experts=8,
            top_k=2,
            moe_inter=32,
            n_shared_experts=1,
            first_dense_layers=1,
            dense_inter=128,
            max_seq_len=64,
        )
        return cls(**{**shape, **overrides})


def _check_counts(config: MoEConfig) -> None:
    positive = (
        "dim",
        "n_layers",
        "n_heads",
        "n_kv_heads",
        "vocab_size",
        "n_experts",
        "top_k",
        "moe_inter",
        "max_seq_len",
    )
    for name in (*positive, "n_shared_experts", "first_dense_layers", "dense_inter"):
        value = getattr(config, name)
        low = 1 if name in positive else 0
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            wanted = "a positive integer" if low else "a non-negative integer"
            raise PlanError(f"MoEConfig.{name}={value!r} is invalid: {name} must be {wanted}.")
    if config.top_k > config.n_experts:
        raise PlanError(
            f"MoEConfig.top_k={config.top_k} exceeds n_experts={config.n_experts}: a token cannot "
            f"go to more experts than exist. Use top_k <= {config.n_experts}."
        )
    if config.first_dense_layers > config.n_layers:
        raise PlanError(
            f"MoEConfig.first_dense_layers={config.first_dense_layers} exceeds n_layers="
            f"{config.n_layers}. Use at most {config.n_layers} dense layers."
        )
    if config.first_dense_layers and not config.dense_inter:
        raise PlanError(
            f"MoEConfig.first_dense_layers={config.first_dense_layers} needs dense_inter, the "
            "dense feed-forward's width (e.g. dense_inter=4 * moe_inter)."
        )


def _check_choices(config: MoEConfig) -> None:
    choices = {"score_func": SCORE_FUNCS, "balance": BALANCES, "kernel": KERNELS}
    for name, allowed in choices.items():
        if getattr(config, name) not in allowed:
            raise PlanError(
                f"MoEConfig.{name}={getattr(config, name)!r} is invalid; choose one of {allowed}."
            )
    for name in ("route_scale", "aux_loss_coef", "bias_update_rate"):
        value = getattr(config, name)
        if not isinstance(value, (int, float)) or value < 0 or not math.isfinite(value):
            raise PlanError(f"MoEConfig.{name}={value!r} must be a finite number >= 0.")


class QKNormAttention(Attention):
    """The Llama's attention with Qwen3's RMSNorm over each query and key head (before rotary)."""

    def __init__(self, config: LlamaConfig, out_std: float) -> None:
        super().__init__(config, out_std)
        self.q_norm = RMSNorm(config.head_dim, config.norm_eps)
        self.k_norm = RMSNorm(config.head_dim, config.norm_eps)

    def forward(
        self, x: Tensor, rope_cos: Tensor, rope_sin: Tensor, documents: Tensor | None = None
    ) -> Tensor:
        batch, seq, _ = x.shape
        rope_cos, rope_sin = rope_cos[..., :seq, :], rope_sin[..., :seq, :]
        q = self.q_norm(self.wq(x).view(batch, seq, -1, self.head_dim))
        k = self.k_norm(self.wk(x).view(batch, seq, -1, self.head_dim))
        q, k = _apply_rope(q, rope_cos, rope_sin), _apply_rope(k, rope_cos, rope_sin)
        v = self.wv(x).view(batch, seq, -1, self.head_dim)
        # a plan may replace attention_fn, as the Llama's; documents: packed sequences
        out = attend(
            self.attention_fn, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), documents
        )
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class _AuxLossGrad(torch.autograd.Function):
    """Identity on ``out`` whose backward also gives ``aux`` the gradient ``weight``: backward of
    any loss of ``out`` then equals backward of ``loss + weight · aux``."""

    @staticmethod
    def forward(ctx: Any, out: Tensor, aux: Tensor, weight: float) -> Tensor:
        ctx.weight, ctx.aux_dtype = weight, aux.dtype
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, None]:
        return grad, torch.tensor(ctx.weight, dtype=ctx.aux_dtype, device=grad.device), None


class MoEFeedForward(nn.Module):
    """Router, routed experts, the optional shared expert and the balance loss of one layer.

    ``forward(x [..., dim])``: ``experts(x, *router(x)) + shared_expert(x)``. The last forward's
    balance loss (:func:`load_balance_loss`, computed under every ``balance``; it carries a
    gradient when ``balance="aux_loss"``) is ``last_aux_loss``: with a ``count_reducer``
    installed (:meth:`set_count_reducer`) and the loss training, this rank's share of the
    whole batch's loss (their mean over the ranks is it; see :func:`load_balance_loss`),
    otherwise this process's tokens' loss. ``last_prob_sums`` keeps the last forward's
    probabilities summed over its tokens per expert (no gradient), for :func:`moe_stats`.
    """

    def __init__(self, config: MoEConfig, out_std: float) -> None:
        super().__init__()
        self.num_experts, self.balance = config.n_experts, config.balance
        self.aux_loss_coef, self.aux_loss_scale = config.aux_loss_coef, 1.0
        self.router = Router(
            config.dim,
            config.n_experts,
            config.top_k,
            score_func=config.score_func,
            norm_topk_prob=config.norm_topk_prob,
            route_scale=config.route_scale,
            bias_balancing=config.balance == "bias",
        )
        self.experts = GroupedExperts(
            config.n_experts, config.dim, config.moe_inter, kernel=config.kernel, out_std=out_std
        )
        shared = config.n_shared_experts * config.moe_inter
        self.shared_expert = FeedForward(config.llama(shared), out_std) if shared else None
        self.last_aux_loss: Tensor | None = None
        self.last_prob_sums: Tensor | None = None
        self.count_reducer: CountReducer | None = None

    def set_count_reducer(self, reducer: CountReducer | None) -> None:
        """Sum the balance statistics and the router's counts over the ranks that split the batch
        with ``reducer`` (lowering installs it; ``None``: this process's tokens alone)."""
        self.count_reducer = reducer
        self.router.count_reducer = reducer

    def forward(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, x.shape[-1])
        top_k_index, top_k_weights, scores = self.router(flat)
        out = self.experts(flat, top_k_index, top_k_weights)
        if self.shared_expert is not None:
            out = out + self.shared_expert(flat)
        train_aux = self.balance == "aux_loss" and torch.is_grad_enabled()
        reduce = self.count_reducer if train_aux else None
        # the router's counts of this forward, already summed by the same reducer (a recomputed
        # forward's are not kept: it reduces again, as the forward it repeats did)
        summed = self.router.last_batch_counts if reduce is not None and not recomputing() else None
        with torch.set_grad_enabled(train_aux):
            aux = load_balance_loss(scores, top_k_index, self.num_experts, reduce, summed=summed)
        self.last_aux_loss = aux
        if not recomputing() and self.training:  # an evaluation's forward is no step's
            with torch.no_grad():
                sums = (scores / scores.sum(-1, keepdim=True)).sum(0)
                earlier = self.last_prob_sums if self.router.counting_step else None
                self.last_prob_sums = sums if earlier is None else earlier + sums
        weight = self.aux_loss_coef * self.aux_loss_scale
        if train_aux and aux.requires_grad and weight:
            out = _AuxLossGrad.apply(out, aux, weight)
        return out.view_as(x)


class MoEBlock(nn.Module):
    """Pre-norm block: the Llama's, with a :class:`MoEFeedForward` once past the dense layers.

    ``layer_id`` is the block's index in the full model; it scales the output projections' init
    (depth init) as the Llama's does.
    """

    def __init__(self, layer_id: int, config: MoEConfig) -> None:
        super().__init__()
        out_std = 0.02 / math.sqrt(2 * (layer_id + 1))
        llama = config.llama()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        attention = QKNormAttention if config.qk_norm else Attention
        self.attention = attention(llama, out_std)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward: nn.Module = (
            MoEFeedForward(config, out_std)
            if config.is_moe_layer(layer_id)
            else FeedForward(llama, out_std)
        )

    def forward(
        self, x: Tensor, rope_cos: Tensor, rope_sin: Tensor, documents: Tensor | None = None
    ) -> Tensor:
        h = x + self.attention(self.attention_norm(x), rope_cos, rope_sin, documents)
        return h + self.feed_forward(self.ffn_norm(h))


class MoE(Decoder):
    """The mixture-of-experts decoder: :class:`~meshtrain.models.llama.Decoder` (a pipeline stage
    when parts are deleted, as the Llama) with :class:`MoEBlock` layers.

    ``forward`` takes token ids ``[batch, seq]`` (or hidden states when ``tok_embeddings`` is
    ``None``) and returns logits ``[batch, seq, vocab]`` (hidden states when ``output`` is None).

    Example:
        >>> model = build_moe(MoEConfig.debug(balance="aux_loss"))
        >>> logits = model(torch.zeros(1, 4, dtype=torch.long))
        >>> model.aux_loss().shape
        torch.Size([])
    """

    def __init__(self, config: MoEConfig) -> None:
        blocks = {str(index): MoEBlock(index, config) for index in range(config.n_layers)}
        super().__init__(config, blocks)

    def _rope_config(self) -> LlamaConfig:
        return self.config.llama()

    def _reset_buffers(self) -> None:
        """The rotary tables and the routers' counts and biases."""
        for module in self.modules():
            if isinstance(module, Router):
                module.reset_buffers()
        self._reset_rope()

    def aux_loss(self) -> Tensor:
        """The balance loss of the last forward summed over this model's MoE layers (with its
        graph when ``balance="aux_loss"`` and gradients were on; 0 before any forward)."""
        losses = [ffn.last_aux_loss for ffn in moe_layers(self).values()]
        present = [loss for loss in losses if loss is not None]
        return torch.stack(present).sum() if present else torch.zeros(())

    def begin_step(self) -> None:
        """What a train loop calls before each step's first forward (meshtrain's train step
        does): the routers' ``tokens_per_expert`` count the step's whole batch, every
        micro-batch of it, not only its last forward."""
        for ffn in moe_layers(self).values():
            ffn.router.begin_step()
            ffn.last_prob_sums = None

    def set_aux_loss_scale(self, scale: float) -> None:
        """The factor on the balance loss's injected gradient beyond ``aux_loss_coef`` (see the
        module docstring: ``1/N`` for ``N`` accumulated micro-batches, a loss scaler's scale)."""
        for ffn in moe_layers(self).values():
            ffn.aux_loss_scale = float(scale)

    def expert_load(self) -> Tensor:
        """Tokens routed to each expert since the last bias update, ``[moe layers, experts]``
        (int64, layers in :func:`moe_layers` order): the whole batch's, summed over the ranks
        that split it by the routers' count reducer (this process's without one)."""
        counts = [ffn.router.pending_tokens for ffn in moe_layers(self).values()]
        return torch.stack(counts) if counts else torch.zeros(0, self.config.n_experts)

    def update_expert_bias(self, global_counts: Tensor | None = None) -> None:
        """Loss-free balancing step after an optimizer step, from GLOBAL counts
        ``[moe layers, experts]``: by default :meth:`expert_load` (already summed over every
        rank that routed part of the batch when lowering installed a count reducer; no
        collective here), or the counts given; see :meth:`Router.update_bias`."""
        layers = moe_layers(self)
        if global_counts is None:
            global_counts = self.expert_load()
        if global_counts.shape != (len(layers), self.config.n_experts):
            raise PlanError(
                f"update_expert_bias got counts of shape {tuple(global_counts.shape)}; this model "
                f"has {len(layers)} MoE layers ({sorted(layers)}) of {self.config.n_experts} "
                "experts. Pass expert_load() summed over the data-parallel ranks, or nothing."
            )
        for counts, ffn in zip(global_counts, layers.values()):
            ffn.router.update_bias(counts, self.config.bias_update_rate)

    def after_optimizer_step(self) -> None:
        """What a train loop calls after each optimizer step it takes (meshtrain's train step
        does): :meth:`update_expert_bias` under ``balance="bias"``, nothing otherwise."""
        if self.config.balance == "bias":
            self.update_expert_bias()


def reduce_counts(model: nn.Module, tensor: Tensor) -> Tensor:
    """``tensor`` summed by the count reducer of ``model``'s MoE layers over the ranks that split
    the batch (itself without one: one process). A collective when a reducer is installed.

    Example:
        >>> reduce_counts(build_moe(MoEConfig.debug(), device="meta"), torch.ones(2)).tolist()
        [1.0, 1.0]
    """
    reducers = {id(ffn.count_reducer): ffn.count_reducer for ffn in moe_layers(model).values()}
    reducer = next(iter(reducers.values()), None)
    if len(reducers) > 1:
        raise PlanError(
            f"{type(model).__name__}'s MoE layers carry {len(reducers)} different count reducers; "
            "install one for all of them (set_count_reducer on every MoEFeedForward, as mt.apply "
            "does)."
        )
    return reducer(tensor) if reducer is not None else tensor


def build_moe(config: MoEConfig, *, seed: int = 0, device: str | torch.device = "cpu") -> MoE:
    """Build a :class:`MoE` on ``device`` and initialise it from ``seed`` (nothing on meta:
    ``to_empty`` then ``init_weights``, or ``mt.materialise`` after ``mt.apply``).

    Example:
        >>> build_moe(MoEConfig.debug(), device="meta").layers["1"].feed_forward.experts.gate_up_proj.shape
        torch.Size([8, 64, 64])
    """
    with torch.device(device):
        model = MoE(config)
    if torch.device(device).type != "meta":
        model.init_weights(torch.Generator().manual_seed(seed))
    return model


def default_rules(
    tp: str | None = "tp",
    fsdp: str | Sequence[str] | None = "dp",
    *,
    ep: str | None = None,
    mesh: Mesh | None = None,
    sequence_parallel: bool = False,
    expert_tp: bool = False,
) -> Rules:
    """The Llama's rules (:func:`meshtrain.models.llama.default_rules`) plus the experts' dim:
    ``"expert"`` → ``ep`` (with ``mesh`` given and ``ep`` not, its ``ep`` axis when it has one),
    otherwise replicated, so FSDP shards expert weights like any other. ``"expert_mlp"`` (each
    expert's intermediate features, which ``gate_up_proj`` packs for gate and up) stays whole
    unless ``expert_tp``: then it goes to ``tp`` too, splitting every expert inside
    (:mod:`meshtrain.plan.experts.tensor`). With ``mesh`` given, a ``tp`` axis it lacks is left
    out too (no tensor parallelism).

    Example:
        >>> default_rules(tp=None, ep="ep").logical[-2:]
        (('expert', 'ep'), ('expert_mlp', None))
    """
    from meshtrain.spec.rules import Rules

    if mesh is not None:
        ep = "ep" if ep is None and "ep" in mesh.axis_names else ep
        tp = tp if tp in mesh.axis_names else None
    base = llama_rules(tp, fsdp, sequence_parallel=sequence_parallel)
    logical = (*base.logical, ("expert", ep), ("expert_mlp", tp if expert_tp else None))
    return Rules(logical=logical, fsdp=fsdp)


def moe_layers(model: nn.Module) -> dict[str, MoEFeedForward]:
    """Every :class:`MoEFeedForward` in ``model`` (wrapped or not), keyed by its block's FQN
    without wrapper segments (``"layers.1"``), in module order.

    Example:
        >>> list(moe_layers(build_moe(MoEConfig.debug(), device="meta")))
        ['layers.1', 'layers.2']
    """
    found: dict[str, MoEFeedForward] = {}
    for fqn, module in model.named_modules():
        if isinstance(module, MoEFeedForward):
            parts = [part for part in fqn.split(".") if part not in _WRAPPER_SEGMENTS]
            found[".".join(parts[:-1] if parts[-1:] == ["feed_forward"] else parts)] = module
    return found


def moe_stats(model: nn.Module) -> dict[str, Any]:
    """Router statistics of the last forward over the whole batch (of the step's forwards, every
    micro-batch, after ``begin_step``: what a train step reports), for metrics: per MoE layer the
    tokens per expert (``moe/tokens_per_expert/<layer>``, a list) and the max/mean load ratio
    (``moe/load_ratio/<layer>``, 1.0 when balanced); overall the worst ratio
    (``moe/load_ratio``) and the balance loss summed over layers (``moe/balance_loss``, the
    value :func:`load_balance_loss` gives on the whole batch under any ``balance``). The counts
    are the routers' (already the whole batch's); the probabilities are summed by the layers'
    count reducer (:func:`reduce_counts`: one collective over the ranks that split the batch,
    when lowering installed one; call it on every one of them alike).

    Example:
        >>> model = build_moe(MoEConfig.debug())
        >>> _ = model(torch.zeros(1, 8, dtype=torch.long))
        >>> sum(moe_stats(model)["moe/tokens_per_expert/layers.1"])
        16
    """
    layers = moe_layers(model)
    rows = []
    for ffn in layers.values():
        counts = ffn.router.tokens_per_expert.detach().double()
        sums = ffn.last_prob_sums
        rows.append(
            sums.detach().double().to(counts.device)
            if sums is not None
            else torch.zeros_like(counts)
        )
    total = reduce_counts(model, torch.stack(rows)).cpu() if rows else torch.zeros(0, 0)
    stats: dict[str, Any] = {}
    ratios, losses = [], []
    for (layer, ffn), sums in zip(layers.items(), total):
        counts = ffn.router.tokens_per_expert.detach().double().cpu()
        tokens = float(counts.sum()) / ffn.router.top_k
        mean = float(counts.mean())
        ratio = float(counts.max()) / mean if mean > 0 else 0.0
        stats[f"moe/tokens_per_expert/{layer}"] = [round(n) for n in counts.tolist()]
        stats[f"moe/load_ratio/{layer}"] = ratio
        ratios.append(ratio)
        if tokens > 0:
            losses.append(ffn.num_experts * float((counts * sums).sum()) / tokens**2)
    stats["moe/load_ratio"] = max(ratios, default=0.0)
    stats["moe/balance_loss"] = sum(losses)
    return stats
