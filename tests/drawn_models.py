"""Plain ``nn.Module`` language models drawn with Hypothesis, for the plan-time proof's
precision (``benchmarks/proof_precision.py``) and its property test: attention whose heads are
viewed in one of several ways (sizes read off the input, a global head count, a fixed shape,
torchtitan's rotary pairs), an optional per-head operation (a norm or scale module, a raw scale
parameter, a bias over every head), a tied or separate head, an in-place residual into the
row-wise output, a running mean of the embeddings, a feature reduction of a column-wise output;
and a plan for it (mesh, sequence parallelism, which projections are tensor-parallel, options).

Whether a drawn plan is right is never decided here: the benchmark trains it against one device.

Example:
    >>> model = build(ModelConfig())
    >>> model(torch.zeros(2, 6, dtype=torch.long)).shape
    torch.Size([2, 6, 64])
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from hypothesis import strategies as st
from torch import nn

from meshtrain import P, Rules

VOCAB = 64
VIEWS = ("input_sizes", "global_heads", "shape_minus_one", "rotary_pairs")
PER_HEAD = ("none", "norm_module", "scale_module", "raw_scale", "every_head_bias")


@dataclass(frozen=True)
class ModelConfig:
    """One drawn model (see module doc)."""

    width: int = 32
    heads: int = 4
    layers: int = 1
    view: str = "input_sizes"
    per_head: str = "none"
    tied: bool = False
    inplace: bool = False
    running_mean: bool = False
    feature_max: bool = False


class Attention(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.c, self.head_dim = c, c.width // c.heads
        self.q, self.k = nn.Linear(c.width, c.width), nn.Linear(c.width, c.width)
        self.v, self.o = nn.Linear(c.width, c.width), nn.Linear(c.width, c.width)
        if c.per_head == "norm_module":
            self.head_norm = nn.LayerNorm(self.head_dim)
        elif c.per_head == "scale_module":
            self.head_scale = Scale(self.head_dim)
        elif c.per_head == "raw_scale":
            self.raw_scale = nn.Parameter(torch.linspace(0.5, 1.5, self.head_dim))
        elif c.per_head == "every_head_bias":
            self.bias = nn.Parameter(torch.linspace(-0.5, 0.5, c.heads)[:, None, None])

    def heads(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        bsz, seq = x.shape[0], x.shape[1]
        view = self.c.view
        if view == "global_heads":
            return y.view(bsz, -1, self.c.heads, self.head_dim)
        if view == "shape_minus_one":
            return y.reshape(*y.shape[:-1], -1, self.head_dim)
        heads = y.view(bsz, seq, -1, self.head_dim)
        if view == "rotary_pairs":
            pairs = heads.reshape(*heads.shape[:-1], -1, 2)
            heads = torch.stack((-pairs[..., 1], pairs[..., 0]), -1).flatten(-2) * 0.5 + heads
        return heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (self.heads(x, proj(x)) for proj in (self.q, self.k, self.v))
        if self.c.per_head == "norm_module":
            q = self.head_norm(q)
        elif self.c.per_head == "scale_module":
            q = self.head_scale(q)
        elif self.c.per_head == "raw_scale":
            q = q * self.raw_scale
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        scores = q @ k.transpose(-1, -2) / self.head_dim**0.5
        if self.c.per_head == "every_head_bias":
            scores = scores + self.bias
        causal = torch.ones(scores.shape[-2:], dtype=torch.bool).tril()
        attended = scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v
        out = self.o(attended.transpose(1, 2).flatten(2))
        if self.c.inplace:
            out += x
            return out
        return out + x


class Scale(nn.Module):
    def __init__(self, size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


class MLP(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.c = c
        self.up, self.down = nn.Linear(c.width, 2 * c.width), nn.Linear(2 * c.width, c.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        up = self.up(x)
        out = self.down(F.gelu(up))
        if self.c.feature_max:  # spread unevenly over the features (a norm would cancel a shift)
            spread = torch.linspace(-1.0, 1.0, out.shape[-1], dtype=out.dtype)
            out = out + up.amax(-1, keepdim=True) * spread
        return out + x


class Block(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.attn_norm, self.attn = nn.LayerNorm(c.width), Attention(c)
        self.mlp_norm, self.mlp = nn.LayerNorm(c.width), MLP(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.mlp_norm(self.attn(self.attn_norm(x))))


class DrawnLM(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.c = c
        self.embed = nn.Embedding(VOCAB, c.width)
        self.layers = nn.ModuleList([Block(c) for _ in range(c.layers)])
        self.norm = nn.LayerNorm(c.width)
        self.head = None if c.tied else nn.Linear(c.width, VOCAB, bias=False)
        if c.running_mean:
            self.register_buffer("running_mean", torch.zeros(c.width))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        if self.c.running_mean and self.training:
            with torch.no_grad():
                self.running_mean.mul_(0.9).add_(h.mean(dim=(0, 1)), alpha=0.1)
        for layer in self.layers:
            h = layer(h)
        h = self.norm(h)
        return F.linear(h, self.embed.weight) if self.head is None else self.head(h)


def build(config: ModelConfig) -> DrawnLM:
    return DrawnLM(config)


@dataclass(frozen=True)
class DrawnPlan:
    """A drawn model and its plan: mesh axes, which projections are tensor-parallel (``tp``:
    'attention', 'mlp', 'both'), the embedding and head vocab-parallel, sequence parallelism,
    plan options."""

    model: ModelConfig
    axes: tuple[tuple[str, int], ...]
    tp: str = "both"
    vocab: bool = False
    sequence_parallel: bool = False
    options: tuple[tuple[str, Any], ...] = field(default=())

    def model_fn(self) -> Any:
        return functools.partial(build, self.model)

    def rules(self) -> Rules:
        patterns: dict[str, P] = {}
        if "tp" in dict(self.axes):
            if self.tp in ("attention", "both"):
                patterns[r"layers\.\d+\.attn\.(q|k|v)\.(weight|bias)"] = P("tp")
                patterns[r"layers\.\d+\.attn\.o\.weight"] = P(None, "tp")
            if self.tp in ("mlp", "both"):
                patterns[r"layers\.\d+\.mlp\.up\.(weight|bias)"] = P("tp")
                patterns[r"layers\.\d+\.mlp\.down\.weight"] = P(None, "tp")
            if self.vocab:
                patterns[r"embed\.weight"] = P("tp", None)
                patterns[r"head\.weight"] = P("tp", None)
        patterns[r".*"] = P()
        logical = [("seq", "tp")] if self.sequence_parallel else []
        return Rules(patterns, logical=logical, fsdp="dp", allow_unused=True)

    def describe(self) -> str:
        m = self.model
        traits = [f"view={m.view}", f"per_head={m.per_head}", f"heads={m.heads}"]
        traits += [
            name for name in ("tied", "inplace", "running_mean", "feature_max") if getattr(m, name)
        ]
        plan = [f"{a}{n}" for a, n in self.axes] + [f"tp={self.tp}"]
        plan += ["vocab"] * self.vocab + ["sp"] * self.sequence_parallel
        plan += [f"{k}={v}" for k, v in self.options]
        return f"drawn({', '.join(traits)}) on {' × '.join(plan)}"


@st.composite
def drawn_plans(draw: st.DrawFn) -> DrawnPlan:
    """A drawn model and plan on 4 ranks (see :class:`DrawnPlan`)."""
    model = ModelConfig(
        heads=draw(st.sampled_from([2, 4])),
        layers=draw(st.sampled_from([1, 2])),
        view=draw(st.sampled_from(VIEWS)),
        per_head=draw(st.sampled_from(PER_HEAD)),
        tied=draw(st.booleans()),
        inplace=draw(st.booleans()),
        running_mean=draw(st.booleans()),
        feature_max=draw(st.booleans()),
    )
    axes = draw(st.sampled_from([(("dp", 2), ("tp", 2)), (("dp", 1), ("tp", 2)), (("dp", 4),)]))
    tensor = "tp" in dict(axes)
    options: list[tuple[str, Any]] = []
    if model.running_mean and dict(axes).get("dp", 1) > 1 and draw(st.booleans()):
        options.append(("batch_buffers", "average"))
    return DrawnPlan(
        model,
        axes,
        tp=draw(st.sampled_from(["attention", "mlp", "both"])) if tensor else "both",
        vocab=tensor and draw(st.booleans()),
        sequence_parallel=tensor and draw(st.booleans()),
        options=tuple(options),
    )


def token_batches(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """8 sequences of 8 token ids and their next tokens."""
    tokens = torch.randint(0, VOCAB, (8, 9), generator=torch.Generator().manual_seed(40 + step))
    return tokens[:, :-1], tokens[:, 1:]
