"""Shared test helpers: a model that is not meshtrain's, cached meshes for rank tasks, rule sets."""

from __future__ import annotations

import functools

import torch
from torch import nn

from meshtrain import Mesh, P, Rules, full_tensor, make_mesh


class TiedMLP(nn.Module):
    """Embedding, two residual MLP blocks with biases, and an output head tied to the embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)) for _ in range(2)
        )
        self.head = nn.Linear(16, 32, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


class StackedMLP(nn.Module):
    """Embedding, a ``ModuleList`` of residual MLP blocks with biases, a LayerNorm and an untied
    head with a bias. Any unit may be ``None`` (a pipeline stage without it)."""

    def __init__(self, vocab: int = 64, dim: int = 16, n_blocks: int = 4) -> None:
        super().__init__()
        self.embed: nn.Embedding | None = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
            for _ in range(n_blocks)
        )
        self.norm: nn.LayerNorm | None = nn.LayerNorm(dim)
        self.head: nn.Linear | None = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) if self.embed is not None else tokens
        for block in self.blocks:
            h = h + block(h)
        h = self.norm(h) if self.norm is not None else h
        return self.head(h) if self.head is not None else h


class ProjectionPair(nn.Module):
    """Two projections of one input, returned together (like torchtitan's ``qkv_linear``)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.gate(x), self.up(x)


class GatedMixer(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.projections = ProjectionPair(dim, hidden)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.projections(x)
        return self.down(torch.nn.functional.silu(gate) * up)


class GroupedBlock(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(dim)
        self.mixer = GatedMixer(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mixer(self.norm(x))


class GroupedLM(nn.Module):
    """A language model whose column-wise Linears sit one module below the row-wise one they
    feed (``mixer.projections.gate``/``up`` → ``mixer.down``), as in torchtitan's attention."""

    def __init__(
        self, vocab: int = 256, dim: int = 32, hidden: int = 64, n_blocks: int = 2
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(GroupedBlock(dim, hidden) for _ in range(n_blocks))
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def grouped_rules(fsdp: str | tuple[str, ...], *, sequence_parallel: bool = False) -> Rules:
    """Tensor-parallel rules for ``GroupedLM``: projections column-wise, ``down`` row-wise,
    embedding and head on the vocab."""
    return Rules(
        {
            r"blocks\.\d+\.mixer\.projections\.(gate|up)\.weight": P("tp", None),
            r"blocks\.\d+\.mixer\.down\.weight": P(None, "tp"),
            r"(embed|head)\.weight": P("tp", None),
            r".*": P(),
        },
        logical=(("seq", "tp"),) if sequence_parallel else (),
        fsdp=fsdp,
    )


def world_size(axes: tuple[tuple[str, int], ...]) -> int:
    """Ranks a mesh layout needs."""
    size = 1
    for _, n in axes:
        size *= n
    return size


def mlp_rules(fsdp: str | tuple[str, ...]) -> Rules:
    """Tensor-parallel rules for ``blocks.N`` MLPs: first Linear column-wise, last row-wise."""
    return Rules(
        {
            r"blocks\.\d+\.0\.(weight|bias)": P("tp"),
            r"blocks\.\d+\.2\.weight": P(None, "tp"),
            r".*": P(),
        },
        fsdp=fsdp,
    )


@functools.cache
def mesh_for(axes: tuple[tuple[str, int], ...]) -> Mesh:
    """One mesh per layout per rank process (building a DeviceMesh creates process groups)."""
    return make_mesh(dict(axes))


def attention_rowwise_only_rules(data_axes: tuple[str, ...]) -> Rules:
    """Llama rules with replicated q/k/v and a row-wise attention output: an unpaired row-wise
    Linear that takes a replicated input and slices it locally."""
    return Rules(
        {
            r".*attention\.w[qkv]\.weight": P(),
            r".*attention\.wo\.weight": P(None, "tp"),
            r".*feed_forward\.w[13]\.weight": P("tp", None),
            r".*feed_forward\.w2\.weight": P(None, "tp"),
            r".*": P(),
        },
        fsdp=data_axes,
    )


#: The global value of a DTensor (a plain tensor is already global).
full = full_tensor


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest absolute difference relative to ``b``'s largest magnitude."""
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


def worst_grad_error(model: nn.Module, reference: nn.Module) -> float:
    """The largest relative gradient difference between a planned model and its reference."""
    ref_params = dict(reference.named_parameters())
    return max(
        rel(full(param.grad), ref_params[fqn].grad)  # type: ignore[arg-type]
        for fqn, param in model.named_parameters()
    )


class ResidualMLPClassifier(nn.Module):
    """A model meshtrain does not know: features → residual MLP blocks → class logits.

    The "test your own model" guide (docs/testing.md) uses it as written here.
    """

    def __init__(self, features: int = 16, hidden: int = 64, classes: int = 8, depth: int = 2):
        super().__init__()
        self.stem = nn.Linear(features, hidden)
        self.blocks = nn.ModuleList(
            nn.Sequential(
                nn.LayerNorm(hidden),
                nn.Linear(hidden, 4 * hidden),
                nn.GELU(),
                nn.Linear(4 * hidden, hidden),
            )
            for _ in range(depth)
        )
        self.head = nn.Linear(hidden, classes)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        h = self.stem(features)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def classifier_batches(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A seeded global batch of 8 feature vectors and their class labels."""
    generator = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, 16, generator=generator), torch.randint(0, 8, (8,), generator=generator)
