"""MoE recipes: the [model] section names meshtrain's mixture of experts, and the 671B planning
recipe sizes on abstract worlds, flagging the ones it does not fit."""

from __future__ import annotations

import pytest

from meshtrain.errors import RecipeError
from meshtrain.recipes import load_recipe
from meshtrain.recipes.recipe import shrink
from meshtrain.recipes.sizing import size_recipe


def test_recipes_name_the_moe_model_and_take_its_overrides() -> None:
    recipe = load_recipe("moe_debug", ["model.top_k=1", "model.n_shared_experts=0"])
    assert recipe.model.kind == "moe"
    assert (recipe.model.moe.top_k, recipe.model.moe.n_shared_experts) == (1, 0)
    assert dict(recipe.rules().logical)["expert"] == "ep"
    v3 = load_recipe("deepseek_v3_671b").model.moe
    assert (v3.n_layers, v3.dim, v3.n_experts, v3.top_k, v3.moe_inter) == (61, 7168, 256, 8, 2048)
    assert (v3.first_dense_layers, v3.n_shared_experts, v3.vocab_size) == (3, 1, 129280)
    assert load_recipe("qwen3_moe_30b_a3b").model.moe.n_experts == 128


def test_the_expert_axis_is_a_parallel_key_like_tp_and_context() -> None:
    """``[parallel] ep`` names the expert axis: "ep" when the mesh has it, another axis when the
    recipe says so, none with "" (the experts then stay whole, FSDP-sharded like the rest)."""
    assert load_recipe("moe_debug").parallel.ep == "ep"
    assert load_recipe("debug").parallel.ep == ""  # no ep axis in its mesh
    renamed = load_recipe("moe_debug", ["mesh.ep=1", "mesh.xp=-1", "parallel.ep=xp"])
    assert dict(renamed.rules().logical)["expert"] == "xp"
    whole = load_recipe("moe_debug", ["parallel.ep="])
    assert dict(whole.rules().logical).get("expert") is None
    with pytest.raises(RecipeError, match="axis 'dp' has two jobs"):
        load_recipe("moe_debug", ["parallel.ep=dp"])
    with pytest.raises(
        RecipeError, match=r"parallel.ep = \"ex\" names axis 'ex', which \[mesh\] does not have"
    ):
        load_recipe("moe_debug", ["parallel.ep=ex"])


def test_moe_keys_and_presets_are_checked_by_name() -> None:
    with pytest.raises(RecipeError, match=r"unknown LlamaConfig field.*n_experts"):
        load_recipe("debug", ["model.n_experts=4"])
    with pytest.raises(RecipeError, match="unknown MoE preset 'llama3_8b'"):
        load_recipe("moe_debug", ["model.preset=llama3_8b"])
    with pytest.raises(RecipeError, match="n_shared_experts"):
        load_recipe("moe_debug", ["model.n_shared_experts=-1"])


def test_check_shrinks_an_moe_recipe_keeping_its_expert_axis() -> None:
    small = shrink(load_recipe("moe_debug"), 4)
    assert small.mesh_axes() == {"dp": 1, "ep": 4}
    assert small.model.moe.n_experts % 4 == 0 and small.model.moe.balance == "aux_loss"


def test_deepseek_v3_plans_on_256_ranks_and_is_flagged_on_64() -> None:
    recipe = load_recipe("deepseek_v3_671b")
    sized = size_recipe(recipe, world=256, device_memory="80GiB")
    assert sized.footprint.fits
    assert sized.plan.expert_axis == "ep" and len(sized.plan.experts) == 58
    # 256 sequences over 16 dp × 16 ep batch ranks: one each (the traced activations of 8 at
    # once do not fit); per MoE layer 3 all-to-alls in forward (tokens per expert, tokens,
    # results), 2 in backward and 3 again recomputing (full checkpointing), for 58 MoE layers
    kinds = sized.plan.collective_totals()
    count, _ = kinds[("all_to_all", "ep")]
    assert count == 58 * (3 + 2 + 3)
    assert sized.plan.options.batch_size == 256 // 256
    small = size_recipe(recipe, world=64, device_memory="80GiB")
    assert small.footprint.fits is False
