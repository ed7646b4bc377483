"""A Llama-3-style decoder: the reference model every parallelism is tested on.

It is written to be parallelised, not just run. FQNs follow torchtitan (``tok_embeddings``,
``layers.<i>.attention.wq``, ``layers.<i>.feed_forward.w1``, ``norm``, ``output``) so regex rules
and checkpoints can rely on them. Head counts are never hard-coded in views, so column-sharded
``wq``/``wk``/``wv`` just see fewer local heads. ``layers`` is an ``nn.ModuleDict`` keyed by the
original layer index, and ``tok_embeddings``/``norm``/``output`` may be ``None``, so a pipeline stage
is this model with parts deleted and unchanged FQNs. Every parameter carries logical axis names
(:mod:`meshtrain.spec.logical`) and :func:`default_rules` maps them to mesh axes.

Initialisation seeds every parameter from ``(base seed, FQN)``: weights do not depend on the
device, on construction order, or on which layers a pipeline stage kept.

Example:
    >>> model = build_llama(LlamaConfig.debug(), seed=0)
    >>> model(torch.zeros(2, 8, dtype=torch.long)).shape
    torch.Size([2, 8, 256])
"""

from __future__ import annotations

import abc
import dataclasses
import hashlib
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeGuard

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from meshtrain.errors import MeshtrainError, PlanError
from meshtrain.spec.logical import annotate
from meshtrain.spec.packing import document_ids, same_document_causal

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

    from meshtrain.spec.rules import Rules

#: Logical axis name → mesh axis for FSDP + tensor parallel; ``"tp"`` stands for the TP axis.
LOGICAL_RULES: tuple[tuple[str, str | None], ...] = (
    ("vocab", "tp"),
    ("heads", "tp"),
    ("kv_heads", "tp"),
    ("mlp", "tp"),
    ("embed", None),
    ("norm", None),
)

_WRAPPER_SEGMENTS = frozenset({"_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module"})
_PRESETS = ("debug", "llama3_8b", "llama3_70b", "llama3_405b")
_LLAMA3_SHARED: dict[str, Any] = {
    "n_kv_heads": 8,
    "vocab_size": 128256,
    "rope_theta": 500000.0,
    "max_seq_len": 8192,
}


@dataclass(frozen=True)
class LlamaConfig:
    """Shapes of a Llama-3-style model; validated on construction.

    Example:
        >>> LlamaConfig.llama3_8b().ffn_dim
        14336
    """

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    multiple_of: int = 256
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 2048

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            _check_positive(field.name, getattr(self, field.name), integer=field.type == "int")
        if self.dim % self.n_heads:
            raise PlanError(
                f"LlamaConfig.dim={self.dim} is not divisible by n_heads={self.n_heads}, so heads "
                f"cannot split it evenly. Use a dim that is a multiple of {self.n_heads} "
                f"(e.g. {_round_up(self.dim, self.n_heads)}) or an n_heads that divides {self.dim}."
            )
        if self.n_heads % self.n_kv_heads:
            raise PlanError(
                f"LlamaConfig.n_heads={self.n_heads} is not divisible by n_kv_heads="
                f"{self.n_kv_heads}, so query heads cannot share kv heads in equal groups. Use an "
                f"n_kv_heads that divides {self.n_heads}."
            )
        if self.head_dim % 2:
            raise PlanError(
                f"LlamaConfig.head_dim = dim / n_heads = {self.head_dim} is odd; rotary embeddings "
                "rotate pairs of dims. Choose dim and n_heads so that dim / n_heads is even."
            )

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.dim // self.n_heads

    @property
    def ffn_dim(self) -> int:
        """Hidden width of the SwiGLU feed-forward (Llama's rounding rule)."""
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return _round_up(hidden, self.multiple_of)

    def num_params(self) -> int:
        """Parameter count of the full model, from the shapes alone (embeddings untied)."""
        attention = 2 * self.dim * self.dim + 2 * self.dim * self.n_kv_heads * self.head_dim
        block = attention + 3 * self.dim * self.ffn_dim + 2 * self.dim
        return 2 * self.vocab_size * self.dim + self.n_layers * block + self.dim

    @classmethod
    def debug(cls) -> LlamaConfig:
        """Tiny model for tests (131k parameters); ffn 192 and vocab 256 are divisible by 8.

        Tensor parallel of degree 2 splits every sharded dim by whole heads; degree 4 splits the
        4 query heads but not the 2 kv heads (override ``n_heads=8, n_kv_heads=4`` for tp 4).
        """
        return cls(
            dim=64,
            n_layers=2,
            n_heads=4,
            n_kv_heads=2,
            vocab_size=256,
            multiple_of=32,
            max_seq_len=64,
        )

    @classmethod
    def llama3_8b(cls) -> LlamaConfig:
        """Llama 3 8B shapes (≈ 8.03e9 parameters)."""
        return cls._llama3(dim=4096, n_layers=32, n_heads=32, multiple_of=1024, ffn_multiplier=1.3)

    @classmethod
    def llama3_70b(cls) -> LlamaConfig:
        """Llama 3 70B shapes (≈ 70.6e9 parameters)."""
        return cls._llama3(dim=8192, n_layers=80, n_heads=64, multiple_of=4096, ffn_multiplier=1.3)

    @classmethod
    def llama3_405b(cls) -> LlamaConfig:
        """Llama 3 405B shapes (≈ 405.9e9 parameters)."""
        return cls._llama3(
            dim=16384, n_layers=126, n_heads=128, multiple_of=4096, ffn_multiplier=1.2
        )

    @classmethod
    def _llama3(
        cls, *, dim: int, n_layers: int, n_heads: int, multiple_of: int, ffn_multiplier: float
    ) -> LlamaConfig:
        """Shared Llama 3 choices: 8 kv heads, 128256-token vocab, RoPE theta 5e5, 8k context."""
        shape = {"dim": dim, "n_layers": n_layers, "n_heads": n_heads, "multiple_of": multiple_of}
        return cls(**shape, **_LLAMA3_SHARED, ffn_dim_multiplier=ffn_multiplier)

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> LlamaConfig:
        """A preset by name (``debug``, ``llama3_8b``, ``llama3_70b``, ``llama3_405b``), with overrides.

        Example:
            >>> LlamaConfig.preset("debug", n_layers=4).n_layers
            4
        """
        if name not in _PRESETS:
            raise PlanError(f"unknown Llama preset {name!r}; choose one of {list(_PRESETS)}.")
        fields = {field.name for field in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - fields)
        if unknown:
            raise PlanError(
                f"unknown LlamaConfig field(s) {unknown} overriding preset {name!r}; "
                f"valid fields: {sorted(fields)}."
            )
        return dataclasses.replace(getattr(cls, name)(), **overrides)


class _Initialised(nn.Module, abc.ABC):
    """A module that says how to initialise some parameters under it (see ``Llama.init_weights``)."""

    @abc.abstractmethod
    def _init_table(self) -> dict[str, _Init]:
        """Initialiser per parameter FQN relative to this module."""


@dataclass(frozen=True)
class _Init:
    """Normal (optionally truncated at ±3 std) with ``std``, or all ones when ``std`` is None."""

    std: float | None
    truncated: bool = True


class RMSNorm(_Initialised):
    """Root-mean-square norm with a learned scale; a module of our own so FQNs stay ``*.weight``.

    Example:
        >>> RMSNorm(8)(torch.ones(2, 8)).shape
        torch.Size([2, 8])
    """

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        annotate(self, weight=("norm",))

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)

    def _init_table(self) -> dict[str, _Init]:
        return {"weight": _Init(std=None)}


class Attention(_Initialised):
    """Grouped-query causal self-attention with rotary embeddings.

    Head counts are inferred from the projected widths, so the same code runs on the local shards
    of column-parallel ``wq``/``wk``/``wv`` (``n_heads / tp`` query heads per rank).
    ``attention_fn`` (``None``: PyTorch's causal SDPA) computes causal attention from
    ``q [batch, heads, seq, head_dim]`` and ``k``/``v`` with fewer heads (grouped queries); a
    plan replaces it, e.g. context parallelism with attention over the whole sequence's keys.
    ``documents`` (``[batch, seq]`` ids of packed documents, see
    :mod:`meshtrain.spec.packing`) makes attention causal within each document only; it
    reaches ``attention_fn`` as ``documents=``.
    """

    attention_fn: Callable[[Tensor, Tensor, Tensor], Tensor] | None = None

    def __init__(self, config: LlamaConfig, out_std: float) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.out_std = out_std
        kv_dim = config.n_kv_heads * config.head_dim
        self.wq = annotate(nn.Linear(config.dim, config.dim, bias=False), weight=("heads", "embed"))
        self.wk = annotate(nn.Linear(config.dim, kv_dim, bias=False), weight=("kv_heads", "embed"))
        self.wv = annotate(nn.Linear(config.dim, kv_dim, bias=False), weight=("kv_heads", "embed"))
        self.wo = annotate(nn.Linear(config.dim, config.dim, bias=False), weight=("embed", "heads"))

    def forward(
        self, x: Tensor, rope_cos: Tensor, rope_sin: Tensor, documents: Tensor | None = None
    ) -> Tensor:
        batch, seq, _ = x.shape  # the whole sequence, also when blocks pass sequence shards
        rope_cos, rope_sin = rope_cos[..., :seq, :], rope_sin[..., :seq, :]
        q = _apply_rope(self.wq(x).view(batch, seq, -1, self.head_dim), rope_cos, rope_sin)
        k = _apply_rope(self.wk(x).view(batch, seq, -1, self.head_dim), rope_cos, rope_sin)
        v = self.wv(x).view(batch, seq, -1, self.head_dim)
        out = attend(
            self.attention_fn, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), documents
        )
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))

    def _init_table(self) -> dict[str, _Init]:
        table = {f"{name}.weight": _Init(std=0.02) for name in ("wq", "wk", "wv")}
        return {**table, "wo.weight": _Init(std=self.out_std)}


def _causal_sdpa(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def attend(
    attention_fn: Callable[..., Tensor] | None,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    documents: Tensor | None = None,
) -> Tensor:
    """Causal attention of ``q`` over ``k``, ``v`` (``[batch, heads, seq, head_dim]``, grouped
    queries) by ``attention_fn`` (``None``: PyTorch's SDPA); with ``documents`` (``[batch, seq]``
    ids), causal within each document only: SDPA with the exact boolean mask, or
    ``attention_fn(q, k, v, documents=documents)``.

    Example:
        >>> q = torch.randn(1, 2, 3, 4)
        >>> apart = attend(None, q, q, q, torch.tensor([[0, 0, 1]]))
        >>> torch.allclose(apart[:, :, 2:], attend(None, q[:, :, 2:], q[:, :, 2:], q[:, :, 2:]))
        True
    """
    if documents is None:
        return (attention_fn or _causal_sdpa)(q, k, v)
    if attention_fn is not None:
        return attention_fn(q, k, v, documents=documents)
    mask = same_document_causal(documents.to(q.device))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


class FeedForward(_Initialised):
    """SwiGLU feed-forward: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, config: LlamaConfig, out_std: float) -> None:
        super().__init__()
        self.out_std = out_std
        dim, hidden = config.dim, config.ffn_dim
        self.w1 = annotate(nn.Linear(dim, hidden, bias=False), weight=("mlp", "embed"))
        self.w2 = annotate(nn.Linear(hidden, dim, bias=False), weight=("embed", "mlp"))
        self.w3 = annotate(nn.Linear(dim, hidden, bias=False), weight=("mlp", "embed"))

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def _init_table(self) -> dict[str, _Init]:
        return {
            "w1.weight": _Init(std=0.02),
            "w2.weight": _Init(std=self.out_std),
            "w3.weight": _Init(std=self.out_std),
        }


class TransformerBlock(nn.Module):
    """Pre-norm block: ``h = x + attention(attention_norm(x)); h + feed_forward(ffn_norm(h))``.

    ``layer_id`` is the block's index in the full model; it scales the output-projection init
    (torchtitan's depth init), so a block initialises the same inside or outside a pipeline stage.
    """

    def __init__(self, layer_id: int, config: LlamaConfig) -> None:
        super().__init__()
        out_std = 0.02 / math.sqrt(2 * (layer_id + 1))
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Attention(config, out_std)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward = FeedForward(config, out_std)

    def forward(
        self, x: Tensor, rope_cos: Tensor, rope_sin: Tensor, documents: Tensor | None = None
    ) -> Tensor:
        h = x + self.attention(self.attention_norm(x), rope_cos, rope_sin, documents)
        return h + self.feed_forward(self.ffn_norm(h))


class Decoder(_Initialised):
    """The decoder shell the Llama and the MoE share: token embeddings, ``layers`` (blocks taking
    ``(h, rope_cos, rope_sin)``), the final norm, the output head and the rotary tables; a pipeline
    stage when parts are deleted. Subclasses pass their blocks and say where the rotary tables'
    shape comes from (:meth:`_rope_config`).

    ``forward`` takes token ids ``[batch, seq]`` and returns logits ``[batch, seq, vocab]``. A stage
    whose ``tok_embeddings`` is ``None`` takes float hidden states ``[batch, seq, dim]`` instead,
    and a stage whose ``output`` is ``None`` returns hidden states (after ``norm``, if kept).
    Delete layers with ``del model.layers["3"]``: the other FQNs do not change.

    Example:
        >>> stage = build_llama(LlamaConfig.debug())
        >>> stage.output = None
        >>> stage(torch.zeros(1, 4, dtype=torch.long)).shape
        torch.Size([1, 4, 64])
    """

    rope_cos: Tensor
    rope_sin: Tensor

    def __init__(self, config: Any, blocks: Mapping[str, nn.Module]) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings: nn.Embedding | None = annotate(
            nn.Embedding(config.vocab_size, config.dim), weight=("vocab", "embed")
        )
        self.layers = nn.ModuleDict(dict(blocks))
        self.norm: RMSNorm | None = RMSNorm(config.dim, config.norm_eps)
        self.output: nn.Linear | None = annotate(
            nn.Linear(config.dim, config.vocab_size, bias=False), weight=("vocab", "embed")
        )
        # Real cos/sin tables, not complex: DTensor, FSDP and compile all handle real buffers.
        table_shape = (config.max_seq_len, config.head_dim // 2)
        self.register_buffer("rope_cos", torch.empty(table_shape), persistent=False)
        self.register_buffer("rope_sin", torch.empty(table_shape), persistent=False)
        self._reset_rope()

    def forward(
        self, tokens: Tensor, positions: Tensor | None = None, documents: Tensor | None = None
    ) -> Tensor:
        """Logits (or a stage's hidden states); ``positions`` (``[seq]``, default
        ``0..seq-1``): the true positions of the tokens given, for a share of a longer sequence
        (context parallelism); ``[batch, seq]`` positions are each sequence's own, and where
        they restart (packed documents, :func:`~meshtrain.spec.packing.document_ids`) each
        token attends only within its document. ``documents`` (``[batch, seq]`` ids) gives the
        documents instead of reading them from ``positions`` (context parallelism passes them:
        a rank's positions are only chunks of each sequence).

        Example (two documents packed in one row equal each document alone):
            >>> model = build_llama(LlamaConfig.debug())
            >>> tokens = torch.tensor([[5, 6, 7, 8, 9]])
            >>> packed = model(tokens, positions=torch.tensor([[0, 1, 2, 0, 1]]))
            >>> torch.allclose(packed[:, 3:], model(tokens[:, 3:]), atol=1e-5)
            True
        """
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        seq = tokens.shape[1]  # under sequence parallelism a later stage gets a sequence shard
        last = int(positions.max()) + 1 if positions is not None else seq
        if self.tok_embeddings is not None and last > self.config.max_seq_len:
            raise PlanError(
                f"sequence length {last} exceeds {type(self.config).__name__}.max_seq_len="
                f"{self.config.max_seq_len}; build the model with a larger max_seq_len or feed "
                "shorter sequences."
            )
        rope_cos, rope_sin = self.rope_cos, self.rope_sin
        if positions is not None:
            rope_cos, rope_sin = rope_cos[positions], rope_sin[positions]
        if documents is None and positions is not None and positions.dim() == 2:
            documents = document_ids(positions)
        extra = () if documents is None else (documents,)
        for layer in self.layers.values():  # attention slices the tables to its sequence
            h = layer(h, rope_cos, rope_sin, *extra)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """(Re)initialise every parameter and the buffers (:meth:`_reset_buffers`), reproducibly.

        One base seed is drawn from ``generator`` (torch's default generator when ``None``); each
        parameter's values come from a CPU generator seeded with (base seed, FQN) and are then
        copied to the parameter's device and dtype. So a model built on the meta device,
        ``to_empty``'d and initialised equals one built on CPU bitwise, a pipeline stage gets the
        weights of the same FQNs in the full model, and wrappers (activation checkpointing,
        compile) change nothing. A ``DTensor`` parameter receives its shard of the full tensor
        (split locally, no collective), so initialising after FSDP or TP matches too.

        Example:
            >>> with torch.device("meta"):
            ...     model = Llama(LlamaConfig.debug())
            >>> model = model.to_empty(device="cpu")
            >>> model.init_weights(torch.Generator().manual_seed(0))
        """
        device = generator.device if generator is not None else "cpu"
        base = int(torch.randint(0, 2**62, (), generator=generator, device=device).item())
        table: dict[str, _Init] = {}
        for prefix, module in self.named_modules():
            if isinstance(module, _Initialised):
                for name, init in module._init_table().items():
                    table[f"{prefix}.{name}" if prefix else name] = init
        params = dict(self.named_parameters())
        missing = sorted(set(params) - set(table))
        if missing:
            raise PlanError(
                f"{type(self).__name__}.init_weights has no initialiser for parameters {missing}."
            )
        for fqn in sorted(set(table) & set(params)):  # a pipeline stage holds some of them
            _fill_(params[fqn], table[fqn], _fqn_seed(base, fqn))
        self._reset_buffers()

    def _init_table(self) -> dict[str, _Init]:
        table: dict[str, _Init] = {}
        if self.tok_embeddings is not None:
            table["tok_embeddings.weight"] = _Init(std=1.0, truncated=False)
        if self.output is not None:
            table["output.weight"] = _Init(std=self.config.dim**-0.5)
        return table

    def _rope_config(self) -> LlamaConfig:
        """The configuration the rotary tables are computed from."""
        return self.config

    def _reset_buffers(self) -> None:
        """Buffers :meth:`init_weights` resets after the parameters: the rotary tables."""
        self._reset_rope()

    def _reset_rope(self) -> None:
        if self.rope_cos.is_meta:
            return
        cos, sin = _rope_tables(self._rope_config())
        with torch.no_grad():
            self.rope_cos.copy_(cos)
            self.rope_sin.copy_(sin)


class Llama(Decoder):
    """Llama-3-style decoder (:class:`Decoder` with :class:`TransformerBlock` layers).

    Example:
        >>> build_llama(LlamaConfig.debug()).layers["0"].feed_forward.w1.weight.shape
        torch.Size([192, 64])
    """

    def __init__(self, config: LlamaConfig) -> None:
        blocks = {str(index): TransformerBlock(index, config) for index in range(config.n_layers)}
        super().__init__(config, blocks)


def build_llama(config: LlamaConfig, *, seed: int = 0, device: str | torch.device = "cpu") -> Llama:
    """Build a :class:`Llama` on ``device`` and initialise it from ``seed``.

    On ``device="meta"`` nothing is allocated or initialised: call ``to_empty`` then
    ``init_weights`` (or load a checkpoint) once the model has been planned or distributed.

    Example:
        >>> build_llama(LlamaConfig.llama3_8b(), device="meta").output.weight.shape
        torch.Size([128256, 4096])
    """
    with torch.device(device):
        model = Llama(config)
    if torch.device(device).type != "meta":
        model.init_weights(torch.Generator().manual_seed(seed))
    return model


def default_rules(
    tp: str | None = "tp",
    fsdp: str | Sequence[str] | None = "dp",
    *,
    sequence_parallel: bool = False,
) -> Rules:
    """Logical-axis rules for FSDP over ``fsdp`` (an axis, or two for HSDP) plus tensor parallel
    over ``tp`` (``None``: no TP).

    ``sequence_parallel`` adds the activation rule ``("seq", tp)``: norms then run on sequence
    shards between the tensor-parallel attention and feed-forward blocks.

    Example:
        >>> default_rules(tp="model", fsdp="data", sequence_parallel=True).logical[-1]
        ('seq', 'model')
    """
    from meshtrain.spec.rules import Rules

    logical = tuple((name, tp if axis == "tp" else axis) for name, axis in LOGICAL_RULES)
    if sequence_parallel:
        logical += (("seq", tp),)
    return Rules(logical=logical, fsdp=fsdp)


def _check_positive(name: str, value: object, *, integer: bool) -> None:
    if value is None and name == "ffn_dim_multiplier":
        return
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or value <= 0:
        wanted = "a positive integer" if integer else "a positive number"
        raise PlanError(f"LlamaConfig.{name}={value!r} is invalid: {name} must be {wanted}.")


def _round_up(value: int, multiple: int) -> int:
    return multiple * ((value + multiple - 1) // multiple)


def _rope_tables(config: LlamaConfig) -> tuple[Tensor, Tensor]:
    """cos/sin of ``position * theta^(-2i/head_dim)``, ``[max_seq_len, head_dim // 2]``, on CPU."""
    exponents = torch.arange(0, config.head_dim, 2, device="cpu", dtype=torch.float32)
    inv_freq = 1.0 / (config.rope_theta ** (exponents / config.head_dim))
    positions = torch.arange(config.max_seq_len, device="cpu", dtype=torch.float32)
    angles = torch.outer(positions, inv_freq)
    return angles.cos(), angles.sin()


def _apply_rope(x: Tensor, rope_cos: Tensor, rope_sin: Tensor) -> Tensor:
    """Rotate adjacent pairs ``(x[2i], x[2i+1])`` of ``x`` ``[batch, seq, heads, head_dim]``.

    Adjacent pairs (not halves) match Meta's checkpoints and torchtitan's complex formulation.
    """
    x0, x1 = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    # tables [seq, head_dim // 2], or [batch, seq, head_dim // 2] for per-sequence positions
    cos, sin = rope_cos.unsqueeze(-2).float(), rope_sin.unsqueeze(-2).float()
    rotated = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


def _fqn_seed(base: int, fqn: str) -> int:
    """A seed for ``fqn`` that ignores wrapper segments (activation checkpointing, compile)."""
    fqn = ".".join(part for part in fqn.split(".") if part not in _WRAPPER_SEGMENTS)
    digest = hashlib.blake2b(f"{base}:{fqn}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def _fill_(param: Tensor, init: _Init, seed: int) -> None:
    if param.is_meta:  # nothing to fill; never materialise a full tensor for it
        return
    full = torch.empty(param.shape, dtype=torch.float32, device="cpu")
    if init.std is None:
        full.fill_(1.0)
    elif init.truncated:
        _trunc_normal_(full, init.std, seed)
    else:
        nn.init.normal_(full, std=init.std, generator=torch.Generator().manual_seed(seed))
    if is_dtensor(param):
        from torch.distributed.tensor import distribute_tensor

        mesh = param.device_mesh
        full = distribute_tensor(
            full.to(mesh.device_type), mesh, param.placements, src_data_rank=None
        )
    param.copy_(full)


def is_dtensor(value: object) -> TypeGuard[DTensor]:
    """Whether ``value`` is a DTensor, without importing DTensor (2 s on a small CPU) when
    nothing has: then nothing can be one.

    Example:
        >>> is_dtensor(torch.zeros(2))
        False
    """
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(value, module.DTensor)


#: Elements per block of a truncated-normal fill (see :func:`_trunc_normal_`).
_TRUNC_BLOCK = 1 << 22


def _trunc_normal_(full: Tensor, std: float, seed: int) -> None:
    """Truncated normal (±3 std) in blocks of :data:`_TRUNC_BLOCK` elements, each from its own
    generator seeded with (seed, block): torch's rejection sampling allocates several temporaries
    the size of what it fills, so filling block by block keeps a large embedding's start-up peak
    near its own size, and the values do not depend on how the tensor is sharded."""
    flat = full.view(-1)
    for index, start in enumerate(range(0, flat.numel(), _TRUNC_BLOCK)):
        block = flat[start : start + _TRUNC_BLOCK]
        generator = torch.Generator().manual_seed((seed + index * 0x9E3779B97F4A7C15) % 2**63)
        nn.init.trunc_normal_(block, std=std, a=-3 * std, b=3 * std, generator=generator)


def llama_flops_per_token(config: LlamaConfig, seq_len: int) -> float:
    """Training FLOPs per token of meshtrain's Llama: ``6·N + 12·n_layers·dim·seq_len``.

    ``N`` counts the parameters that multiply activations: every parameter but the token
    embedding table (a lookup); ``6·N`` is the forward (2) and backward (4) matmul FLOPs. The
    second term is attention's score and value matmuls (``QKᵀ`` and ``AV``) over the full
    ``seq_len × seq_len`` square, forward and backward: the PaLM convention, which does not halve
    it for the causal mask, so MFU figures compare with the ones others publish.

    Example:
        >>> config = LlamaConfig.debug()
        >>> llama_flops_per_token(config, seq_len=16) == 6 * (config.num_params() - 256 * 64) + 12 * 2 * 64 * 16
        True
    """
    if not isinstance(seq_len, int) or seq_len <= 0:
        raise MeshtrainError(
            f"llama_flops_per_token got seq_len={seq_len!r}; it needs the positive integer "
            "length of the training sequences (the recipe's train.seq_len)."
        )
    matmul_params = config.num_params() - config.vocab_size * config.dim
    return float(6 * matmul_params + 12 * config.n_layers * config.dim * seq_len)
