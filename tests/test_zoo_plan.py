"""Planning models meshtrain did not write (tier 1, abstract meshes): Hugging Face Llama, Qwen2,
GPT-2, BERT, ViT, a CNN with BatchNorm, BART, T5, GPT-NeoX, Phi-3, OPT and Gemma2 — rules from the model's own plan, the styles and
pairs their structure gives, tied weights, transposed and fused projections, nested block
containers, and every refusal naming the module and the fix."""

from __future__ import annotations

import pytest
import zoo
from torch import nn

import meshtrain as mt
from meshtrain import P, PlanError, RuleError, Rules


def _mesh(**axes: int) -> mt.Mesh:
    world = 1
    for size in axes.values():
        world *= size
    return mt.make_mesh(axes, world_size=world, abstract=True)


def _styles(plan: mt.Plan) -> dict[str, str]:
    return {style.fqn: style.style for style in plan.styles}


@pytest.mark.parametrize("factory", [zoo.llama, zoo.qwen2])
def test_rules_from_hf_give_megatron_pairs(factory: object) -> None:
    model = factory()  # type: ignore[operator]
    rules = Rules.from_hf(model, fsdp="dp")
    plan = mt.plan(model, _mesh(dp=2, tp=2), rules)
    styles = _styles(plan)
    assert styles["model.layers.0.self_attn"] == "prepare_input"
    assert styles["model.layers.0.self_attn.k_proj"] == "colwise"
    assert styles["model.layers.0.self_attn.o_proj"] == "rowwise"
    assert styles["model.layers.0.mlp.down_proj"] == "rowwise"
    assert styles["model.embed_tokens"] == "vocab_parallel_embedding"
    assert styles["lm_head"] == "loss_parallel_head"
    attention = next(s for s in plan.styles if s.fqn == "model.layers.0.self_attn")
    assert attention.argument == "hidden_states"  # HF passes it by keyword


def test_rules_from_hf_refuse_a_model_without_a_plan_and_say_what_to_write() -> None:
    with pytest.raises(
        RuleError, match=r"GPT2LMHeadModel declares no tensor-parallel plan.*P\(None, 'tp'\)"
    ):
        Rules.from_hf(zoo.gpt2(), fsdp="dp")


def test_rules_from_hf_refuse_packed_styles_unless_overridden() -> None:
    model = zoo.llama()
    model.config.base_model_tp_plan = {
        **model.config.base_model_tp_plan,
        "layers.*.mlp.up_proj": "packed_colwise",
    }
    model._tp_plan = {}  # the config's plan alone, as older transformers versions carry it
    with pytest.raises(
        RuleError, match=r"'model\.layers\.\*\.mlp\.up_proj' \(Linear\) the style 'packed_colwise'"
    ):
        Rules.from_hf(model, fsdp="dp")
    rules = Rules.from_hf(
        model, fsdp="dp", overrides={r"model\.layers\.\d+\.mlp\.up_proj\..*": P()}
    )
    assert rules.patterns[0] == (r"model\.layers\.\d+\.mlp\.up_proj\..*", P())


def test_sequence_parallelism_splits_where_positions_are_computed() -> None:
    """HF Llama builds position ids and rotary tables from the embedded sequence: the split moves
    to the first decoder layer; BERT slices its position ids first: the split stays put."""
    llama = mt.plan(
        zoo.llama(), _mesh(dp=2, tp=2), zoo.hf_rules(zoo.llama(), sequence_parallel=True)
    )
    split = [s for s in llama.styles if s.style == "sequence_split_input"]
    assert [s.fqn for s in split] == ["model.layers.0"] and split[0].argument == "hidden_states"
    bert = mt.plan(zoo.bert(), _mesh(dp=2, tp=2), zoo.with_sequence_parallelism(zoo.BERT_RULES))
    assert not any(s.style == "sequence_split_input" for s in bert.styles)
    assert _styles(bert)["bert.embeddings.position_embeddings"] == "sequence_split"


def test_gpt2_conv1d_and_its_tied_head() -> None:
    plan = mt.plan(zoo.gpt2(), _mesh(dp=2, tp=2), zoo.GPT2_RULES)
    styles = _styles(plan)
    assert styles["transformer.h.0.mlp.c_fc"] == "colwise"
    assert styles["transformer.h.0.mlp.c_proj"] == "rowwise"
    assert styles["lm_head"] == "loss_parallel_head"  # tied to wte, so vocab-parallel too
    assert plan.tied == (("transformer.wte.weight", "lm_head.weight"),)
    assert "transformer.wte.weight = lm_head.weight" in plan.explain()
    assert mt.Plan.from_json(plan.to_json()) == plan


def test_gpt2_fused_qkv_is_refused_with_the_fix() -> None:
    rules = Rules(
        {
            r".*\.attn\.c_attn\.weight": P(None, "tp"),
            r".*\.attn\.c_attn\.bias": P("tp"),
            r".*\.attn\.c_proj\.weight": P("tp", None),
            r".*": P(),
        },
        fsdp="dp",
    )
    with pytest.raises(
        PlanError,
        match=r"'transformer\.h\.0\.attn\.c_attn' \(Conv1D\) outputs 96 features.*packs several projections",
    ) as err:
        mt.plan(zoo.gpt2(), _mesh(dp=2, tp=2), rules)
    assert err.value.fqn == "transformer.h.0.attn.c_attn.weight"


def test_conv1d_specs_describe_its_true_layout() -> None:
    """A Linear's column-wise spec on a Conv1D (weight [in, out]) is row-wise there: with a
    sharded bias it fits neither, and the error says why."""
    rules = Rules(
        {r".*\.mlp\.c_fc\.weight": P("tp", None), r".*\.mlp\.c_fc\.bias": P("tp"), r".*": P()},
        fsdp="dp",
    )
    with pytest.raises(
        PlanError,
        match=r"Conv1D 'transformer\.h\.0\.mlp\.c_fc' has weight P\('tp', None\).*stored \[in, out\]",
    ):
        mt.plan(zoo.gpt2(), _mesh(dp=2, tp=2), rules)


def test_bert_pairs_across_parents_and_keeps_both_ties() -> None:
    plan = mt.plan(zoo.bert(), _mesh(dp=2, tp=2), zoo.BERT_RULES)
    styles = _styles(plan)
    assert styles["bert.encoder.layer.0.attention.self"] == "prepare_input"
    assert styles["bert.encoder.layer.0.attention.output.dense"] == "rowwise"
    assert styles["bert.encoder.layer.0.intermediate"] == "prepare_input"
    assert styles["bert.encoder.layer.0.output.dense"] == "rowwise"
    assert styles["cls.predictions.decoder"] == "loss_parallel_head"
    assert "cls.predictions" not in styles  # holds the decoder's bias, takes no style itself
    assert set(plan.tied) == {
        ("bert.embeddings.word_embeddings.weight", "cls.predictions.decoder.weight"),
        ("cls.predictions.bias", "cls.predictions.decoder.bias"),
    }


def test_a_replicated_module_inside_a_block_is_refused_under_sequence_parallelism() -> None:
    with pytest.raises(
        PlanError,
        match=r"'transformer\.h\.0\.attn\.c_attn' \(Conv1D\) inside a repeated block is not tensor-parallel",
    ):
        mt.plan(zoo.gpt2(), _mesh(dp=2, tp=2), zoo.with_sequence_parallelism(zoo.GPT2_RULES))


@pytest.mark.parametrize(
    ("factory", "first", "last"),
    [
        (
            zoo.llama,
            ("model.embed_tokens", "model.layers.0"),
            ("model.layers.1", "model.norm", "lm_head"),
        ),
        (
            zoo.gpt2_untied,
            ("transformer.wte", "transformer.wpe", "transformer.h.0"),
            ("transformer.h.1", "transformer.ln_f", "lm_head"),
        ),
        (
            zoo.bert_untied,
            ("bert.embeddings", "bert.encoder.layer.0"),
            ("bert.encoder.layer.1", "cls"),
        ),
        (
            zoo.vit,
            ("vit.embeddings", "vit.layers.0"),
            ("vit.layers.1", "vit.layernorm", "classifier"),
        ),
        (zoo.cnn, ("stem", "blocks.0"), ("blocks.1", "head")),
    ],
)
def test_pipelines_find_nested_blocks(factory: object, first: tuple, last: tuple) -> None:
    model = factory()  # type: ignore[operator]
    # one micro-batch (the CNN's BatchNorm needs the whole batch): GPipe runs it
    pipeline = mt.Pipeline(schedule="GPipe", microbatches=1)
    plan = mt.plan(model, _mesh(pp=2, dp=2), zoo.REPLICATED, pipeline=pipeline)
    assert plan.pipeline is not None
    assert [stage.modules for stage in plan.pipeline.stages] == [first, last]
    names = {fqn for fqn, _ in model.named_parameters()}
    assert {p for s in plan.pipeline.stages for p in s.params} == names  # FQNs are the model's


def test_explicit_split_points_choose_the_container() -> None:
    plan = mt.plan(
        zoo.llama(),
        _mesh(pp=2, dp=2),
        zoo.REPLICATED,
        pipeline=mt.Pipeline(microbatches=2, split=("model.layers.1",)),
    )
    assert plan.pipeline is not None and plan.pipeline.stages[1].modules[0] == "model.layers.1"
    with pytest.raises(PlanError, match=r"split points must be blocks of one ModuleList"):
        mt.plan(
            zoo.llama(),
            _mesh(pp=2, dp=2),
            zoo.REPLICATED,
            pipeline=mt.Pipeline(microbatches=2, split=("lm_head",)),
        )


def test_tied_weights_across_stages_are_refused_with_both_names() -> None:
    with pytest.raises(
        PlanError, match=r"'lm_head\.weight' is the same tensor as 'transformer\.wte\.weight'"
    ):
        mt.plan(zoo.gpt2(), _mesh(pp=2, dp=2), zoo.REPLICATED, pipeline=mt.Pipeline(microbatches=2))


def test_batch_norm_statistics_are_global_and_micro_batches_are_refused() -> None:
    plan = mt.plan(zoo.cnn(), _mesh(dp=4), zoo.REPLICATED)
    assert plan.batch_norms == ("stem.1", "blocks.0.norm", "blocks.1.norm")
    assert "BatchNorm statistics over the global batch" in plan.explain()
    with pytest.raises(
        PlanError,
        match=r"BatchNorm \['stem\.1', 'blocks\.0\.norm', 'blocks\.1\.norm'\] would compute its statistics over each of the 2 micro-batches",
    ):
        mt.plan(zoo.cnn(), _mesh(dp=4), zoo.REPLICATED, microbatches=2)
    with pytest.raises(PlanError, match=r"2 pipeline micro-batches"):
        mt.plan(zoo.cnn(), _mesh(pp=2, dp=2), zoo.REPLICATED, pipeline=mt.Pipeline(microbatches=2))


def test_conv2d_cannot_be_tensor_parallel() -> None:
    rules = Rules({r"blocks\.\d+\.conv\.weight": P("tp"), r".*": P()}, fsdp="dp")
    with pytest.raises(PlanError, match=r"Conv2d 'blocks\.0\.conv' is sharded.*Replicate it"):
        mt.plan(zoo.cnn(), _mesh(dp=2, tp=2), rules)


def test_a_plain_module_tree_with_keyword_activations_pairs() -> None:
    class Mlp(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)

        def forward(self, *, hidden: object) -> object:
            return self.down(self.up(hidden))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([Mlp()])

        def forward(self, x: object) -> object:
            return self.blocks[0](hidden=x)

    rules = Rules(
        {
            r".*up\.weight": P("tp", None),
            r".*up\.bias": P("tp"),
            r".*down\.weight": P(None, "tp"),
            r".*": P(),
        },
        fsdp="dp",
    )
    plan = mt.plan(Net(), _mesh(dp=1, tp=2), rules)
    prepare = next(s for s in plan.styles if s.style == "prepare_input")
    assert (prepare.fqn, prepare.argument) == ("blocks.0", "hidden")


# ---------------------------------------------------------------- families beyond the first five


def test_opt_reshaping_with_its_global_head_count_is_refused_naming_the_module() -> None:
    """OPT's attention views its q/k/v as ``(bsz, -1, num_heads, head_dim)``: on a rank holding
    half the heads the ``-1`` would halve the sequence and train wrong, silently."""
    with pytest.raises(
        PlanError,
        match=r"'model\.decoder\.layers\.0\.self_attn' \(OPTAttention\) reshapes with a global size",
    ):
        mt.plan(zoo.opt(), _mesh(dp=2, tp=2), zoo.OPT_RULES, batch_size=2, seq_len=16)


def test_opt_without_tensor_parallelism_plans() -> None:
    plan = mt.plan(zoo.opt(), _mesh(dp=4), zoo.REPLICATED, batch_size=2, seq_len=16)
    assert not plan.styles and plan.units


def test_t5_relative_position_bias_over_all_heads_is_refused() -> None:
    """T5 adds a position bias of every head to a rank's shard of the heads' scores."""
    with pytest.raises(
        PlanError,
        match=r"'t5\.encoder\.block\.0\.layer\.0\.SelfAttention' \(T5Attention\).*mixes tensors sharded over tensor-parallel axis 'tp' with whole ones",
    ):
        mt.plan(zoo.t5(), _mesh(dp=2, tp=2), zoo.T5_RULES, batch_size=2, seq_len=16)


def test_bart_encoder_decoder_and_cross_attention_pair() -> None:
    plan = mt.plan(zoo.bart(), _mesh(dp=2, tp=2), zoo.BART_RULES, batch_size=2, seq_len=16)
    styles = _styles(plan)
    for block in ("model.encoder.layers.0.self_attn", "model.decoder.layers.0.encoder_attn"):
        assert styles[f"{block}.q_proj"] == "colwise"
        assert styles[f"{block}.out_proj"] == "rowwise"
    assert styles["model.decoder.layers.0.fc2"] == "rowwise"
    assert mt.Plan.from_json(plan.to_json()) == plan


def test_gpt_neox_fused_qkv_from_its_own_plan_is_refused_with_the_fix() -> None:
    """GPT-NeoX's plan shards the fused ``query_key_value`` column-wise; meshtrain cannot tell a
    per-head interleaved packing from a stacked one, so it refuses and says what to write."""
    model = zoo.gpt_neox()
    with pytest.raises(
        PlanError,
        match=r"'gpt_neox\.layers\.0\.attention\.query_key_value' \(Linear\) outputs 96 features.*packs several projections",
    ):
        mt.plan(model, _mesh(dp=2, tp=2), Rules.from_hf(model, fsdp="dp"))


def test_phi3_fused_projections_are_gathered_not_paired() -> None:
    model = zoo.phi3()
    plan = mt.plan(model, _mesh(dp=2, tp=2), Rules.from_hf(model, fsdp="dp"))
    styles = _styles(plan)
    assert styles["model.layers.0.self_attn.qkv_proj"] == "colwise_gathered"
    assert styles["model.layers.0.mlp.gate_up_proj"] == "colwise_gathered"
    assert styles["model.layers.0.mlp.down_proj"] == "rowwise_replicated_input"


def test_gemma2_soft_capped_logits_stay_vocab_parallel() -> None:
    """Soft-capping is element-wise: the capped logits stay sharded over the vocabulary."""
    model = zoo.gemma2()
    plan = mt.plan(model, _mesh(dp=2, tp=2), zoo.hf_rules(model))
    styles = _styles(plan)
    assert styles["lm_head"] == "loss_parallel_head"
    assert styles["model.layers.0.self_attn.o_proj"] == "rowwise"
