"""``meshtrain generate``'s token loop on models built here: the key/value cache against the
whole-text forward (meshtrain's Llama and MoE, a transformers Qwen2 against its own
``generate``), sampling against transformers' logits processors, stop strings, streaming and
batches of prompts."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from meshtrain.errors import RecipeError
from meshtrain.models import LlamaConfig, MoEConfig, build_llama, build_moe
from meshtrain.recipes.evaluation import LoadedRun
from meshtrain.recipes.generation import (
    _DecoderCache,
    _TransformersCache,
    _Whole,
    generate,
    generate_batch,
    stream,
)
from meshtrain.recipes.sampling import Sampling
from meshtrain.train.data.tokenizer import ByteTokenizer

WINDOW = 24
SHARP = 40  # the heads' scale-up: logits far apart, so greedy picks are no near-ties


def _run(model: nn.Module, window: int = WINDOW) -> Any:
    """A loaded run around ``model``: generation reads its model and ``[train] seq_len``."""
    recipe = SimpleNamespace(train=SimpleNamespace(seq_len=window))
    return LoadedRun(recipe, Path("step-1"), model.eval(), 0.0)  # type: ignore[arg-type]


def _sharp(model: nn.Module, head: nn.Linear) -> nn.Module:
    """``model`` with its head scaled up: logits far apart, so greedy picks are no near-ties."""
    with torch.no_grad():
        head.weight.mul_(SHARP)
    return model


def _llama() -> nn.Module:
    model = build_llama(LlamaConfig.debug(), seed=3)
    return _sharp(model, model.output)


def _moe() -> nn.Module:
    model = build_moe(MoEConfig.debug(vocab_size=256, max_seq_len=64, qk_norm=True), seed=3)
    return _sharp(model, model.output)


def _qwen2() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen2Config(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(3)
    model = transformers.Qwen2ForCausalLM(config)
    return _sharp(model, model.lm_head)


@pytest.mark.parametrize(
    ("build", "cached"),
    [(_llama, _DecoderCache), (_moe, _DecoderCache), (_qwen2, _TransformersCache)],
    ids=["llama", "moe-qk-norm", "qwen2"],
)
def test_the_cache_gives_the_whole_texts_logits_at_every_step(build: Any, cached: Any) -> None:
    """Step by step from a 5-token prompt to 8 tokens past the window (where the cache gives
    way to the sliding window), the cached logits equal a whole-text forward's."""
    model = build().eval()
    stepper, whole = cached(model, WINDOW), _Whole(model, WINDOW)
    context = torch.randint(1, 256, (2, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for _ in range(WINDOW + 8):
            got, want = stepper.logits(context), whole.logits(context)
            # fp32's own tolerances (the same sums, the attention's in another order), the
            # absolute one times the head's scale-up of 40 (_sharp); measured at worst 3.8e-5
            # on logits up to 154
            torch.testing.assert_close(got, want, rtol=1.3e-6, atol=SHARP * 1e-5)
            context = torch.cat([context, want.argmax(-1, keepdim=True)], dim=1)
    assert isinstance(model, nn.Module) and not any(
        "attention_fn" in vars(module) for module in model.modules()
    )  # the cache leaves the model as it found it


def test_cached_greedy_text_is_transformers_own_greedy_generate() -> None:
    model = _qwen2().eval()
    prompt = "Q: 3+4="
    ids = torch.tensor([ByteTokenizer().encode(prompt)])
    theirs = model.generate(
        ids, max_new_tokens=12, do_sample=False, eos_token_id=0, pad_token_id=0, use_cache=True
    )
    ours = generate(
        _run(model, window=64), prompt, max_new_tokens=12, temperature=0, tokenizer=ByteTokenizer()
    )
    assert ours == ByteTokenizer().decode(theirs[0, ids.shape[1] :].tolist())


@pytest.mark.parametrize("build", [_llama, _moe], ids=["llama", "moe"])
def test_cached_and_uncached_greedy_texts_are_the_same(build: Any) -> None:
    run = _run(build())
    kwargs = {"max_new_tokens": 40, "temperature": 0, "tokenizer": ByteTokenizer()}
    assert generate(run, "hello", cache=True, **kwargs) == generate(
        run, "hello", cache=False, **kwargs
    )


def test_a_batch_of_prompts_of_mixed_lengths_equals_each_prompt_alone() -> None:
    run = _run(_llama())
    prompts = ["ab", "xyz", "cd", "a longer prompt"]
    settings = {
        "max_new_tokens": 12,
        "sampling": Sampling(temperature=0),
        "tokenizer": ByteTokenizer(),
    }
    alone = [generate_batch(run, [prompt], **settings)[0] for prompt in prompts]
    assert generate_batch(run, prompts, **settings) == alone


class Scripted(nn.Module):
    """A model that always continues with the next byte of ``script`` after the prompt."""

    def __init__(self, script: bytes, prompt_length: int) -> None:
        super().__init__()
        self.script, self.prompt_length = script, prompt_length

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = torch.zeros(*tokens.shape, 256)
        produced = tokens.shape[1] - self.prompt_length
        logits[:, -1, self.script[min(produced, len(self.script) - 1)]] = 100.0
        return logits


def test_stop_strings_cut_the_text_and_streaming_never_shows_part_of_one() -> None:
    script = "Sure: é then\nEND more".encode()
    run = _run(Scripted(script, prompt_length=2), window=64)
    kwargs = {
        "sampling": Sampling(temperature=0),
        "tokenizer": ByteTokenizer(),
        "max_new_tokens": 40,
    }
    pieces = list(stream(run, "Hi", stop=["\nEND", "zzz"], **kwargs))
    assert "".join(pieces) == "Sure: é then"
    assert all("\ufffd" not in piece and not piece.endswith("\n") for piece in pieces)
    assert len(pieces) > 3  # streamed as it came, not at the end
    assert generate(run, "Hi", stop=["then"], **kwargs) == "Sure: é "
    assert (
        generate(
            run,
            "Hi",
            max_new_tokens=4,
            **{k: v for k, v in kwargs.items() if k != "max_new_tokens"},
        )
        == "Sure"
    )


def test_the_end_of_document_token_ends_the_text() -> None:
    run = _run(Scripted(b"ok\x00more", prompt_length=2), window=64)
    assert generate(run, "Hi", temperature=0, tokenizer=ByteTokenizer()) == "ok"


def _processors() -> Any:
    return pytest.importorskip("transformers.generation.logits_process")


@pytest.mark.parametrize("seed", range(5))
def test_top_k_top_p_and_the_repetition_penalty_keep_what_transformers_keeps(seed: int) -> None:
    """The tokens left to draw from (and the penalised logits) are transformers' own: its
    RepetitionPenalty, Temperature, TopK and TopP processors applied in its order."""
    processors = _processors()
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, 50, generator=generator) * 3
    history = torch.randint(0, 50, (3, 7), generator=generator)
    sampling = Sampling(temperature=0.7, top_k=9, top_p=0.8, repetition_penalty=1.3)
    theirs = logits.clone()
    for processor in (
        processors.RepetitionPenaltyLogitsProcessor(1.3),
        processors.TemperatureLogitsWarper(0.7),
        processors.TopKLogitsWarper(9),
        processors.TopPLogitsWarper(0.8),
    ):
        theirs = processor(history, theirs)
    allowed = torch.isfinite(theirs)
    draws = torch.stack([sampling.pick(logits, history, generator) for _ in range(400)], dim=1)
    for row in range(3):
        drawn = set(draws[row].tolist())
        assert drawn <= set(allowed[row].nonzero().flatten().tolist())
        assert len(drawn) >= min(2, int(allowed[row].sum()))


def test_the_repetition_penalty_matches_transformers_and_greedy_takes_its_argmax() -> None:
    processors = _processors()
    logits = torch.tensor([[2.0, -1.0, 1.5, 0.5]])
    history = torch.tensor([[0, 1, 1]])
    penalised = processors.RepetitionPenaltyLogitsProcessor(2.0)(history, logits.clone())
    assert penalised.tolist() == [[1.0, -2.0, 1.5, 0.5]]
    pick = Sampling(temperature=0, repetition_penalty=2.0).pick(logits, history, torch.Generator())
    assert pick.tolist() == [2]


def test_top_p_keeps_the_smallest_set_reaching_p_and_always_the_likeliest() -> None:
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    generator = torch.Generator().manual_seed(0)
    for top_p, kept in ((0.8, {0, 1}), (0.81, {0, 1, 2}), (0.01, {0}), (1.0, {0, 1, 2, 3})):
        sampling = Sampling(temperature=1.0, top_p=top_p)
        drawn = {
            int(sampling.pick(logits, torch.zeros(1, 0, dtype=torch.long), generator))
            for _ in range(600)
        }
        assert drawn == kept, (top_p, drawn)


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        (
            {"temperature": -1.0},
            r"sampling temperature = -1\.0 \(--temperature\) must be a number ≥ 0",
        ),
        ({"top_k": 2.5}, r"sampling top_k = 2\.5 \(--top-k\) must be a whole number ≥ 0"),
        ({"top_p": 0.0}, r"sampling top_p = 0\.0 \(--top-p\) must be a number in \(0, 1\]"),
        ({"repetition_penalty": float("nan")}, r"repetition_penalty = nan .* must be a number > 0"),
        ({"temperature": "hot"}, r"sampling temperature = 'hot' .* must be a number ≥ 0"),
    ],
)
def test_sampling_settings_out_of_range_are_refused_naming_the_setting(
    setting: dict[str, Any], message: str
) -> None:
    with pytest.raises(RecipeError, match=message):
        Sampling(**setting)


def test_an_empty_prompt_is_refused() -> None:
    with pytest.raises(RecipeError, match="encodes to no tokens"):
        generate(_run(_llama()), "", tokenizer=ByteTokenizer())
