"""``[lora]``, AdamW ``betas``/``eps`` and the offload keys in recipes: validation with messages
that name the file, key and fix; the model a recipe builds; its plan, shrink and sizing."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import meshtrain as mt
from meshtrain.recipes.recipe import load_recipe, recipe_from_toml, shrink
from meshtrain.recipes.sizing import size_recipe

BASE = '[model]\npreset = "debug"\n[mesh]\ndp = -1\n'
LORA = "[lora]\nrank = 4\nalpha = 8\ntargets = ['layers\\.\\d+\\.attention\\.w[qkvo]']\n"


def test_lora_section_builds_adapters_and_freezes_the_rest() -> None:
    recipe = recipe_from_toml(BASE + LORA)
    assert recipe.lora is not None and recipe.lora.rank == 4 and recipe.lora.alpha == 8.0
    model = recipe.build_model()
    trained = {fqn for fqn, p in model.named_parameters() if p.requires_grad}
    assert len(trained) == 16 and all(".lora_" in fqn for fqn in trained)
    base = recipe.build_model(adapters=False)
    assert all(p.requires_grad for p in base.parameters())
    again = recipe.adapt(base)
    assert torch.equal(
        again.get_parameter("layers.0.attention.wq.lora_A"),
        model.get_parameter("layers.0.attention.wq.lora_A"),
    )


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ("[lora]\nrank = 4\n", "r.toml: [lora] has no targets"),
        ("[lora]\nrank = 0\ntargets = ['x']\n", "r.toml: lora.rank = 0 is out of range"),
        (
            "[lora]\ntargets = []\n",
            "r.toml: lora.targets = [] has 0 items; targets must be a non-empty array",
        ),
        ("[lora]\ntargets = ['(']\n", "'(' is not a valid regex"),
        ("[lora]\ntargets = ['x']\nquantize_base = 'int8'\n", 'quantize_base must be one of "nf4"'),
        ("[lora]\nranks = 4\n", "unknown key lora.ranks = 4 (did you mean 'rank'?"),
        (
            "[train]\nbetas = [0.9]\n",
            "train.betas = [0.9] has 1 items; betas must be an array of 2 numbers",
        ),
        ("[train]\nbetas = [0.9, 1.0]\n", "train.betas = [0.9, 1.0] is out of range"),
        (
            "[train]\nbetas = ['a', 'b']\n",
            'train.betas = ["a", "b"] is an array, but betas must be',
        ),
        ("[train]\neps = 0\n", "train.eps = 0 is out of range; eps must be a positive number"),
        (
            "[parallel]\noffload_optimizer = 1\n",
            "parallel.offload_optimizer = 1 is an integer, but",
        ),
    ],
)
def test_bad_keys_name_file_key_and_fix(section: str, message: str) -> None:
    with pytest.raises(mt.RecipeError) as error:
        recipe_from_toml(BASE + section, source="r.toml")
    assert message in str(error.value)
    assert any(fix in str(error.value) for fix in ("e.g.", "Fix the pattern", "Remove it"))


def test_targets_matching_nothing_fail_when_the_model_is_built() -> None:
    recipe = recipe_from_toml(BASE + "[lora]\ntargets = ['attn\\.q_proj']\n")
    with pytest.raises(mt.RuleError, match=r"LoRA targets \['attn\\\\.q_proj'\] match no module"):
        recipe.build_model("meta")


def test_betas_eps_and_offload_reach_the_optimizer_and_plan() -> None:
    text = BASE + "[train]\nbetas = [0.9, 0.95]\neps = 1e-6\n[parallel]\noffload_optimizer = true\n"
    recipe = recipe_from_toml(text)
    optimizer = recipe.optimizer_fn()([torch.nn.Parameter(torch.zeros(2))])
    assert optimizer.defaults["betas"] == (0.9, 0.95) and optimizer.defaults["eps"] == 1e-6
    assert (
        type(optimizer).__name__ == "AdamW" and type(optimizer).__mro__[1].__name__ == "_HostStates"
    )
    options = recipe.plan_options()
    assert options.offload_optimizer is True and options.offload is False
    assert recipe_from_toml(BASE + "[parallel]\noffload = true\n").plan_options().offload


def test_frozen_parameters_get_no_optimizer_state() -> None:
    model = recipe_from_toml(BASE + LORA).build_model()
    optimizer = recipe_from_toml(BASE + LORA).optimizer_fn()(model.parameters())
    assert sum(len(g["params"]) for g in optimizer.param_groups) == 16


@pytest.mark.parametrize("name", ["llama3_70b", "llama3_405b"])
def test_the_large_recipes_use_beta2_095_as_published(name: str) -> None:
    assert load_recipe(name).train.betas == (0.9, 0.95)


def test_shrink_keeps_the_adapters_on_a_dense_base() -> None:
    recipe = recipe_from_toml(BASE + LORA + "quantize_base = 'nf4'\n")
    small = shrink(recipe, 2)
    assert small.lora == dataclasses.replace(recipe.lora, quantize_base="")
    model = small.build_model("meta")
    assert sum(p.requires_grad for p in model.parameters()) == 16


def test_sizing_counts_gradients_and_states_of_adapters_only() -> None:
    full = size_recipe(recipe_from_toml(BASE), world=2)
    adapted = size_recipe(recipe_from_toml(BASE + LORA), world=2)
    trained = sum(p.bytes_at_rest for p in adapted.plan.params if p.trainable)
    assert adapted.footprint.memory.grads == trained
    assert adapted.footprint.memory.optimizer_states == 2 * trained
    assert full.footprint.memory.grads == full.footprint.memory.params
    assert adapted.footprint.memory.grads < full.footprint.memory.grads / 10
