"""Continuations of prompts from a loaded run (``meshtrain generate``): a batch of prompts,
stop strings, streaming, and a key/value cache.

Each next token comes from the model's logits at the last position (:class:`Sampling` picks it).
The model sees the last ``[train] seq_len`` tokens of the text, as in training. With the cache
(the default), each layer keeps its keys and values, and a step runs the model on its one new
token instead of the whole text: meshtrain's own decoders (Llama, MoE, adapters included) through
their attention's ``attention_fn``, transformers models through their own ``past_key_values``;
any other model runs on the whole text each step. Once the text is longer than the window, every
step runs on the window again (its rotary positions restart at the window's start), cache or not,
so both give the same tokens.

Prompts of the same length in tokens run as one batch; each stops at the end-of-document token,
at the first of ``stop`` strings (cut before it) or after ``max_new_tokens``.

Example::

    run = load_run("runs/debug")
    print(generate(run, "def main(", max_new_tokens=40, temperature=0.0))
    for piece in stream(run, "def main(", sampling=Sampling(top_p=0.9)):
        print(piece, end="", flush=True)
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from meshtrain.errors import RecipeError
from meshtrain.models.llama import Attention, Decoder
from meshtrain.plan.layers import main_output
from meshtrain.recipes.data import recipe_tokenizer
from meshtrain.recipes.evaluation import LoadedRun
from meshtrain.recipes.sampling import Sampling
from meshtrain.train.data.tokenizer import Tokenizer

__all__ = ["Sampling", "generate", "generate_batch", "stream"]


@dataclass(frozen=True)
class _Settings:
    max_new_tokens: int
    sampling: Sampling
    stop: tuple[str, ...]
    seed: int
    cache: bool

    def generator(self) -> torch.Generator:
        """The sampling generator, seeded from ``seed``."""
        return torch.Generator().manual_seed(self.seed)


def generate(
    run: LoadedRun,
    prompt: str,
    *,
    max_new_tokens: int = 64,
    temperature: float = 0.8,
    seed: int = 0,
    tokenizer: Tokenizer | None = None,
    sampling: Sampling | None = None,
    stop: Sequence[str] = (),
    cache: bool = True,
) -> str:
    """A continuation of ``prompt`` (not repeated) from the run's model; ``sampling`` (default:
    ``Sampling(temperature=temperature)``) picks each token, 0 taking the likeliest."""
    return "".join(
        stream(
            run,
            prompt,
            max_new_tokens=max_new_tokens,
            sampling=sampling or Sampling(temperature=temperature),
            seed=seed,
            tokenizer=tokenizer,
            stop=stop,
            cache=cache,
        )
    )


def generate_batch(
    run: LoadedRun,
    prompts: Sequence[str],
    *,
    max_new_tokens: int = 64,
    sampling: Sampling | None = None,
    seed: int = 0,
    tokenizer: Tokenizer | None = None,
    stop: Sequence[str] = (),
    cache: bool = True,
) -> list[str]:
    """A continuation of each prompt, in order; prompts of the same token length run as one
    batch (sampled rows draw from one generator, so a sampled row depends on its batch)."""
    settings = _Settings(max_new_tokens, sampling or Sampling(), tuple(stop), seed, cache)
    tokenizer, generator = tokenizer or recipe_tokenizer(run.recipe), settings.generator()
    encoded = [_encode(tokenizer, prompt) for prompt in prompts]
    texts: list[str] = [""] * len(prompts)
    for length in sorted({len(ids) for ids in encoded}):
        rows = [index for index, ids in enumerate(encoded) if len(ids) == length]
        for texts_now, _ in _continue(
            run, tokenizer, [encoded[i] for i in rows], settings, generator
        ):
            for index, text in zip(rows, texts_now):
                texts[index] = text
    return texts


def stream(
    run: LoadedRun,
    prompt: str,
    *,
    max_new_tokens: int = 64,
    sampling: Sampling | None = None,
    seed: int = 0,
    tokenizer: Tokenizer | None = None,
    stop: Sequence[str] = (),
    cache: bool = True,
) -> Iterator[str]:
    """The continuation of ``prompt`` in pieces, each as soon as it is certain: text that may
    still turn into a stop string, or an unfinished UTF-8 character, is held back."""
    settings = _Settings(max_new_tokens, sampling or Sampling(), tuple(stop), seed, cache)
    tokenizer, generator = tokenizer or recipe_tokenizer(run.recipe), settings.generator()
    shown = 0
    for (text,), (done,) in _continue(
        run, tokenizer, [_encode(tokenizer, prompt)], settings, generator
    ):
        certain = text if done else _certain(text, settings.stop)
        if len(certain) > shown:
            yield certain[shown:]
            shown = len(certain)


def _encode(tokenizer: Tokenizer, prompt: str) -> list[int]:
    ids = tokenizer.encode(prompt)
    if not ids:
        raise RecipeError(f"the prompt {prompt!r} encodes to no tokens; give some text.")
    return ids


def _certain(text: str, stop: tuple[str, ...]) -> str:
    """``text`` without its end that could still begin a stop string or a character."""
    text = text.rstrip("\ufffd")
    held = max((n for s in stop for n in range(1, len(s)) if text.endswith(s[:n])), default=0)
    return text[: len(text) - held]


def _continue(
    run: LoadedRun,
    tokenizer: Tokenizer,
    prompts: list[list[int]],
    settings: _Settings,
    generator: torch.Generator,
) -> Iterator[tuple[list[str], list[bool]]]:
    """After each step: every row's text so far (cut before a stop string) and whether it is
    done. ``prompts`` all have the same length."""
    stepper = _stepper(run.model, run.recipe.train.seq_len, settings.cache)
    context = torch.tensor(prompts)
    start = context.shape[1]
    texts, done = [""] * len(prompts), [False] * len(prompts)
    with torch.no_grad():
        for _ in range(settings.max_new_tokens):
            tokens = settings.sampling.pick(stepper.logits(context), context, generator)
            context = torch.cat([context, tokens[:, None]], dim=1)
            for row, token in enumerate(tokens.tolist()):
                if done[row]:
                    continue
                if token == tokenizer.eos_id:
                    done[row] = True
                    continue
                texts[row], done[row] = _cut(tokenizer.decode(_row(context, row, start)), settings)
            yield texts, done
            if all(done):
                return
    yield texts, [True] * len(prompts)


def _row(context: Tensor, row: int, start: int) -> list[int]:
    return [int(token) for token in context[row, start:]]


def _cut(text: str, settings: _Settings) -> tuple[str, bool]:
    found = [text.index(s) for s in settings.stop if s and s in text]
    return (text[: min(found)], True) if found else (text, False)


class _Stepper(Protocol):
    def logits(self, context: Tensor) -> Tensor:
        """``[batch, vocab]`` logits after the last token of ``context`` ``[batch, n]``."""


def _stepper(model: nn.Module, window: int, cache: bool) -> _Stepper:
    if cache and isinstance(model, Decoder) and _plain_attention(model):
        return _DecoderCache(model, window)
    keyword = _cache_keyword(model) if cache else None
    if keyword is not None:
        return _TransformersCache(model, window, keyword)
    return _Whole(model, window)


def _cache_keyword(model: nn.Module) -> str | None:
    """The keyword a transformers model takes its key/value cache by (``cache`` since
    transformers 5.24, ``past_key_values`` before), or None for other models."""
    parameters = inspect.signature(model.forward).parameters
    if "use_cache" not in parameters:
        return None
    return next((name for name in ("cache", "past_key_values") if name in parameters), None)


def _plain_attention(model: nn.Module) -> bool:
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    return bool(layers) and all(layer.attention_fn is None for layer in layers)


class _Whole:
    """Any model: the whole text (its last ``window`` tokens) every step."""

    def __init__(self, model: nn.Module, window: int) -> None:
        self.model, self.window = model, window

    def logits(self, context: Tensor) -> Tensor:
        return main_output(self.model(context[:, -self.window :]))[:, -1].float()


class _KeysValues:
    """One attention layer's cache, as its ``attention_fn``: the keys and values of every token
    so far, each step's new ones appended. Tokens arrive as one prompt (nothing cached yet:
    causal attention) or one at a time (the new query sees every key)."""

    def __init__(self) -> None:
        self.keys: Tensor | None = None
        self.values: Tensor | None = None

    def __call__(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        if self.keys is not None and self.values is not None:
            k, v = torch.cat([self.keys, k], dim=2), torch.cat([self.values, v], dim=2)
        self.keys, self.values = k, v
        prompt = q.shape[2] > 1
        if prompt and k.shape[2] != q.shape[2]:
            raise RecipeError("the key/value cache takes a prompt only before any token")
        return F.scaled_dot_product_attention(q, k, v, is_causal=prompt, enable_gqa=True)


class _DecoderCache:
    """meshtrain's decoders: each attention layer's keys and values kept between steps."""

    def __init__(self, model: Decoder, window: int) -> None:
        self.model, self.window, self.cached = model, window, 0
        self.layers = [m for m in model.modules() if isinstance(m, Attention)]
        self.caches = [_KeysValues() for _ in self.layers]

    def logits(self, context: Tensor) -> Tensor:
        length = context.shape[1]
        if length > self.window:  # the window slides: nothing cached still holds
            self.cached = 0
            return _Whole(self.model, self.window).logits(context)
        if self.cached == 0:
            self.caches = [_KeysValues() for _ in self.layers]
        with self._installed():
            positions = torch.arange(self.cached, length)
            out = self.model(context[:, self.cached :], positions=positions)
        self.cached = length
        return out[:, -1].float()

    @contextlib.contextmanager
    def _installed(self) -> Iterator[None]:
        for layer, cache in zip(self.layers, self.caches):
            layer.attention_fn = cache
        try:
            yield
        finally:
            for layer in self.layers:
                del layer.attention_fn  # the class's default (PyTorch's causal SDPA) again


class _TransformersCache:
    """transformers models: their own key/value cache kept between steps."""

    def __init__(self, model: nn.Module, window: int, keyword: str = "cache") -> None:
        self.model, self.window, self.cached, self.keyword = model, window, 0, keyword
        self.past: object = None

    def logits(self, context: Tensor) -> Tensor:
        length = context.shape[1]
        if length > self.window:
            self.cached, self.past = 0, None
            return _Whole(self.model, self.window).logits(context)
        cache = {self.keyword: self.past}
        out = self.model(context[:, self.cached :], use_cache=True, **cache)
        self.past, self.cached = out[self.keyword], length
        return main_output(out)[:, -1].float()
