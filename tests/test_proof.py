"""The plan-time proof on code meshtrain did not write (issue 43), in process on abstract meshes:
sizes read off a shard are one device's in the one-device run (torchtitan's rotary reshape
plans, OPT's global head count is still refused), probes come from ``example_inputs`` or ask for
them in one line, parameters read outside their module are recorded (replicated) or refused
(sharded), in-place updates of styled outputs and buffers written from the batch are found, and
attention context parallelism cannot split is refused while planning. Training these plans
against one device is tests/test_proof_spmd.py."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import proof_models as pm
import pytest
import torch
import zoo
from torch import nn

import meshtrain as mt
from meshtrain import P, Rules
from meshtrain.plan.ir import ParamReader, Plan

DP_TP = {"dp": 2, "tp": 2}


def mesh(**axes: int) -> mt.Mesh:
    return mt.make_mesh(**axes, world_size=math.prod(axes.values()), abstract=True)


def test_a_reshape_with_sizes_read_off_the_shard_plans_and_a_global_constant_is_refused() -> None:
    """torchtitan's ``x.reshape(*x.shape[:-1], -1, 2)`` on a rank's heads keeps them where
    they are: planned, with and without sequence parallelism; OPT's whole head count is not."""
    for logical in ((), (("seq", "tp"),)):
        rules = Rules(pm.ROTARY_RULES.patterns, logical=logical, fsdp="dp")
        plan = mt.plan(pm.rotary_lm(), mesh(**DP_TP), rules)
        assert not [n for n in plan.notes if "not proven" in n]
    opt = pm.megatron(r"self_attn\.(q|k|v)_proj", r"self_attn\.out_proj", "fc1", "fc2")
    with pytest.raises(mt.PlanError, match="reshapes with a global size"):
        mt.plan(zoo.opt(), mesh(**DP_TP), opt)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_torchtitan_llama_plans_under_its_own_tensor_parallel_layout() -> None:
    pytest.importorskip("torchtitan")
    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    import peer

    peer._on_cpu()
    for setup in ("fsdp_tp", "fsdp_tp_sp"):
        config, _ = peer._config(setup)
        with torch.device("meta"):
            model = config.build()
        plan = mt.plan(model, mesh(**DP_TP), peer._rules(setup), global_batch=4, seq_len=32)
        assert plan.sequence_parallel == (setup == "fsdp_tp_sp")
        assert {s.style for s in plan.styles} >= {"colwise", "rowwise", "prepare_input"}


def test_an_image_model_without_example_inputs_is_one_line_asking_for_them() -> None:
    with pytest.raises(mt.PlanError) as refusal:
        mt.plan(pm.group_norm_cnn(), mesh(**DP_TP), pm.CNN_RULES)
    text = str(refusal.value)
    assert "\n" not in text and "example_inputs=" in text and "'stem.0' (Conv2d)" in text
    images = pm.image_batches(0)[0]
    plan = mt.plan(pm.group_norm_cnn(), mesh(**DP_TP), pm.CNN_RULES, example_inputs=images)
    assert {s.fqn: s.style for s in plan.styles} == {
        "classifier": "prepare_input",
        "classifier.fc1": "colwise",
        "classifier.fc2": "rowwise",
    }


def test_example_inputs_may_be_positional_or_keyword() -> None:
    tokens = pm.token_batches(0)[0]
    for example in (tokens, (tokens,), {"tokens": tokens}):
        plan = mt.plan(pm.tied_mlp(), mesh(**DP_TP), pm.MLP_RULES, example_inputs=example)
        assert plan.readers == (ParamReader("embed.weight", ""),)


def test_a_forward_that_fails_on_the_probe_names_the_module_and_asks_for_examples() -> None:
    class Picky(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(16, 8)
            self.mlp = nn.ModuleDict({"up": nn.Linear(8, 16), "down": nn.Linear(16, 8)})

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            if tokens.shape[1] != 4:
                raise ValueError("sequences of 4 tokens only")
            x = self.embed(tokens)
            return self.mlp["down"](self.mlp["up"](x))

    rules = Rules(
        {r"mlp\.up\.(weight|bias)": P("tp"), r"mlp\.down\.weight": P(None, "tp"), r".*": P()},
        fsdp="dp",
    )
    with pytest.raises(mt.PlanError, match=r"failed in '<root>' \(Picky\).*example_inputs="):
        mt.plan(Picky(), mesh(**DP_TP), rules)
    plan = mt.plan(
        Picky(), mesh(**DP_TP), rules, example_inputs=torch.zeros(2, 4, dtype=torch.long)
    )
    assert plan.styles


def test_replicated_parameters_read_outside_their_module_are_recorded_for_the_reader() -> None:
    plan = mt.plan(pm.tied_mlp(), mesh(**DP_TP), pm.MLP_RULES)
    assert plan.readers == (ParamReader("embed.weight", ""),)
    assert "embed.weight: read by '<root>'" in plan.explain()
    assert Plan.from_json(plan.to_json()) == plan
    plan = mt.plan(pm.conv_reader(), mesh(**DP_TP), pm.MLP_RULES)
    assert {r.param for r in plan.readers} == {"smooth.weight", "smooth.bias"}


def test_a_sharded_parameter_read_outside_its_module_is_refused_naming_both() -> None:
    with pytest.raises(mt.PlanError) as refusal:
        mt.plan(pm.tied_mlp(), mesh(**DP_TP), pm.VOCAB_RULES)
    text = str(refusal.value)
    assert "parameter 'embed.weight' is sharded" in text and "by '<root>'" in text
    assert refusal.value.fqn == "embed.weight"


def test_an_in_place_update_of_a_row_wise_output_is_recorded() -> None:
    plan = mt.plan(pm.inplace_mlp(), mesh(**DP_TP), pm.MLP_RULES)
    assert plan.fresh_outputs == ("mlp.down",)
    assert mt.plan(pm.TokenMLP(), mesh(**DP_TP), pm.MLP_RULES).fresh_outputs == ()


@pytest.mark.parametrize("axes", [{"dp": 2}, DP_TP])
def test_a_buffer_written_from_the_batch_is_refused_or_averaged_on_request(axes: dict) -> None:
    rules = pm.MLP_RULES if "tp" in axes else Rules({".*": P()}, fsdp="dp")
    with pytest.raises(mt.PlanError, match=r"buffer 'running_mean' is written from the batch"):
        mt.plan(pm.running_mean_mlp(), mesh(**axes), rules)
    plan = mt.plan(pm.running_mean_mlp(), mesh(**axes), rules, batch_buffers="average")
    assert plan.averaged_buffers == (("running_mean", ""),)
    rows = [c for c in plan.collectives if "buffers written" in c.why]
    assert [(c.kind, c.axis, c.count, c.bytes) for c in rows] == [("all_reduce", "dp", 1, 64)]
    assert Plan.from_json(plan.to_json()) == plan
    # one data rank: nothing to average, nothing refused
    assert mt.plan(pm.running_mean_mlp(), mesh(dp=1, tp=2), pm.MLP_RULES).averaged_buffers == ()


def test_averaging_is_refused_where_it_cannot_equal_one_device() -> None:
    with pytest.raises(mt.PlanError, match="read again in the same forward"):
        mt.plan(pm.rereading_mean_mlp(), mesh(**DP_TP), pm.MLP_RULES, batch_buffers="average")
    with pytest.raises(mt.PlanError, match="2 micro-batches"):
        mt.plan(
            pm.running_mean_mlp(),
            mesh(**DP_TP),
            pm.MLP_RULES,
            batch_buffers="average",
            microbatches=2,
        )


def test_batch_norm_statistics_and_constant_buffers_are_not_batch_written() -> None:
    plan = mt.plan(zoo.cnn(), mesh(dp=2), zoo.REPLICATED, example_inputs=zoo.image_batches(0)[0])
    assert plan.batch_norms and plan.averaged_buffers == ()
    mt.plan(zoo.llama(), mesh(dp=2), Rules({".*": P()}, fsdp="dp"))  # rotary inv_freq: a constant


def test_attention_context_parallelism_cannot_split_is_refused_while_planning() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.DeepseekV3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        q_lora_rank=None,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        max_position_embeddings=64,
        use_cache=False,
        attn_implementation="sdpa",
    )
    model = transformers.DeepseekV3ForCausalLM(config)
    rules = Rules({".*": P()}, fsdp="dp", logical=[("seq", "cp")])
    with pytest.raises(mt.PlanError) as refusal:
        mt.plan(model, mesh(dp=2, cp=2), rules)
    assert "'model.layers.0.self_attn'" in str(refusal.value) and "v (" in str(refusal.value)
    assert mt.plan(model, mesh(dp=4), Rules({".*": P()}, fsdp="dp")).context_axis is None


def test_a_pair_directly_under_the_root_is_costed() -> None:
    """A column-/row-wise pair whose parent is the model itself (an ``nn.Sequential``)."""
    model = nn.Sequential(nn.Linear(12, 16), nn.GELU(), nn.Linear(16, 4))
    rules = Rules(
        {r"0\.(weight|bias)": P("tp"), r"2\.weight": P(None, "tp"), r".*": P()}, fsdp="dp"
    )
    plan = mt.plan(model, mesh(**DP_TP), rules, example_inputs=torch.zeros(8, 12))
    assert {s.fqn: s.style for s in plan.styles}[""] == "prepare_input"
    assert any(c.axis == "tp" for c in plan.collectives)
