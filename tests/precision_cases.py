"""Low-precision equivalence cases over models meshtrain did not write: the families, plans and
options the false-alarm benchmark (``benchmarks/false_alarms.py``) and the bf16/fp16 tests draw.

A case is one ``assert_equivalent`` call: a family (a model factory, its batches and the rules a
user writes for it), a plan kind (FSDP over 4 ranks at ZeRO 2 or 3, dp 2 × tp 2 with or without
sequence parallelism, pp 2 × dp 2, ep 2 × dp 2, cp 2 × dp 2), a precision, activation
checkpointing, a seed, a step count and an optimizer. Plain modules are drawn too
(:func:`plain_nets`): token or feature inputs, 1–3 residual blocks with a LayerNorm, an RMSNorm
or none, an activation, and a head tied to the embedding or not. Factories live at module level
so ranks can import them (a drawn net's factory is a picklable partial of its config).

Example:
    >>> case = Case("mistral", "tp", "bf16", None, seed=0, steps=2, optimizer="adamw")
    >>> case.mesh
    {'dp': 2, 'tp': 2}
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import families
import moe_models
import torch
import zoo
from hypothesis import strategies as st
from torch import nn
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    RobertaConfig,
    RobertaForSequenceClassification,
)

import meshtrain as mt
from meshtrain import P, Rules
from meshtrain.models import LlamaConfig as OwnLlamaConfig
from meshtrain.models import MoEConfig, build_llama, build_moe
from meshtrain.models import default_rules as llama_rules
from meshtrain.models.moe import default_rules as moe_rules

logging.getLogger("transformers").setLevel(logging.ERROR)

Batch = tuple[torch.Tensor, torch.Tensor]
VOCAB = 128
LABELS = 4


# ----------------------------------------------------------------------------- models


def hf_llama() -> nn.Module:
    """The issue's replay model: transformers' Llama, hidden 64, vocabulary 256."""
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            use_cache=False,
        )
    )


def own_llama() -> nn.Module:
    """meshtrain's Llama (hidden 32, 2 layers), initialised from the harness's seed."""
    config = OwnLlamaConfig(
        dim=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        vocab_size=VOCAB,
        multiple_of=32,
        max_seq_len=64,
    )
    return build_llama(config, seed=torch.initial_seed())


def own_moe() -> nn.Module:
    """meshtrain's MoE (hidden 32, 2 layers), initialised from the harness's seed."""
    return build_moe(
        MoEConfig.debug(dim=32, n_layers=2, vocab_size=VOCAB), seed=torch.initial_seed()
    )


def roberta_classifier() -> nn.Module:
    """RoBERTa with its sequence-classification head (4 labels)."""
    config = RobertaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        classifier_dropout=0.0,
        pad_token_id=1,
        type_vocab_size=2,
        num_labels=LABELS,
    )
    return RobertaForSequenceClassification(config)


@dataclass(frozen=True)
class NetConfig:
    """A drawn plain module: ``tokens`` (an embedding) or features in, ``depth`` residual
    blocks ``x + fc2(act(fc1(norm(x))))``, a head (tied to the embedding when ``tied``)."""

    tokens: bool = True
    width: int = 16
    hidden: int = 32
    depth: int = 2
    norm: str = "layer"  # "layer", "rms" or "none"
    activation: str = "gelu"  # "gelu", "relu", "silu" or "tanh"
    tied: bool = False
    classes: int = 16


class _Block(nn.Module):
    def __init__(self, config: NetConfig) -> None:
        super().__init__()
        norms = {"layer": nn.LayerNorm, "rms": nn.RMSNorm}
        self.norm = norms[config.norm](config.width) if config.norm in norms else nn.Identity()
        self.fc1 = nn.Linear(config.width, config.hidden)
        self.act = {"gelu": nn.GELU, "relu": nn.ReLU, "silu": nn.SiLU, "tanh": nn.Tanh}[
            config.activation
        ]()
        self.fc2 = nn.Linear(config.hidden, config.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.act(self.fc1(self.norm(x))))


class PlainNet(nn.Module):
    """A plain module of :class:`NetConfig`'s shape (see there)."""

    def __init__(self, config: NetConfig) -> None:
        super().__init__()
        self.config = config
        classes = VOCAB if config.tokens else config.classes
        self.stem: nn.Module = (
            nn.Embedding(VOCAB, config.width) if config.tokens else nn.Linear(8, config.width)
        )
        self.blocks = nn.ModuleList(_Block(config) for _ in range(config.depth))
        self.head = nn.Linear(config.width, classes, bias=not config.tied)
        if config.tied and config.tokens:
            self.head.weight = self.stem.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def plain_net(config: NetConfig) -> nn.Module:
    return PlainNet(config)


@st.composite
def plain_nets(draw: st.DrawFn) -> NetConfig:
    """Drawn plain modules (widths even, so tensor parallelism over 2 splits them)."""
    tokens = draw(st.booleans())
    return NetConfig(
        tokens=tokens,
        width=draw(st.sampled_from([8, 16, 24, 32])),
        hidden=draw(st.sampled_from([16, 32, 64])),
        depth=draw(st.integers(1, 3)),
        norm=draw(st.sampled_from(["layer", "rms", "none"])),
        activation=draw(st.sampled_from(["gelu", "relu", "silu", "tanh"])),
        tied=tokens and draw(st.booleans()),
        classes=draw(st.sampled_from([4, 10, 16])),
    )


# ----------------------------------------------------------------------------- batches


def tokens(step: int, vocab: int = VOCAB) -> Batch:
    """8 sequences of 16 token ids (from 3: clear of pad/bos/eos ids) and their next tokens."""
    ids = torch.randint(3, vocab, (8, 17), generator=torch.Generator().manual_seed(4321 + step))
    return ids[:, :-1], ids[:, 1:]


def llama_tokens(step: int) -> Batch:
    return tokens(step, 256)


def moe_tokens(step: int) -> Batch:
    return tokens(step, moe_models.VOCAB)


def labelled_tokens(step: int) -> Batch:
    """8 sequences of 16 token ids and one label each."""
    generator = torch.Generator().manual_seed(600 + step)
    ids = torch.randint(3, VOCAB, (8, 16), generator=generator)
    return ids, torch.randint(0, LABELS, (8,), generator=generator)


def features(step: int) -> Batch:
    """8 feature vectors of 8 and their labels (for a drawn net's feature stem)."""
    generator = torch.Generator().manual_seed(700 + step)
    return torch.randn(8, 8, generator=generator), torch.randint(0, 4, (8,), generator=generator)


def vit_images(step: int) -> Batch:
    return zoo.image_batches(step)


# ----------------------------------------------------------------------------- rules

ENCODER_RULES = Rules(
    {
        r".*\.attention\.self\.(query|key|value)\.weight": P("tp", None),
        r".*\.attention\.self\.(query|key|value)\.bias": P("tp"),
        r".*\.attention\.output\.dense\.weight": P(None, "tp"),
        r".*\.intermediate\.dense\.weight": P("tp", None),
        r".*\.intermediate\.dense\.bias": P("tp"),
        r".*\.layer\.\d+\.output\.dense\.weight": P(None, "tp"),
        r".*": P(),
    },
    fsdp="dp",
)

PLAIN_RULES = Rules(
    {
        r"blocks\.\d+\.fc1\.(weight|bias)": P("tp"),
        r"blocks\.\d+\.fc2\.weight": P(None, "tp"),
        r".*": P(),
    },
    fsdp="dp",
)

RulesFn = Callable[[nn.Module, bool], Rules]


def _from_hf(model: nn.Module, sp: bool) -> Rules:
    return Rules.from_hf(model, fsdp="dp", sequence_parallel=sp)


def _fixed(rules: Rules) -> RulesFn:
    def rules_for(model: nn.Module, sp: bool) -> Rules:
        return zoo.with_sequence_parallelism(rules) if sp else rules

    return rules_for


def _own_llama(model: nn.Module, sp: bool) -> Rules:
    return llama_rules(sequence_parallel=sp)


def _own_moe(model: nn.Module, sp: bool) -> Rules:
    return moe_rules(sequence_parallel=sp)


# ----------------------------------------------------------------------------- families


@dataclass(frozen=True)
class Family:
    """A model factory, its batches, its tensor-parallel rules and what it can be planned with
    (``decoder``: context parallelism; ``moe``: expert parallelism; ``pipeline``)."""

    build: Callable[[], nn.Module]
    batches: Callable[[int], Batch]
    tp_rules: RulesFn | None
    decoder: bool = False
    moe: bool = False
    pipeline: bool = True
    ep_rules: Rules | None = None


FAMILIES: dict[str, Family] = {
    "meshtrain-llama": Family(own_llama, tokens, _own_llama, decoder=True),
    "meshtrain-moe": Family(
        own_moe, tokens, _own_moe, decoder=True, moe=True, ep_rules=moe_rules(tp=None, ep="ep")
    ),
    "hf-llama": Family(hf_llama, llama_tokens, _from_hf, decoder=True),
    "qwen2": Family(zoo.qwen2, tokens, _from_hf, decoder=True),
    "qwen3": Family(zoo.qwen3, tokens, _from_hf, decoder=True),
    "mistral": Family(families.mistral, tokens, _from_hf, decoder=True),
    "gemma2": Family(zoo.gemma2, tokens, _from_hf),
    "phi3": Family(zoo.phi3, tokens, _from_hf),
    "olmo2": Family(zoo.olmo2, tokens, _from_hf),
    "gpt2": Family(zoo.gpt2, tokens, _fixed(zoo.GPT2_RULES)),
    "bert": Family(zoo.bert, tokens, _fixed(zoo.BERT_RULES)),
    "roberta-classifier": Family(roberta_classifier, labelled_tokens, _fixed(ENCODER_RULES)),
    "opt": Family(zoo.opt, tokens, _fixed(zoo.OPT_RULES)),
    "bart": Family(zoo.bart, tokens, _fixed(zoo.BART_RULES), pipeline=False),
    "t5": Family(zoo.t5, tokens, _fixed(zoo.T5_RULES), pipeline=False),
    "qwen2-moe": Family(
        moe_models.qwen2_moe, moe_tokens, _from_hf, moe=True, ep_rules=moe_models.ep_rules()
    ),
    "mixtral": Family(
        moe_models.mixtral, moe_tokens, _from_hf, moe=True, ep_rules=moe_models.ep_rules()
    ),
    "vit": Family(zoo.vit, vit_images, _fixed(zoo.VIT_RULES)),
    "cnn-batchnorm": Family(zoo.cnn, zoo.image_batches, None),
}

PLANS = ("fsdp-zero2", "fsdp-zero3", "tp", "tp-sp", "pp", "ep", "cp")
REPLICATED = Rules({r".*": P()}, fsdp="dp")


def plans_for(family: Family) -> tuple[str, ...]:
    """The plan kinds a family can be drawn with."""
    kinds = ["fsdp-zero2", "fsdp-zero3"]
    if family.tp_rules is not None:
        kinds += ["tp", "tp-sp"]
    if family.pipeline:
        kinds.append("pp")
    if family.moe:
        kinds.append("ep")
    if family.decoder:
        kinds.append("cp")
    return tuple(kinds)


# ----------------------------------------------------------------------------- cases


@dataclass(frozen=True)
class Case:
    """One low-precision equivalence check (see the module doc); ``net`` for a drawn module."""

    family: str
    plan: str
    precision: str
    checkpointing: str | None
    seed: int
    steps: int
    optimizer: str
    net: NetConfig | None = None

    @property
    def mesh(self) -> dict[str, int]:
        second = {"tp": "tp", "tp-sp": "tp", "pp": "pp", "ep": "ep", "cp": "cp"}.get(self.plan)
        if second == "pp":
            return {"pp": 2, "dp": 2}
        return {"dp": 2, second: 2} if second else {"dp": 4}

    def model_fn(self) -> Callable[[], nn.Module]:
        if self.net is not None:
            return functools.partial(plain_net, self.net)
        return FAMILIES[self.family].build

    def batches(self) -> Callable[[int], Batch]:
        if self.net is not None:
            return tokens if self.net.tokens else features
        return FAMILIES[self.family].batches

    def options(self, model: nn.Module) -> dict[str, Any]:
        """``mt.plan`` options (the rules under ``"rules"``)."""
        options: dict[str, Any] = {"precision": self.precision}
        if self.checkpointing:
            options["activation_checkpointing"] = self.checkpointing
        family = FAMILIES.get(self.family)
        if self.plan.startswith("fsdp"):
            options["zero"] = 2 if self.plan == "fsdp-zero2" else 3
            options["rules"] = REPLICATED
        elif self.plan in ("tp", "tp-sp"):
            rules_fn = _fixed(PLAIN_RULES) if self.net is not None else family.tp_rules
            assert rules_fn is not None
            options["rules"] = rules_fn(model, self.plan == "tp-sp")
        elif self.plan == "pp":
            options["rules"] = REPLICATED
            options["pipeline"] = mt.Pipeline(microbatches=2)
        elif self.plan == "ep":
            assert family is not None and family.ep_rules is not None
            options["rules"] = family.ep_rules
        else:  # cp
            options["rules"] = Rules({".*": P()}, fsdp="dp", logical=[("seq", "cp")])
            options["seq_len"] = 16
        return options

    def describe(self) -> str:
        name = self.family if self.net is None else f"plain{self.net}"
        return (
            f"{name} {self.plan} {self.precision} ac={self.checkpointing} seed={self.seed} "
            f"steps={self.steps} {self.optimizer}"
        )


@st.composite
def cases(draw: st.DrawFn, precisions: tuple[str, ...] = ("bf16", "fp16")) -> Case:
    """A drawn case: a family (or a plain module) and a plan kind it admits, a precision,
    checkpointing or not, a seed in 0–4, 1–3 steps, AdamW or SGD."""
    family = draw(st.sampled_from([*FAMILIES, "plain"]))
    net = draw(plain_nets()) if family == "plain" else None
    kinds = (
        ("fsdp-zero2", "fsdp-zero3", "tp", "tp-sp", "pp") if net else plans_for(FAMILIES[family])
    )
    return Case(
        family=family,
        plan=draw(st.sampled_from(kinds)),
        precision=draw(st.sampled_from(precisions)),
        checkpointing=draw(st.sampled_from([None, "full"])),
        seed=draw(st.integers(0, 4)),
        steps=draw(st.integers(1, 3)),
        optimizer=draw(st.sampled_from(["adamw", "sgd"])),
        net=net,
    )
