"""Golden plans: the plan each architecture of the project's zoo gets (``Plan.to_json()``:
layouts, styles, FSDP units and their decisions, partial gradients, collectives, memory), stored
under ``tests/golden/plans/`` and compared by ``tests/test_golden_plans.py`` in the first tier, so
a change that alters any plan shows as a diff. A plan refused at plan time is stored as its
refusal (error type and message).

Regenerate after an intended change, and review the diff like code::

    python -m tests.golden --update            # every case
    python -m tests.golden --update gpt2-tp    # some

Example:
    >>> "llama3-8b-recipe" in CASES and "opt-tp-refused" in CASES
    True
"""

from __future__ import annotations

import difflib
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

PLANS = Path(__file__).resolve().parent / "plans"
ROOT = Path(__file__).resolve().parents[2]


def _mesh(**axes: int) -> Any:
    import meshtrain as mt

    return mt.make_mesh(axes, world_size=math.prod(axes.values()), abstract=True)


def _zoo(factory: str, rules: Callable[[Any], Any], axes: dict[str, int], **options: Any) -> Any:
    """A zoo model planned on an abstract mesh (sized activations: batch 2 × 16 tokens)."""

    def build() -> Any:
        import zoo

        import meshtrain as mt

        model = getattr(zoo, factory)()
        options.setdefault("batch_size", 2)
        if factory not in ("vit", "cnn"):
            options.setdefault("seq_len", 16)
        return mt.plan(model, _mesh(**axes), rules(model), **options)

    return build


def _recipe(name: str, world: int) -> Any:
    """A shipped recipe under ``recipes/`` planned at ``world`` ranks, as ``meshtrain plan`` does."""

    def build() -> Any:
        from meshtrain.recipes import load_recipe
        from meshtrain.recipes.sizing import size_recipe

        return size_recipe(
            load_recipe(str(ROOT / "recipes" / f"{name}.toml"), []), world=world
        ).plan

    return build


def _preset(preset: str, axes: dict[str, int], **options: Any) -> Any:
    def build() -> Any:
        import meshtrain as mt
        from meshtrain.models import LlamaConfig, build_llama, default_rules

        model = build_llama(LlamaConfig.preset(preset), device="meta")
        return mt.plan(model, _mesh(**axes), default_rules(), **options)

    return build


def _rules(name: str) -> Callable[[Any], Any]:
    def rules(model: Any) -> Any:
        import zoo

        return getattr(zoo, name)

    return rules


def _hf(sequence_parallel: bool = False) -> Callable[[Any], Any]:
    def rules(model: Any) -> Any:
        import zoo

        return zoo.hf_rules(model, sequence_parallel=sequence_parallel)

    return rules


def _sp(name: str) -> Callable[[Any], Any]:
    def rules(model: Any) -> Any:
        import zoo

        return zoo.with_sequence_parallelism(getattr(zoo, name))

    return rules


def _pipeline(**kwargs: Any) -> Any:
    import meshtrain as mt

    return mt.Pipeline(**kwargs)


TP = {"dp": 2, "tp": 2}
DP4 = {"dp": 4}
CASES: dict[str, Callable[[], Any]] = {
    # the zoo (tests/zoo.py), under the rules its tests use
    "llama-tp": _zoo("llama", _hf(), TP),
    "llama-tp-sp": _zoo("llama", _hf(True), TP),
    "llama-fsdp-zero2": _zoo("llama", _rules("REPLICATED"), DP4, zero=2),
    "qwen2-tp": _zoo("qwen2", _hf(), TP),
    "qwen3-tp": _zoo("qwen3", _hf(), TP),
    "olmo2-tp-zero3": _zoo("olmo2", _hf(), TP, zero=3),
    "gpt2-tp-tied": _zoo("gpt2", _rules("GPT2_RULES"), TP),
    "bert-tp-sp-tied": _zoo("bert", _sp("BERT_RULES"), TP),
    "vit-tp": _zoo("vit", _rules("VIT_RULES"), TP, zero=3),
    "cnn-fsdp-zero3": _zoo("cnn", _rules("REPLICATED"), DP4, zero=3),
    "bart-tp": _zoo("bart", _rules("BART_RULES"), TP),
    "t5-fsdp": _zoo("t5", _rules("REPLICATED"), DP4, zero=3),
    "t5-tp-refused": _zoo("t5", _rules("T5_RULES"), TP),
    "gpt-neox-tp-refused": _zoo("gpt_neox", _hf(), TP),
    "gpt-neox-fsdp": _zoo("gpt_neox", _rules("REPLICATED"), DP4, zero=3),
    "phi3-tp-fused": _zoo("phi3", _hf(), TP),
    "opt-tp-refused": _zoo("opt", _rules("OPT_RULES"), TP),
    "opt-fsdp": _zoo("opt", _rules("REPLICATED"), DP4, zero=3),
    "gemma2-tp-softcap": _zoo("gemma2", _hf(), TP),
    "gpt2-untied-pp-fsdp": _zoo(
        "gpt2_untied",
        _rules("REPLICATED"),
        {"pp": 2, "dp": 2},
        zero=3,
        pipeline=_pipeline(microbatches=2),
    ),
    # meshtrain's own Llama: a preset, and every shipped recipe
    "llama-debug-preset-tp": _preset("debug", TP),
    "debug-recipe": _recipe("debug", 4),
    "debug-lora-recipe": _recipe("debug_lora", 4),
    "llama3-8b-recipe": _recipe("llama3_8b", 16),
    "llama3-8b-lora-recipe": _recipe("llama3_8b_lora", 16),
    "llama3-70b-recipe": _recipe("llama3_70b", 64),
    "llama3-70b-qlora-recipe": _recipe("llama3_70b_qlora", 16),
    "llama3-405b-recipe": _recipe("llama3_405b", 256),
}


def current(name: str) -> str:
    """The case's plan JSON now (or its refusal, as JSON)."""
    from meshtrain.errors import MeshtrainError

    try:
        return CASES[name]().to_json() + "\n"
    except MeshtrainError as error:
        return json.dumps({"refused": type(error).__name__, "message": str(error)}, indent=1) + "\n"


def path(name: str) -> Path:
    return PLANS / f"{name}.json"


def diff(name: str, now: str, limit: int = 80) -> str:
    """A unified diff of the stored plan against ``now`` (at most ``limit`` lines)."""
    stored = path(name).read_text() if path(name).exists() else ""
    lines = list(
        difflib.unified_diff(
            stored.splitlines(),
            now.splitlines(),
            f"tests/golden/plans/{name}.json (stored)",
            f"{name} (planned now)",
            lineterm="",
            n=2,
        )
    )
    more = f"\n... {len(lines) - limit} more lines" if len(lines) > limit else ""
    return "\n".join(lines[:limit]) + more
