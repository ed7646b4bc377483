"""Plain ``nn.Module``s of shapes the plan-time proof must get right (issue 43), written the
ordinary way, with the rules and batches a user would write: a CNN with GroupNorm and a
tensor-parallel classifier head; a tied head through ``F.linear`` on the embedding's weight; a
module calling a functional conv on a child's weight; an in-place residual into a row-wise output;
a hand-made running mean; attention whose heads are viewed with sizes read off the shard
(torchtitan's rotary reshape); multi-head latent attention (value head size ≠ query/key head
size). Factories are at module level so ranks can import them; no dropout."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from meshtrain import P, Rules

VOCAB = 64


class GroupNormCNN(nn.Module):
    """A conv stem with GroupNorm, then ``fc1`` (column-wise) and ``fc2`` (row-wise) under one
    parent, the head."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1),
            nn.GroupNorm(2, 8),
            nn.ReLU(),
            nn.Conv2d(8, 8, 3, stride=2, padding=1),
            nn.GroupNorm(2, 8),
            nn.ReLU(),
        )
        self.classifier = nn.ModuleDict({"fc1": nn.Linear(8 * 4 * 4, 32), "fc2": nn.Linear(32, 10)})

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.stem(images).flatten(1)
        return self.classifier["fc2"](F.relu(self.classifier["fc1"](x)))


def group_norm_cnn() -> GroupNormCNN:
    return GroupNormCNN()


CNN_RULES = Rules(
    {
        r"classifier\.fc1\.(weight|bias)": P("tp"),
        r"classifier\.fc2\.weight": P(None, "tp"),
        r".*": P(),
    },
    fsdp="dp",
)


def image_batches(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """8 images of 3×8×8 and their class (0–9)."""
    generator = torch.Generator().manual_seed(500 + step)
    return torch.randn(8, 3, 8, 8, generator=generator), torch.randint(
        0, 10, (8,), generator=generator
    )


class TokenMLP(nn.Module):
    """Embedding → MLP (``up`` column-wise, ``down`` row-wise under ``mlp``) → norm → head; the
    variants read parameters outside their module, update outputs in place or keep a statistic."""

    def __init__(
        self,
        *,
        tied: bool = False,
        inplace: bool = False,
        running_mean: bool = False,
        reread: bool = False,
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.mlp = nn.ModuleDict({"up": nn.Linear(16, 32), "down": nn.Linear(32, 16)})
        self.norm = nn.LayerNorm(16)
        self.head = None if tied else nn.Linear(16, VOCAB, bias=False)
        self.tied, self.inplace, self.reread = tied, inplace, reread
        if running_mean:
            self.register_buffer("running_mean", torch.zeros(16))
        else:
            self.running_mean = None

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        if self.running_mean is not None and self.training:
            with torch.no_grad():
                self.running_mean.mul_(0.9).add_(h.mean(dim=(0, 1)), alpha=0.1)
            if self.reread:
                h = h - self.running_mean
        out = self.mlp["down"](F.gelu(self.mlp["up"](h)))
        if self.inplace:
            out += h  # in place, into the row-wise Linear's output
        else:
            out = out + h
        out = self.norm(out)
        return F.linear(out, self.embed.weight) if self.tied else self.head(out)


def tied_mlp() -> TokenMLP:
    return TokenMLP(tied=True)


def inplace_mlp() -> TokenMLP:
    return TokenMLP(inplace=True)


def running_mean_mlp() -> TokenMLP:
    return TokenMLP(running_mean=True)


def rereading_mean_mlp() -> TokenMLP:
    return TokenMLP(running_mean=True, reread=True)


MLP_RULES = Rules(
    {r"mlp\.up\.(weight|bias)": P("tp"), r"mlp\.down\.weight": P(None, "tp"), r".*": P()}, fsdp="dp"
)
#: the embedding vocab-parallel too: a tied head cannot read it whole
VOCAB_RULES = Rules({r"embed\.weight": P("tp", None), **dict(MLP_RULES.patterns)}, fsdp="dp")


class ConvReader(nn.Module):
    """A module that applies a functional conv with its child's weight (a depthwise smoothing
    shared with the child), beside a tensor-parallel MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.smooth = nn.Conv1d(16, 16, 3, padding=1, groups=16)
        self.mlp = nn.ModuleDict({"up": nn.Linear(16, 32), "down": nn.Linear(32, 16)})
        self.head = nn.Linear(16, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens).transpose(1, 2)
        h = F.conv1d(h, self.smooth.weight, self.smooth.bias, padding=1, groups=16).transpose(1, 2)
        return self.head(h + self.mlp["down"](F.gelu(self.mlp["up"](h))))


def conv_reader() -> ConvReader:
    return ConvReader()


class RotaryAttention(nn.Module):
    """Attention whose heads are viewed with sizes read off its own activation, and rotated with
    torchtitan's complex reshape ``x.reshape(*x.shape[:-1], -1, 2)``."""

    def __init__(self, width: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.head_dim = width // heads
        self.wq, self.wk = nn.Linear(width, width, bias=False), nn.Linear(width, width, bias=False)
        self.wv, self.wo = nn.Linear(width, width, bias=False), nn.Linear(width, width, bias=False)

    def forward(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        bsz, seq, _ = x.shape
        q = self.wq(x).view(bsz, seq, -1, self.head_dim)
        k = self.wk(x).view(bsz, seq, -1, self.head_dim)
        v = self.wv(x).view(bsz, seq, -1, self.head_dim)
        q, k = _rotate(q, freqs), _rotate(k, freqs)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))


def _rotate(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(pairs * freqs[: x.shape[1], None, :]).flatten(3).type_as(x)


class FeedForward(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.w1, self.w2 = nn.Linear(width, 64, bias=False), nn.Linear(64, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)))


class RotaryBlock(nn.Module):
    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(width)
        self.attention = RotaryAttention(width)
        self.ffn_norm = nn.RMSNorm(width)
        self.feed_forward = FeedForward(width)

    def forward(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), freqs)
        return x + self.feed_forward(self.ffn_norm(x))


class RotaryLM(nn.Module):
    """A two-block Llama-like model with torchtitan's rotary reshape."""

    def __init__(self, width: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, width)
        self.layers = nn.ModuleList([RotaryBlock(width) for _ in range(2)])
        self.norm = nn.RMSNorm(width)
        self.output = nn.Linear(width, VOCAB, bias=False)
        half = width // heads // 2
        angles = torch.outer(torch.arange(64).float(), 1.0 / 10000 ** (torch.arange(half) / half))
        self.register_buffer(
            "freqs", torch.polar(torch.ones_like(angles), angles), persistent=False
        )

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x, self.freqs)
        return self.output(self.norm(x))


def rotary_lm() -> RotaryLM:
    return RotaryLM()


ROTARY_RULES = Rules(
    {
        r"tok_embeddings\.weight": P("tp", None),
        r"layers\.\d+\.attention\.w[qkv]\.weight": P("tp", None),
        r"layers\.\d+\.attention\.wo\.weight": P(None, "tp"),
        r"layers\.\d+\.feed_forward\.w1\.weight": P("tp", None),
        r"layers\.\d+\.feed_forward\.w2\.weight": P(None, "tp"),
        r"output\.weight": P("tp", None),
        r".*": P(),
    },
    fsdp="dp",
)


def token_batches(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """8 sequences of 16 token ids and their next tokens."""
    tokens = torch.randint(0, VOCAB, (8, 17), generator=torch.Generator().manual_seed(700 + step))
    return tokens[:, :-1], tokens[:, 1:]


def roberta_classifier() -> nn.Module:
    from transformers import RobertaConfig, RobertaForSequenceClassification

    return RobertaForSequenceClassification(
        RobertaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=80,
            num_labels=4,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            classifier_dropout=0.0,
        )
    )


def megatron(attention: str, out: str, up: str, down: str, **extra: P) -> Rules:
    """Column-wise q/k/v and MLP up, row-wise out and down (weights and biases)."""
    return Rules(
        {
            **extra,
            rf".*\.{attention}\.weight": P("tp", None),
            rf".*\.{attention}\.bias": P("tp"),
            rf".*\.{out}\.weight": P(None, "tp"),
            rf".*\.{up}\.weight": P("tp", None),
            rf".*\.{up}\.bias": P("tp"),
            rf".*\.{down}\.weight": P(None, "tp"),
            r".*": P(),
        },
        fsdp="dp",
        allow_unused=True,
    )


ROBERTA_RULES = megatron(
    r"attention\.self\.(query|key|value)",
    r"attention\.output\.dense",
    r"intermediate\.dense",
    r"layer\.\d+\.output\.dense",
)


def label_batches(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """8 sequences of 16 token ids (from 3: clear of special ids) and a label (0–3) each."""
    generator = torch.Generator().manual_seed(900 + step)
    return torch.randint(3, VOCAB, (8, 16), generator=generator), torch.randint(
        0, 4, (8,), generator=generator
    )
