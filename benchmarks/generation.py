"""``meshtrain generate``'s key/value cache against running the model on the whole text each
step: 256 new tokens (greedy) after a 16-token prompt, on meshtrain's Llama and on a transformers
Qwen2 of the same shape, one process. Both ways must give the same tokens (checked); reported:
the median wall time of each over ``--rounds`` rounds (alternating order, so machine drift hits
both alike), tokens per second and the cache's speed-up.

Usage::

    python benchmarks/generation.py --rounds 3 --out benchmarks/results/generation.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from provenance import provenance
from torch import nn

from meshtrain.models import LlamaConfig, build_llama
from meshtrain.recipes.evaluation import LoadedRun
from meshtrain.recipes.generation import generate
from meshtrain.train.data.tokenizer import ByteTokenizer

PROMPT = "def main(argv):\n"  # 16 bytes: 16 tokens of the byte tokenizer
SHAPE = {"dim": 256, "layers": 4, "heads": 8, "kv_heads": 4, "ffn": 768, "vocab": 256}


def llama() -> nn.Module:
    config = LlamaConfig(
        dim=SHAPE["dim"],
        n_layers=SHAPE["layers"],
        n_heads=SHAPE["heads"],
        n_kv_heads=SHAPE["kv_heads"],
        vocab_size=SHAPE["vocab"],
        multiple_of=SHAPE["ffn"],
        ffn_dim_multiplier=None,
        max_seq_len=512,
    )
    return build_llama(config, seed=0)


def qwen2() -> nn.Module:
    import transformers

    config = transformers.Qwen2Config(
        vocab_size=SHAPE["vocab"],
        hidden_size=SHAPE["dim"],
        intermediate_size=SHAPE["ffn"],
        num_hidden_layers=SHAPE["layers"],
        num_attention_heads=SHAPE["heads"],
        num_key_value_heads=SHAPE["kv_heads"],
        max_position_embeddings=512,
    )
    torch.manual_seed(0)
    return transformers.Qwen2ForCausalLM(config)


def timed(run: LoadedRun, new_tokens: int, cache: bool) -> tuple[float, str]:
    started = time.perf_counter()
    text = generate(
        run,
        PROMPT,
        max_new_tokens=new_tokens,
        temperature=0,
        tokenizer=NoEnd(),
        cache=cache,
    )
    return time.perf_counter() - started, text


class NoEnd(ByteTokenizer):
    """The byte tokenizer with an end-of-document id no model here picks: every run generates
    all its tokens."""

    @property
    def eos_id(self) -> int:
        return -1


def measure(name: str, model: nn.Module, new_tokens: int, rounds: int) -> dict[str, object]:
    recipe = SimpleNamespace(train=SimpleNamespace(seq_len=512))
    run = LoadedRun(recipe, Path("-"), model.eval(), 0.0)  # type: ignore[arg-type]
    times: dict[bool, list[float]] = {True: [], False: []}
    texts: dict[bool, str] = {}
    timed(run, 8, True)  # warm up
    for round_ in range(rounds):
        for cache in (True, False) if round_ % 2 == 0 else (False, True):
            seconds, texts[cache] = timed(run, new_tokens, cache)
            times[cache].append(seconds)
    assert texts[True] == texts[False], f"{name}: the cache changed the greedy text"
    cached, whole = statistics.median(times[True]), statistics.median(times[False])
    return {
        "model": name,
        "new_tokens": new_tokens,
        "cached_s": round(cached, 3),
        "whole_s": round(whole, 3),
        "cached_tokens_per_s": round(new_tokens / cached, 1),
        "whole_tokens_per_s": round(new_tokens / whole, 1),
        "speedup": round(whole / cached, 2),
        "min_max_s": {
            "cached": [min(times[True]), max(times[True])],
            "whole": [min(times[False]), max(times[False])],
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    rows = [
        measure("meshtrain Llama", llama(), args.new_tokens, args.rounds),
        measure("transformers Qwen2", qwen2(), args.new_tokens, args.rounds),
    ]
    print("| model | new tokens | cached | whole text | speed-up |")
    print("|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['model']} | {row['new_tokens']} | {row['cached_s']} s "
            f"({row['cached_tokens_per_s']} tok/s) | {row['whole_s']} s "
            f"({row['whole_tokens_per_s']} tok/s) | {row['speedup']}× |"
        )
    if args.out:
        result = {
            "provenance": provenance(),
            "shape": SHAPE,
            "prompt_tokens": len(PROMPT),
            "rows": rows,
        }
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
