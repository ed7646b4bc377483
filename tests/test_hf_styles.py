"""Every tensor-parallel style of the installed ``transformers`` is either lowered as
``transformers`` lowers it or refused by ``Rules.from_hf`` naming the style and the module
(issue 37): the installed registry is enumerated, so a style a newer ``transformers`` adds fails
here until it has a row in ``HF_STYLES`` and in the docs' table. Plans are made on an abstract
mesh (no ranks); the numerics are in tests/test_zoo_spmd.py (Qwen3, OLMo2)."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import pytest
import torch
import zoo
from torch import nn
from transformers.integrations.tensor_parallel import ALL_PARALLEL_STYLES

import meshtrain as mt
from meshtrain import P, PlanError, RuleError, Rules
from meshtrain.plan.ir import TPStyle
from meshtrain.spec.hf_plan import HF_STYLES, hf_tp_plan
from meshtrain.testing import assert_equivalent
from meshtrain.testing.runner import get_pool

INSTALLED = sorted(ALL_PARALLEL_STYLES)
DOCS = Path(__file__).resolve().parents[1] / "docs" / "bring-your-own-model.md"


class _Config:
    def __init__(self, plan: dict[str, str]) -> None:
        self.base_model_tp_plan = plan


class _Tiny(nn.Module):
    """An embedding, one block of Linears and a head, with a TP plan naming one module."""

    base_model_prefix = ""

    def __init__(self, plan: dict[str, str]) -> None:
        super().__init__()
        self.config = _Config(plan)
        self.embed = nn.Embedding(16, 8)
        self.layers = nn.ModuleList([nn.ModuleDict({"up": nn.Linear(8, 16)})])
        self.head = nn.Linear(8, 16, bias=False)


def _spec(rules: Rules, fqn: str) -> P:
    hit = rules.match(fqn)
    assert hit is not None, fqn
    return hit[1]


def _model_for(style: str) -> tuple[_Tiny, str]:
    module = "embed" if style.startswith("embedding_") else "layers.*.up"
    return _Tiny({module: style}), module


def test_every_installed_style_has_a_row() -> None:
    missing = [style for style in INSTALLED if style not in HF_STYLES]
    assert not missing, (
        f"transformers declares TP styles meshtrain neither lowers nor refuses: {missing}"
    )
    assert len(INSTALLED) >= 20  # the registry was read, not an empty stand-in


@pytest.mark.parametrize("style", sorted(set(INSTALLED) | set(HF_STYLES)))
def test_each_style_is_lowered_or_refused_naming_style_and_module(style: str) -> None:
    model, module = _model_for(style)
    if HF_STYLES[style].kind == "refused":
        with pytest.raises(RuleError) as refusal:
            Rules.from_hf(model, fsdp="dp")
        text = str(refusal.value)
        assert f"'{module}'" in text and repr(style) in text and "overrides=" in text
        # what it says to write works: the module replicated, nothing else refused
        override = re.search(r"overrides=\{'(.*)': P\(\)\}", text)
        assert override is not None
        rules = Rules.from_hf(
            model, fsdp="dp", overrides={override.group(1).replace("\\\\", "\\"): P()}
        )
        assert _spec(rules, "layers.0.up.weight" if module != "embed" else "embed.weight") == P()
        return
    rules = Rules.from_hf(model, fsdp="dp")
    fqn = "embed.weight" if module == "embed" else "layers.0.up.weight"
    kind = HF_STYLES[style].kind
    expected = {
        "colwise": P("tp", None),
        "gathered": P("tp", None),
        "rowwise": P(None, "tp"),
        "vocab": P("tp", None),
        "embedding_dim": P(None, "tp"),
        "replicated": P(),
    }[kind]
    assert _spec(rules, fqn) == expected
    assert bool(rules.gathered) == (kind == "gathered")


def test_an_unknown_style_and_a_parameter_entry_are_refused() -> None:
    with pytest.raises(RuleError, match=r"'layers\.\*\.up' \(Linear\) the style 'fancy_new'"):
        Rules.from_hf(_Tiny({"layers.*.up": "fancy_new"}), fsdp="dp")
    with pytest.raises(RuleError, match=r"'layers\.\*\.up\.weight' \(a parameter, not a module\)"):
        Rules.from_hf(_Tiny({"layers.*.up.weight": "colwise"}), fsdp="dp")


def test_a_refused_style_on_a_parent_without_parameters_is_refused() -> None:
    """all_reduce on a parent whose children the plan shards (a shared-experts MLP): refused,
    not skipped for holding no parameters of its own; the override that covers the subtree
    plans."""
    plan = {"layers.*.up": "colwise", "layers.*": "all_reduce"}
    with pytest.raises(RuleError, match=r"'layers\.\*' \(ModuleDict\) the style 'all_reduce'"):
        Rules.from_hf(_Tiny(plan), fsdp="dp")
    rules = Rules.from_hf(_Tiny(plan), fsdp="dp", overrides={r"layers\.\d+(\..*)?": P()})
    assert _spec(rules, "layers.0.up.weight") == P()


@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral"])
def test_overrides_may_shadow_the_generated_rules(family: str) -> None:
    """An override that replicates every MLP shadows the expert and MLP rules from_hf wrote:
    that is what overrides are for, so nothing is an unused rule; an override that matches no
    parameter is still one (issue 43, point 5)."""
    import moe_models

    model = getattr(moe_models, family)()
    rules = Rules.from_hf(
        model, tp="tp", fsdp="dp", overrides={r"model\.layers\.\d+\.mlp\..*": P()}
    )
    plan = mt.plan(model, _mesh(), rules)
    specs = {p.fqn: p.spec for p in plan.params}
    assert {s for f, s in specs.items() if ".mlp." in f} == {P()}
    assert specs["model.layers.0.self_attn.q_proj.weight"] == P("tp", None)
    with pytest.raises(RuleError, match=r"1 rule matched no parameter[\s\S]*r'nothing\\.here'"):
        mt.plan(model, _mesh(), Rules.from_hf(model, tp="tp", overrides={r"nothing\.here": P()}))


def test_the_docs_table_lists_every_style_as_the_code_handles_it() -> None:
    text = DOCS.read_text()
    for style, row in HF_STYLES.items():
        line = next((ln for ln in text.splitlines() if ln.startswith(f"| `{style}` ")), None)
        assert line is not None, f"docs/bring-your-own-model.md has no row for {style!r}"
        assert row.lowering in line, (style, line)


def _mesh() -> mt.Mesh:
    return mt.make_mesh({"dp": 2, "tp": 2}, world_size=4, abstract=True)


def _styles(plan: mt.Plan) -> dict[str, str]:
    return {style.fqn: style.style for style in plan.styles}


def test_olmo2_gathers_q_k_v_and_slices_the_input_of_o() -> None:
    """colwise_gather_output: the output all-gathered (OLMo2's q/k norms span all heads), costed
    as one all-gather per use; rowwise_split_input: the replicated input sliced, the output
    all-reduced — as transformers lowers them."""
    model = zoo.olmo2()
    rules = Rules.from_hf(model, fsdp="dp")
    plan = mt.plan(model, _mesh(), rules, zero=3)
    styles = _styles(plan)
    for name in ("q_proj", "k_proj", "v_proj"):
        assert styles[f"model.layers.0.self_attn.{name}"] == "colwise_gathered"
    assert styles["model.layers.0.self_attn.o_proj"] == "rowwise_replicated_input"
    assert "model.layers.0.self_attn" not in styles  # no pair: nothing marked at the parent
    assert styles["model.layers.0.mlp.down_proj"] == "rowwise"
    assert styles["lm_head"] == "loss_parallel_head"  # the head's logits reach the loss whole
    tp = {c.why.split(" (")[0]: c for c in plan.collectives if c.axis == "tp"}
    # q, k and v of 2 layers gathered forward
    assert tp["forward: gathered column-wise outputs"].count == 6
    # the sliced input of o_proj gathered back in backward, 2 layers
    assert tp["backward: input gradients of row-wise modules fed a replicated input"].count == 2
    llama = mt.plan(zoo.llama(), _mesh(), Rules.from_hf(zoo.llama(), fsdp="dp"), zero=3)
    assert not any(c.why.startswith("forward: gathered column-wise") for c in llama.collectives)


def test_olmo2_sequence_parallelism_is_refused_naming_the_gathered_projection() -> None:
    model = zoo.olmo2()
    with pytest.raises(
        PlanError,
        match=r"'model\.layers\.0\.self_attn\.q_proj' \(Linear\) is gathered.*without sequence",
    ):
        mt.plan(model, _mesh(), Rules.from_hf(model, fsdp="dp", sequence_parallel=True))


def test_qwen3_sequence_parallelism_gathers_attention_input_once_beside_per_head_norms() -> None:
    """Qwen3's q/k norms normalise q_proj's and k_proj's outputs (per-head, narrower than the
    attention's input), so the attention gathers its input once for its column-wise Linears as
    under plain tensor parallelism; the norms' gradients are partial and reduced (issue 43)."""
    model = zoo.qwen3()
    plan = mt.plan(model, _mesh(), Rules.from_hf(model, fsdp="dp", sequence_parallel=True))
    styles = {s.fqn: s.style for s in plan.styles}
    assert styles["model.layers.0.self_attn"] == "prepare_input"
    assert [g.param for g in plan.partial_grads][:2] == [
        "model.layers.0.self_attn.q_norm.weight",
        "model.layers.0.self_attn.k_norm.weight",
    ]


def test_replicated_with_grad_allreduce_ends_in_the_plan_s_partial_gradients() -> None:
    """Every parameter transformers all-reduces by this style (Qwen3's q/k norms) is one the
    plan's abstract run finds partial over ``tp`` and reduces: the same set, none missed."""
    model = zoo.qwen3()
    plan = mt.plan(model, _mesh(), Rules.from_hf(model, fsdp="dp"), zero=3)
    declared = {
        f"{fqn}.{name}"
        for pattern, style in hf_tp_plan(model).items()
        if style == "replicated_with_grad_allreduce"
        for fqn, module in model.named_modules()
        if re.fullmatch(re.escape(pattern).replace(r"\*", r"\d+"), fqn)
        for name, _ in module.named_parameters(recurse=False)
    }
    assert len(declared) == 4  # q_norm and k_norm of 2 layers
    assert {g.param for g in plan.partial_grads if g.axis == "tp"} == declared


def test_a_gathered_head_stays_loss_parallel() -> None:
    """Every causal LM's head is colwise_gather_output in its plan: the loss reads its logits
    whole either way, so the planner keeps the vocab-parallel loss."""
    model = zoo.qwen3()
    rules = Rules.from_hf(model, fsdp="dp")
    assert rules.gathered == ("lm_head",)
    styles = _styles(mt.plan(model, _mesh(), rules))
    assert styles["lm_head"] == "loss_parallel_head"
    assert styles["model.layers.0.self_attn.q_proj"] == "colwise"


@contextlib.contextmanager
def gathered_output_left_sharded() -> Iterator[None]:
    """The fault OLMo2 met: ``colwise_gathered`` lowered as plain column-wise, its output left
    sharded, so the q/k norms over all heads' features see half of them."""
    from meshtrain.lower.tensor import parallel as tensor_parallel

    plain = tensor_parallel.LOWERINGS[TPStyle.COLWISE]
    with mock.patch.dict(tensor_parallel.LOWERINGS, {TPStyle.COLWISE_GATHERED: plain}):
        yield


@pytest.mark.spmd
def test_a_gathered_output_left_sharded_is_caught() -> None:
    with pytest.raises(
        Exception, match=r"size of tensor a \(32\) must match the size of tensor b \(16\)"
    ):
        assert_equivalent(
            zoo.olmo2,
            {"dp": 2, "tp": 2},
            {"rules": zoo.hf_rules(zoo.olmo2()), "zero": 3},
            batches=zoo.token_batches,
            steps=1,
            rank_context=gathered_output_left_sharded,
        )


def olmo2_collectives() -> tuple[dict, dict, dict, dict]:
    """One counted step of OLMo2 on dp 2 × tp 2 under its own plan (q/k/v gathered, o sliced)."""
    torch.manual_seed(0)
    model = zoo.olmo2()
    return zoo.counted_step(model, zoo.hf_rules(model), {"dp": 2, "tp": 2})


@pytest.mark.spmd
def test_olmo2_gathered_projections_issue_exactly_the_predicted_collectives() -> None:
    """colwise_gather_output costs one all-gather per projection and use (6 in forward for 2
    layers' q/k/v), its row-wise partner one all-gather of its input gradient in backward (2):
    measured as predicted, counts and payload bytes."""
    for counts, predicted, payload, predicted_payload in get_pool(4).run(olmo2_collectives):
        assert counts == predicted
        assert payload == predicted_payload
        assert counts[("all_gather", "tp")] == 8
