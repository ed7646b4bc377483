"""The mutation benchmark's catalogue: realistic lowering and runtime bugs, each planted alone
(``plants.py``), with the first-tier tests that must kill it and an ``assert_equivalent`` case
that exercises it. ``benchmarks/mutation.py`` runs them; ``docs/testing.md`` carries its figure.

A mutant is *killed* when the first-tier tests it names fail with it planted in every process
(``MESHTRAIN_MUTANT=<name>`` with ``tests/mutants/site`` on ``PYTHONPATH``), *caught* when the
harness case raises within 2 steps, and *named* when the report's failures include a tensor whose
name matches ``names`` (``<global>`` for the loss and gradient norm). Equivalent mutants are
numerically neutral: neither the tests nor the harness may flag them.

Example:
    >>> len([m for m in MUTANTS.values() if not m.equivalent]) >= 25
    True
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from meshtrain import Pipeline, Rules
from meshtrain.models import default_rules
from meshtrain.models.moe import default_rules as moe_rules
from meshtrain.testing.strategies import DebugLlama
from tests import (
    context_models,
    lora_models,
    moe_models,
    packed_batches,
    precision_cases,
    proof_models,
    zoo,
)
from tests.mutants import plants


@dataclass(frozen=True)
class HarnessCase:
    """``assert_equivalent(model, mesh, options, steps=2, **extra)``."""

    model: Callable[[], Any]
    mesh: dict[str, int]
    options: dict[str, Any]
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Mutant:
    """One planted bug: what it is, how it is planted, what must notice it."""

    name: str
    kind: str
    plant: Callable[[], contextlib.AbstractContextManager[Any]]
    tests: tuple[str, ...]  # first-tier pytest arguments (node ids, or a file and -k)
    harness: HarnessCase | None  # None: the harness cannot exercise it (why: ``why_not``)
    names: str = ""  # a regex the report's failing tensor names must match ("": any)
    equivalent: bool = False
    why_not: str = ""
    # the case in bf16 where the harness case's own bf16 version cannot show the bug: one whose
    # effect is larger than bf16's rounding of the same values (None: the harness case in bf16)
    low_precision: HarnessCase | None = None


def balanced_moe() -> Any:
    """meshtrain's tiny MoE trained with its balance loss (``balance="aux_loss"``)."""
    from meshtrain.models import MoEConfig, build_moe

    return build_moe(MoEConfig.debug(vocab_size=moe_models.VOCAB, balance="aux_loss"), seed=0)


def frozen_query_llama() -> Any:
    """The debug Llama with its (column-wise sharded) query projections frozen."""
    model = DebugLlama(2)()
    for fqn, param in model.named_parameters():
        if "attention.wq" in fqn:
            param.requires_grad_(False)
    return model


def large_logit_llama() -> Any:
    """The context tests' Llama (hidden 32, 2 layers, 4 query and 2 key/value heads) with its
    query and key projections scaled by 45: attention logits past 88, where ``exp`` overflows
    fp32 unless the blocks' merge subtracts the larger log-sum-exp first (logit growth of this
    size is what query-key norms are added against in large runs). The logits amplify rounding:
    the clean run's worst comparison is 0.94 of its bound (scaled by 60, 1.77: over it)."""
    model = context_models.own_llama()
    with torch.no_grad():
        for fqn, param in model.named_parameters():
            if "attention.wq" in fqn or "attention.wk" in fqn:
                param.mul_(45.0)
    return model


DP2 = {"dp": 2, "tp": 1}
TP2 = {"tp": 2}
PP2 = {"pp": 2, "dp": 1, "tp": 1}
PIPELINE = {
    "rules": default_rules(),
    "zero": 2,
    "pipeline": Pipeline(schedule="GPipe", microbatches=2),
}
LLAMA_DP = HarnessCase(DebugLlama(2), DP2, {"rules": default_rules()})
LLAMA_TP = HarnessCase(DebugLlama(2), TP2, {"rules": default_rules(fsdp=())})
LLAMA_SP = HarnessCase(
    DebugLlama(2), TP2, {"rules": default_rules(fsdp=(), sequence_parallel=True)}
)
LLAMA_ACCUMULATE = HarnessCase(
    DebugLlama(2), DP2, {"rules": default_rules(), "zero": 1, "microbatches": 2}
)
LLAMA_PP = HarnessCase(DebugLlama(4), PP2, PIPELINE)
CNN_DP = HarnessCase(
    zoo.cnn, {"dp": 2}, {"rules": zoo.REPLICATED, "zero": 3}, {"batches": zoo.image_batches}
)
LORA_TP = HarnessCase(lora_models.llama_lora, TP2, {"rules": default_rules(fsdp=())})
GPT2_TIED_TP = HarnessCase(
    zoo.gpt2, TP2, {"rules": Rules(zoo.GPT2_RULES.patterns)}, {"batches": zoo.token_batches}
)
QWEN3_TP = HarnessCase(
    zoo.qwen3,
    {"dp": 2, "tp": 2},
    {"rules": zoo.hf_rules(zoo.qwen3()), "zero": 3},
    {"batches": zoo.token_batches},
)
OLMO2_TP = HarnessCase(
    zoo.olmo2,
    {"dp": 2, "tp": 2},
    {"rules": zoo.hf_rules(zoo.olmo2()), "zero": 3},
    {"batches": zoo.token_batches},
)
QWEN2_MOE_EP = HarnessCase(
    moe_models.qwen2_moe,
    {"dp": 2, "ep": 2},
    {"rules": moe_models.ep_rules()},
    {"batches": moe_models.token_batches, "optimizer": "adamw"},
)
OFFLOAD_DP = HarnessCase(
    DebugLlama(2),
    DP2,
    {"rules": default_rules(), "offload_optimizer": True},
    {"optimizer": "adamw"},
)
# cp 4: the ring's chunk order differs from its reverse only past two ranks
CONTEXT_CP4 = HarnessCase(
    large_logit_llama,
    {"cp": 4},
    {"rules": context_models.rules(fsdp=()), "seq_len": context_models.SEQ},
    {"batches": context_models.batches, "optimizer": "adamw"},
)
MOE_SP = HarnessCase(
    moe_models.meshtrain_moe,
    {"ep": 2, "tp": 2},
    {"rules": moe_rules(tp="tp", fsdp=(), ep="ep", sequence_parallel=True)},
    {"batches": moe_models.token_batches, "optimizer": "adamw"},
)
MOE_BALANCE_EP = HarnessCase(
    balanced_moe,
    {"dp": 2, "ep": 2},
    {"rules": moe_rules(tp=None, fsdp="dp", ep="ep")},
    {"batches": moe_models.token_batches, "optimizer": "adamw"},
)
QWEN3_MOE_EXPERTS_TP = HarnessCase(
    moe_models.qwen3_moe,
    {"dp": 2, "tp": 2},
    {"rules": Rules.from_hf(moe_models.qwen3_moe(), fsdp="dp", tp="tp")},
    {"batches": moe_models.token_batches, "optimizer": "adamw"},
)
MOE_CP_EP = HarnessCase(
    moe_models.meshtrain_moe,
    {"cp": 2, "ep": 2},
    {
        "rules": Rules(
            moe_rules(tp=None, fsdp=(), ep="ep").patterns,
            logical=(("seq", "cp"), *moe_rules(tp=None, fsdp=(), ep="ep").logical),
        ),
        "seq_len": 8,
    },
    {"batches": moe_models.token_batches, "optimizer": "adamw"},
)
PACKED_DP2_CP2 = HarnessCase(
    context_models.own_llama,
    {"dp": 2, "cp": 2},
    {"rules": context_models.rules(("dp",)), "seq_len": context_models.SEQ},
    {"batches": packed_batches.packed_batches, "optimizer": "adamw"},
)
PROOF_TOKENS = {"batches": proof_models.token_batches, "optimizer": "adamw"}
MEAN_AVERAGED = HarnessCase(
    proof_models.running_mean_mlp,
    {"dp": 2, "tp": 2},
    {"rules": proof_models.MLP_RULES, "batch_buffers": "average"},
    PROOF_TOKENS,
)
TIED_READER = HarnessCase(
    proof_models.tied_mlp, {"dp": 2, "tp": 2}, {"rules": proof_models.MLP_RULES}, PROOF_TOKENS
)
INPLACE_ROWWISE = HarnessCase(
    proof_models.inplace_mlp, {"dp": 2, "tp": 2}, {"rules": proof_models.MLP_RULES}, PROOF_TOKENS
)
ROBERTA_TAIL_SP = HarnessCase(
    proof_models.roberta_classifier,
    {"dp": 2, "tp": 2},
    {"rules": Rules(proof_models.ROBERTA_RULES.patterns, logical=[("seq", "tp")], fsdp="dp")},
    {"batches": proof_models.label_batches, "optimizer": "adamw"},
)


def small_image_batches(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """8 random 2×2 RGB images and their labels: 32 values per BatchNorm channel, so a bug in the
    statistics (the running variance's n/(n−1), a local mean) changes them by a few percent —
    more than bf16 rounds them. On the fp32 case's 16×16 images (2,048 values) the biased
    variance differs by 1/2047, below bf16's resolution (2⁻⁸ = 1/256), where no bound that
    passes correct bf16 runs can see it."""
    generator = torch.Generator().manual_seed(200 + step)
    images = torch.randn(8, 3, 2, 2, generator=generator)
    return images, torch.randint(0, 10, (8,), generator=generator)


CNN_DP_BF16 = HarnessCase(
    zoo.cnn,
    {"dp": 2},
    {"rules": zoo.REPLICATED, "zero": 3, "precision": "bf16"},
    {"batches": small_image_batches},
)
HSDP = HarnessCase(
    DebugLlama(2), {"rep": 2, "dp": 2, "tp": 1}, {"rules": default_rules(fsdp=("rep", "dp"))}
)

EQ = "tests/test_equivalence_spmd.py::test_plan_trains_like_one_device"
PROOF = "tests/test_proof_spmd.py::test_trains_like_one_device"
STEP = "tests/test_train_step_spmd.py::test_distributed_train_step_matches_one_device"
LORA = "tests/test_lora_spmd.py::test_lora_trains_like_one_device"
ZOO = "tests/test_zoo_spmd.py::test_third_party_model_trains_like_one_device"
LOOP = "tests/test_zoo_spmd.py::test_a_loop_written_for_ddp_trains_like_one_device"
MATERIALISE = "tests/test_materialise_spmd.py"
CLIP = "tests/test_clip.py"
DATA_RANKS = "tests/test_data_ranks_spmd.py"
CP_PURE = "tests/test_context_attention.py"
CP_SPMD = "tests/test_context_attention_spmd.py::test_context_attention_equals_one_device_sdpa"
EP_SPMD = "tests/test_expert_parallel_spmd.py::test_qwen2_moe_with_a_shared_expert_trains_like_one_device_on_dp2_ep2"
EP_LOOP = "tests/test_expert_parallel_spmd.py::test_a_plain_pytorch_loop_trains_like_one_device_with_the_same_routing"
MOE_SP_SPMD = "tests/test_moe_sequence_parallel_spmd.py::test_meshtrain_moe_with_sequence_parallelism_on_ep2_tp2"
EXPERTS_TP_SPMD = "tests/test_expert_tensor_parallel_spmd.py"
CP_EP_SPMD = "tests/test_context_experts_spmd.py::test_meshtrain_moe_on_cp2_ep2"
PACKED_SPMD = (
    "tests/test_context_documents_spmd.py::test_packed_documents_train_like_one_device_on_dp2_cp2"
)
BALANCE_SPMD = "tests/test_moe_balance_spmd.py::test_balance_trains_like_one_device_under_data_and_expert_parallelism"
EVAL_NOT_RUN = "the harness compares train steps only; it runs no evaluation between them"
NOT_BUILT = "the harness builds every rank's model from model_fn; mt.materialise is not on its path"

_ALL = [
    Mutant(
        "sp-norm-grad-not-reduced",
        "sequence-parallel norm gradient all-reduce missing",
        plants.sp_norm_grad_not_reduced,
        (f"{EQ}[tp-sp]",),
        LLAMA_SP,
        r"norm",
    ),
    Mutant(
        "adapter-grad-not-reduced",
        "tensor-parallel LoRA adapter gradient not reduced",
        plants.adapter_grad_not_reduced,
        (f"{LORA}[llama-tp]",),
        LORA_TP,
        r"lora_",
    ),
    Mutant(
        "partial-grad-not-reduced",
        "a replicated parameter on tp-sharded activations (Qwen3's "
        "per-head q/k norms) keeps its partial gradient",
        plants.partial_grad_not_reduced,
        ("tests/test_partial_grads_spmd.py::test_qwen3_from_hf_trains_like_one_device",),
        QWEN3_TP,
        r"q_norm|k_norm",
    ),
    Mutant(
        "gathered-output-left-sharded",
        "a gathered column-wise output (OLMo2's q/k/v) left sharded",
        plants.gathered_output_left_sharded,
        (f"{ZOO}[olmo2-tp-zero3]",),
        OLMO2_TP,
    ),
    Mutant(
        "replicated-grad-summed-over-tp",
        "whole parameters' replicated gradients marked as "
        "partial sums over tp (summed once per tp rank)",
        plants.replicated_grad_summed_over_tp,
        (f"{EQ}[tp]",),
        LLAMA_TP,
        r"norm",
    ),
    Mutant(
        "dp-gradient-divided-twice",
        "data-parallel division applied twice",
        plants.dp_gradient_divided_twice,
        (f"{STEP}[fsdp-tp-accumulation]",),
        LLAMA_DP,
    ),
    Mutant(
        "dp-division-missing",
        "data-parallel division missing (sum where a mean is due)",
        plants.dp_division_missing,
        (f"{STEP}[fsdp-tp-accumulation]",),
        LLAMA_DP,
    ),
    Mutant(
        "hsdp-reduces-one-axis",
        "HSDP gradients not reduced over the replicate axis",
        plants.hsdp_reduces_one_axis,
        (f"{EQ}[hsdp]",),
        HSDP,
    ),
    Mutant(
        "last-microbatch-not-reduced",
        "accumulation never marks the last micro-batch",
        plants.last_microbatch_not_reduced,
        (f"{EQ}[zero1]",),
        LLAMA_ACCUMULATE,
    ),
    Mutant(
        "local-token-count",
        "loss divided by the local instead of the global token count",
        plants.local_token_count,
        (f"{STEP}[fsdp-tp-accumulation]",),
        LLAMA_DP,
    ),
    Mutant(
        "accumulation-mean-per-microbatch",
        "micro-batch loss scaling (own mean each)",
        plants.accumulation_mean_per_microbatch,
        (f"{STEP}[fsdp-tp-accumulation]",),
        LLAMA_ACCUMULATE,
    ),
    Mutant(
        "pipeline-microbatch-not-rescaled",
        "pipeline micro-batch loss scaling",
        plants.pipeline_microbatch_not_rescaled,
        (f"{STEP}[pipeline-1f1b]",),
        LLAMA_PP,
        r"<global>",
    ),
    Mutant(
        "loss-not-summed-over-data-ranks",
        "reported loss is one data rank's share",
        plants.loss_not_summed_over_data_ranks,
        (f"{STEP}[fsdp-tp-accumulation]",),
        LLAMA_DP,
        r"<global>",
    ),
    Mutant(
        "loss-not-summed-over-stages",
        "pipelined loss not reduced over stages",
        plants.loss_not_summed_over_stages,
        (f"{STEP}[pipeline-1f1b]",),
        LLAMA_PP,
        r"<global>",
    ),
    Mutant(
        "batch-shard-offset",
        "every data rank takes the same batch slice",
        plants.batch_shard_offset,
        (DATA_RANKS,),
        LLAMA_DP,
    ),
    Mutant(
        "logsumexp-local-max",
        "loss-parallel log-sum-exp shifted by the local max",
        plants.logsumexp_local_max,
        (f"{EQ}[tp]",),
        LLAMA_TP,
    ),
    Mutant(
        "clip-norm-from-local-shards",
        "clipping norm from local shards",
        plants.clip_norm_from_local_shards,
        (f"{EQ}[zero3]",),
        HarnessCase(DebugLlama(2), DP2, {"rules": default_rules()}, {"max_norm": 0.1}),
        r"<global>",
    ),
    Mutant(
        "pipeline-norm-from-one-stage",
        "pipeline gradient norm from one stage",
        plants.pipeline_norm_from_one_stage,
        (f"{STEP}[pipeline-1f1b]",),
        LLAMA_PP,
        r"<global>",
    ),
    Mutant(
        "clipping-skipped",
        "clip factor never applied",
        plants.clipping_skipped,
        (CLIP,),
        HarnessCase(DebugLlama(2), DP2, {"rules": default_rules()}, {"max_norm": 0.1}),
    ),
    Mutant(
        "clipping-scales-up",
        "clip factor without min(1, ...)",
        plants.clipping_scales_up,
        (CLIP,),
        HarnessCase(DebugLlama(2), DP2, {"rules": default_rules()}, {"max_norm": 1e3}),
    ),
    Mutant(
        "colwise-wrong-shard-dim",
        "wrong redistribute dim in column-wise sharding",
        plants.colwise_wrong_shard_dim,
        (f"{EQ}[tp]",),
        LLAMA_TP,
        r"attention\.w",
    ),
    Mutant(
        "tie-skipped",
        "tied embedding and head trained apart under TP",
        plants.tie_skipped,
        (f"{ZOO}[gpt2-tp-tied]",),
        GPT2_TIED_TP,
        r"wte|lm_head",
    ),
    Mutant(
        "frozen-weights-unfrozen",
        "re-freeze after TP skipped (neutral on torch 2.13: its "
        "parallel styles keep requires_grad)",
        plants.frozen_weights_unfrozen,
        (f"{LORA}[llama-tp]",),
        HarnessCase(frozen_query_llama, TP2, {"rules": default_rules(fsdp=())}),
        r"attention\.wq",
        equivalent=True,
    ),
    Mutant(
        "stage-skips-a-layer",
        "a pipeline stage drops a block",
        plants.stage_skips_a_layer,
        (f"{STEP}[pipeline-1f1b]",),
        LLAMA_PP,
        r"layers\.2\.",
    ),
    Mutant(
        "fp16-backward-from-scale-times-ranks",
        "each rank's fp16 backward starts from the loss scale times the data-parallel ranks",
        plants.fp16_backward_from_scale_times_ranks,
        (
            "tests/test_low_precision_contract_spmd.py::"
            "test_fp16_under_a_data_parallel_mean_overflows_where_one_device_does",
        ),
        HarnessCase(
            precision_cases.FAMILIES["gemma2"].build,
            {"dp": 4},
            {"rules": precision_cases.REPLICATED, "precision": "fp16", "zero": 2},
            {"batches": precision_cases.FAMILIES["gemma2"].batches, "optimizer": "sgd", "seed": 1},
        ),
    ),
    Mutant(
        "lookalike-runs-on-shared-fakes",
        "a look-alike block that must run in the plan-time proof runs on its representative's "
        "fake tensors",
        plants.lookalike_runs_on_shared_fakes,
        (
            "tests/test_abstract_run.py::"
            "test_look_alike_blocks_share_fake_tensors_and_prove_the_same",
        ),
        None,
        why_not="the harness's models keep each block's shape, so no look-alike ever runs",
    ),
    Mutant(
        "kv-cache-positions-restart",
        "generation's cached steps put each new token at position 0",
        plants.kv_cache_positions_restart,
        ("tests/test_generation.py",),
        None,
        why_not="the harness compares train steps; generation runs no train step",
    ),
    Mutant(
        "moe-counts-evaluation-forwards",
        "meshtrain's MoE routers count an evaluation's forwards as a step's",
        plants.moe_counts_evaluation_forwards,
        (
            "tests/test_moe_model.py::"
            "test_an_evaluation_between_steps_counts_nothing_and_moves_no_bias",
        ),
        None,
        why_not=EVAL_NOT_RUN,
    ),
    Mutant(
        "moe-counts-last-micro-batch",
        "meshtrain's MoE routers count the last micro-batch of a step only",
        plants.moe_counts_last_micro_batch,
        (
            "tests/test_expert_parallel_spmd.py::"
            "test_meshtrain_moe_counts_the_whole_step_under_a_pipeline_of_micro_batches",
        ),
        HarnessCase(
            precision_cases.FAMILIES["meshtrain-moe"].build,
            {"pp": 2, "dp": 2},
            {"rules": precision_cases.REPLICATED, "pipeline": Pipeline(microbatches=2)},
            {"batches": precision_cases.FAMILIES["meshtrain-moe"].batches, "seed": 1},
        ),
        r"tokens_per_expert",
    ),
    Mutant(
        "stub-forgets-the-removed-module",
        "a later pipeline stage's stub cannot answer for the module it replaced",
        plants.stub_forgets_the_removed_module,
        (
            "tests/test_pipeline_spmd.py::"
            "test_a_model_that_reads_a_removed_module_on_every_stage_pipelines",
        ),
        HarnessCase(
            zoo.vit,
            {"pp": 2, "dp": 2},
            {"rules": zoo.REPLICATED, "pipeline": Pipeline(microbatches=2)},
            {"batches": precision_cases.vit_images, "optimizer": "adamw"},
        ),
    ),
    Mutant(
        "batch-norm-variance-from-local-mean",
        "BatchNorm variance from the local mean",
        plants.batch_norm_variance_from_local_mean,
        (f"{LOOP}[cnn-ddp-batchnorm]",),
        CNN_DP,
        low_precision=CNN_DP_BF16,
    ),
    Mutant(
        "batch-norm-running-variance-biased",
        "BatchNorm running variance biased",
        plants.batch_norm_running_variance_biased,
        (f"{LOOP}[cnn-ddp-batchnorm]",),
        CNN_DP,
        r"running_var",
        low_precision=CNN_DP_BF16,
    ),
    Mutant(
        "batch-norm-not-synchronised",
        "BatchNorm statistics from the local batch",
        plants.batch_norm_not_synchronised,
        (f"{LOOP}[cnn-ddp-batchnorm]",),
        CNN_DP,
    ),
    Mutant(
        "batch-buffer-not-averaged",
        "a buffer written from the batch left as each rank wrote it (batch_buffers='average')",
        plants.batch_buffer_not_averaged,
        (f"{PROOF}[running-mean-averaged]",),
        MEAN_AVERAGED,
        r"running_mean",
    ),
    Mutant(
        "batch-buffer-summed",
        "a buffer written from the batch summed over the data ranks",
        plants.batch_buffer_summed,
        (f"{PROOF}[running-mean-averaged]",),
        MEAN_AVERAGED,
        r"running_mean",
    ),
    Mutant(
        "reader-not-hooked",
        "a replicated parameter read outside its module reaches the reader as a DTensor",
        plants.reader_not_hooked,
        (f"{PROOF}[tied-head-f-linear]",),
        TIED_READER,
    ),
    Mutant(
        "fresh-output-not-copied",
        "a row-wise output updated in place stays a to_local view",
        plants.fresh_output_not_copied,
        (f"{PROOF}[in-place-into-row-wise]",),
        INPLACE_ROWWISE,
    ),
    Mutant(
        "tail-input-not-gathered",
        "the model's tail under sequence parallelism computes on its rank's sequence shard",
        plants.tail_input_not_gathered,
        (f"{PROOF}[roberta-classifier-sp]",),
        ROBERTA_TAIL_SP,
    ),
    Mutant(
        "checkpoint-replays-buffer-updates",
        "checkpointing's recomputation updates BatchNorm running statistics again",
        plants.checkpoint_replays_buffer_updates,
        ("tests/test_compute_spmd.py::test_checkpointed_batch_norms_update_their_statistics_once",),
        HarnessCase(
            zoo.cnn,
            {"dp": 2},
            {"rules": zoo.REPLICATED, "zero": 3, "activation_checkpointing": "full"},
            {"batches": zoo.image_batches},
        ),
        r"running_|num_batches",
    ),
    Mutant(
        "per-rank-init-seed",
        "per-rank initialisation seed",
        plants.per_rank_init_seed,
        (MATERIALISE,),
        None,
        why_not=NOT_BUILT,
    ),
    Mutant(
        "resharding-offset",
        "shard copied at the next rank's offset",
        plants.resharding_offset,
        (MATERIALISE,),
        None,
        why_not=NOT_BUILT,
    ),
    Mutant(
        "context-chunk-off-by-one",
        "a context-parallel chunk's positions off by one",
        plants.context_chunk_off_by_one,
        (
            f"{CP_PURE}::test_every_position_is_on_exactly_one_rank_and_unsharding_inverts",
            f"{CP_SPMD}[cp2-headtail-causal-gqa]",
        ),
        CONTEXT_CP4,
    ),
    Mutant(
        "context-merge-without-max",
        "the attention blocks' log-sum-exp merge without the max correction",
        plants.context_merge_without_max,
        (
            f"{CP_PURE}::test_merge_is_exact_for_logits_far_beyond_exp_range",
            f"{CP_SPMD}[cp4-headtail-causal-large-logits]",
        ),
        CONTEXT_CP4,
    ),
    Mutant(
        "context-blocks-in-wrong-order",
        "the ring's causal mask applied in the wrong chunk order",
        plants.context_blocks_in_wrong_order,
        (f"{CP_SPMD}[cp4-headtail-causal-large-logits]",),
        CONTEXT_CP4,
    ),
    Mutant(
        "experts-permuted-across-ranks",
        "each expert rank holds the next rank's experts, tokens dispatched as if it held its own",
        plants.experts_permuted_across_ranks,
        (EP_SPMD, EP_LOOP),
        QWEN2_MOE_EP,
        r"experts\.",
    ),
    Mutant(
        "expert-combine-weight-dropped",
        "a token's last expert output combined without its router weight",
        plants.expert_combine_weight_dropped,
        (EP_SPMD, EP_LOOP),
        QWEN2_MOE_EP,
    ),
    Mutant(
        "expert-grad-not-rescaled",
        "expert gradients divided by the data ranks only (the "
        "all-to-all already summed the expert ranks)",
        plants.expert_grad_not_rescaled,
        (EP_SPMD, EP_LOOP),
        QWEN2_MOE_EP,
        r"experts\.",
    ),
    Mutant(
        "moe-block-input-grad-summed",
        "a MoE block run on the whole sequence under "
        "sequence parallelism reduce-scatters its input gradient, which every rank holds "
        "whole",
        plants.moe_block_input_grad_summed,
        (MOE_SP_SPMD,),
        MOE_SP,
    ),
    Mutant(
        "balance-counts-per-rank",
        "MoE balance statistics left per rank (no count reducer)",
        plants.balance_counts_per_rank,
        (BALANCE_SPMD,),
        MOE_BALANCE_EP,
        r"router",
    ),
    Mutant(
        "experts-split-contiguously",
        "tensor parallelism inside the experts splits the "
        "packed gate_up_proj in contiguous blocks (gate rows on one rank, up rows on the "
        "other)",
        plants.experts_split_contiguously,
        (EXPERTS_TP_SPMD,),
        QWEN3_MOE_EXPERTS_TP,
        r"experts\.|<global>",
    ),
    Mutant(
        "experts-input-grad-not-summed",
        "tensor parallelism inside the experts leaves their input gradient a per-rank partial sum",
        plants.experts_input_grad_not_summed,
        (EXPERTS_TP_SPMD,),
        QWEN3_MOE_EXPERTS_TP,
    ),
    Mutant(
        "experts-not-reduced-over-context",
        "beside context parallelism, expert gradients "
        "reduced over the data ranks only (missing the other context ranks' tokens)",
        plants.experts_not_reduced_over_context,
        (CP_EP_SPMD,),
        MOE_CP_EP,
        r"experts\.",
    ),
    Mutant(
        "context-documents-from-local-chunks",
        "packed documents under context parallelism: "
        "document ids read from each rank's own chunks, not the whole sequences",
        plants.context_documents_from_local_chunks,
        (PACKED_SPMD,),
        PACKED_DP2_CP2,
    ),
    Mutant(
        "vocab-mask-off-by-one",
        "vocab-parallel mask off by one (embedding rows and loss-parallel targets)",
        plants.vocab_mask_off_by_one,
        (f"{EQ}[tp]",),
        LLAMA_TP,
        r"tok_embeddings|output|<global>",
    ),
    Mutant(
        "offload-order",
        "optimizer-state offload steps earlier parameters again",
        plants.offload_order,
        ("tests/test_offload_spmd.py::test_optimizer_state_offload_trains_like_one_device",),
        OFFLOAD_DP,
    ),
    Mutant(
        "neutral-recompute-everything",
        "selective checkpointing recomputes matmuls too",
        plants.neutral_recompute_everything,
        (f"{ZOO}[llama-tp-bf16-ac]",),
        HarnessCase(
            DebugLlama(2), DP2, {"rules": default_rules(), "activation_checkpointing": "selective"}
        ),
        equivalent=True,
    ),
    Mutant(
        "neutral-sync-every-microbatch",
        "gradients reduced every micro-batch",
        plants.neutral_sync_every_microbatch,
        (f"{EQ}[zero1]",),
        LLAMA_ACCUMULATE,
        equivalent=True,
    ),
    Mutant(
        "neutral-clip-skips-unit-scale",
        "clipping skips a factor of exactly 1",
        plants.neutral_clip_skips_unit_scale,
        (CLIP, f"{EQ}[zero3]"),
        HarnessCase(DebugLlama(2), DP2, {"rules": default_rules()}, {"max_norm": 1e3}),
        equivalent=True,
    ),
    Mutant(
        "neutral-token-count-waited-at-once",
        "global token count waited for at once",
        plants.neutral_token_count_waited_at_once,
        (f"{STEP}[fsdp-tp-accumulation]",),
        LLAMA_DP,
        equivalent=True,
    ),
]

MUTANTS: dict[str, Mutant] = {m.name: m for m in _ALL}


def plant_name(mutant: Mutant) -> str:
    """The plant's function name in ``plants.py`` (what ``MESHTRAIN_MUTANT`` carries)."""
    return mutant.plant.__name__
