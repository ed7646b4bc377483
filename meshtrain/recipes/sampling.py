"""How ``meshtrain generate`` picks each next token: :class:`Sampling`, its settings declared once
(the dataclass field, its check, its command-line flag and help).

Order of the steps, as in Hugging Face's ``generate``: the repetition penalty on the raw logits
(CTRL's rule: a seen token's positive logit divided by it, a negative one multiplied), then the
likeliest token when ``temperature`` is 0, else the logits divided by the temperature, cut to the
``top_k`` likeliest and to the smallest set whose probability reaches ``top_p`` (the likeliest
token always kept), and one token drawn from what is left.

Example:
    >>> import torch
    >>> logits = torch.tensor([[2.0, 1.0, 0.5]])
    >>> Sampling(temperature=0).pick(logits, torch.tensor([[0]]), torch.Generator()).tolist()
    [0]
    >>> Sampling(temperature=0, repetition_penalty=4.0).pick(
    ...     logits, torch.tensor([[0]]), torch.Generator()
    ... ).tolist()
    [1]
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from meshtrain.errors import RecipeError

if TYPE_CHECKING:  # torch is imported when a token is picked: the command line parses without it
    import torch
    from torch import Tensor

__all__ = ["Sampling", "sampling_flags"]


def _finite_at_least(low: float) -> Callable[[float], str | None]:
    def check(value: float) -> str | None:
        return None if math.isfinite(value) and value >= low else f"a number ≥ {low:g}"

    return check


def _whole_at_least(low: int) -> Callable[[float], str | None]:
    def check(value: float) -> str | None:
        whole = math.isfinite(value) and value == int(value)
        return None if whole and value >= low else f"a whole number ≥ {low}"

    return check


def _share(value: float) -> str | None:
    return None if 0 < value <= 1 else "a number in (0, 1]"


def _positive(value: float) -> str | None:
    return None if math.isfinite(value) and value > 0 else "a number > 0"


def _setting(default: float, flag: str, check: Callable[[float], str | None], text: str) -> Any:
    """A :class:`Sampling` field: its default, command-line flag, check and help, declared once."""
    return field(default=default, metadata={"flag": flag, "check": check, "help": text})


@dataclass(frozen=True)
class Sampling:
    """The next-token rule of :func:`meshtrain.recipes.generation.generate`; every setting is
    checked when built (a :class:`RecipeError` naming it and what it must be)."""

    temperature: float = _setting(
        0.8, "--temperature", _finite_at_least(0), "0 takes the likeliest token (default 0.8)"
    )
    top_k: int = _setting(
        0, "--top-k", _whole_at_least(0), "draw among the K likeliest tokens only (default 0: all)"
    )
    top_p: float = _setting(
        1.0,
        "--top-p",
        _share,
        "draw among the likeliest tokens whose probabilities sum to P (default 1: all)",
    )
    repetition_penalty: float = _setting(
        1.0,
        "--repetition-penalty",
        _positive,
        "> 1 makes tokens already in the text less likely (default 1: none)",
    )

    def __post_init__(self) -> None:
        for name, flag, check, _ in _declared():
            value = getattr(self, name)
            wrong = _wrong(check, value)
            if wrong:
                raise RecipeError(
                    f"sampling {name} = {value!r} ({flag}) must be {wrong}; "
                    f"{flag} {_described(name)}."
                )

    def pick(self, logits: Tensor, history: Tensor, generator: torch.Generator) -> Tensor:
        """One token id per row of ``logits`` ``[batch, vocab]``; ``history`` ``[batch, n]``
        holds each row's tokens so far (the prompt included) for the repetition penalty."""
        import torch

        logits = logits.float().clone()
        if self.repetition_penalty != 1 and history.numel():
            seen = logits.gather(1, history)
            penalty = self.repetition_penalty
            logits.scatter_(1, history, torch.where(seen > 0, seen / penalty, seen * penalty))
        if self.temperature == 0:
            return logits.argmax(-1)
        logits = logits / self.temperature
        if 0 < self.top_k < logits.shape[-1]:
            kth = logits.topk(self.top_k, dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, -math.inf)
        if self.top_p < 1:
            logits = _nucleus(logits, self.top_p)
        probs = torch.softmax(logits, dim=-1)
        return torch.multinomial(probs, 1, generator=generator)[:, 0]


def _nucleus(logits: Tensor, top_p: float) -> Tensor:
    """``logits`` with every token outside the smallest likeliest set reaching ``top_p`` of the
    probability masked out (the likeliest token is always kept)."""
    import torch

    ordered, order = logits.sort(dim=-1, descending=True)
    probs = torch.softmax(ordered, dim=-1)
    before = probs.cumsum(-1) - probs  # the mass of the likelier tokens
    ordered = ordered.masked_fill(before >= top_p, -math.inf)
    return torch.full_like(logits, -math.inf).scatter(-1, order, ordered)


def _declared() -> Iterator[tuple[str, str, Callable[[float], str | None], str]]:
    for declared in fields(Sampling):
        meta = declared.metadata
        yield declared.name, meta["flag"], meta["check"], meta["help"]


def _wrong(check: Callable[[float], str | None], value: Any) -> str | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return check(math.nan) or "a number"
    return check(float(value))


def _described(name: str) -> str:
    return next(text for field_name, _, _, text in _declared() if field_name == name)


def sampling_flags() -> Iterator[tuple[str, dict[str, Any]]]:
    """``(flag, add_argument keywords)`` for each :class:`Sampling` setting, checked by the
    same rule as the dataclass (``argparse`` says which flag and why in one line)."""
    for name, flag, check, text in _declared():
        default = next(f.default for f in fields(Sampling) if f.name == name)
        yield (
            flag,
            {
                "dest": name,
                "type": _parser(flag, check, int if isinstance(default, int) else float),
                "default": default,
                "metavar": name.split("_")[-1][0].upper(),
                "help": text,
            },
        )


def _parser(flag: str, check: Callable[[float], str | None], kind: type) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            value = math.nan
        wrong = _wrong(check, value)
        if wrong:
            raise argparse.ArgumentTypeError(f"{text!r} is not {wrong}")
        return value

    return parse
