"""Recipes: loading, errors that name the key and what is allowed, spec strings, shrinking."""

from __future__ import annotations

import dataclasses
import math
import pickle
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import meshtrain as mt
from meshtrain import P, RecipeError
from meshtrain.models import LlamaConfig
from meshtrain.recipes import (
    OptimizerBuilder,
    ParallelSection,
    Recipe,
    TrainSection,
    load_recipe,
    parse_spec,
    recipe_from_toml,
    shrink,
)

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = sorted(path.stem for path in (ROOT / "recipes").glob("*.toml"))
WORLDS = (1, 2, 4, 8)
# The scale each shipped recipe is written for, planned on an abstract mesh.
AT_SCALE = {"debug": 8, "llama3_8b": 64, "llama3_70b": 256, "llama3_405b": 1024}
#: The fine-tuning recipes (LoRA from a pretrained directory; tests/test_finetune_recipes.py and
#: tests/test_finetune_e2e.py), each on a Llama preset.
FINETUNE = {"debug_lora": "debug", "llama3_8b_lora": "llama3_8b", "llama3_70b_qlora": "llama3_70b"}
PRETRAIN = sorted(AT_SCALE)
#: The long-context recipes (docs/long-context.md): their preset and the world they plan on.
LONG_CONTEXT = {"llama3_8b_128k": ("llama3_8b", 16), "long_debug": ("debug", 4)}
#: The mixture-of-experts recipes (docs/moe.md; tests/test_moe_recipes.py): their preset.
MOE = {
    "moe_debug": "debug",
    "qwen3_moe_30b_a3b": "qwen3_moe_30b_a3b",
    "deepseek_v3_671b": "deepseek_v3_671b",
}

BASE = """
[model]
name = "llama"
preset = "debug"

[mesh]
dp = -1
tp = 2
"""


def _error(text: str) -> str:
    with pytest.raises(RecipeError) as info:
        recipe_from_toml(text, source="bad.toml")
    return info.value.message


def _plan(recipe: Recipe, world: int) -> mt.Plan:
    mesh = mt.make_mesh(recipe.mesh_axes(), world_size=world, abstract=True)
    return mt.plan(recipe.build_model(device="meta"), mesh, recipe.rules(), recipe.plan_options())


def test_the_shipped_recipes_are_the_four_llama_presets_and_their_fine_tuning() -> None:
    assert sorted([*PRETRAIN, *FINETUNE, *LONG_CONTEXT, *MOE]) == SHIPPED
    for name, preset in MOE.items():
        assert load_recipe(name).model.kind == "moe" and load_recipe(name).model.preset == preset
    for name, preset in FINETUNE.items():
        recipe = load_recipe(name)
        assert recipe.model.preset == preset and recipe.lora is not None
        assert recipe.checkpoint.init_from


@pytest.mark.parametrize("name", sorted(LONG_CONTEXT))
def test_the_long_context_recipes_plan_over_a_context_axis(name: str) -> None:
    recipe = load_recipe(name)
    preset, world = LONG_CONTEXT[name]
    assert recipe.model.preset == preset
    plan = _plan(recipe, world)
    assert plan.context_axis == "cp" and plan.mesh.world_size == world
    assert recipe.train.seq_len // plan.mesh.size("cp") < recipe.train.seq_len  # split over cp


@pytest.mark.slow
@pytest.mark.parametrize("name", PRETRAIN)
def test_every_shipped_recipe_loads_and_plans_at_its_scale(name: str) -> None:
    recipe = load_recipe(name)
    assert recipe.name == name and recipe.model.preset == name
    assert recipe.model.config == LlamaConfig.preset(name)
    plan = _plan(recipe, AT_SCALE[name])
    assert plan.mesh.world_size == AT_SCALE[name]
    assert plan.tp_axis == "tp" and plan.data_axes == ("dp",)
    assert (plan.pipeline is not None) == (recipe.parallel.pipeline is not None)


def test_names_are_found_under_the_current_directory_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert load_recipe("debug").source == str(ROOT / "recipes" / "debug.toml")
    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes" / "debug.toml").write_text(BASE + "[train]\nsteps = 7\n")
    assert load_recipe("debug").train.steps == 7
    assert load_recipe(tmp_path / "recipes" / "debug.toml").train.steps == 7


def test_an_unknown_name_lists_the_recipes() -> None:
    with pytest.raises(RecipeError, match=r"no recipe named 'debugg'.*did you mean 'debug'"):
        load_recipe("debugg")
    with pytest.raises(RecipeError, match="does not exist"):
        load_recipe("nowhere/debug.toml")


def test_defaults_overrides_and_plan_options() -> None:
    recipe = recipe_from_toml(BASE)
    assert recipe.parallel == ParallelSection(ep="")  # debug's mesh has no ep axis
    assert recipe.train == TrainSection()
    overridden = recipe_from_toml(
        BASE.replace('preset = "debug"', 'preset = "debug"\nn_layers = 4')
    )
    assert overridden.model.config.n_layers == 4
    options = recipe.plan_options()
    assert options == mt.PlanOptions(
        zero=3,
        precision="fp32",
        activation_checkpointing="none",
        compile=False,
        optimizer="adamw",
        global_batch=8,
        seq_len=16,
        microbatches=1,
        grad_reduction="sum",
        offload=False,
        offload_optimizer=False,
    )
    assert _plan(recipe, 4).mesh == mt.Mesh(("dp", "tp"), (2, 2))


def test_a_pipeline_table_becomes_a_pipeline() -> None:
    recipe = load_recipe("llama3_70b")
    options = recipe.plan_options()
    assert options.microbatches == 1  # the pipeline's micro-batches are the plan's
    assert options.pipeline == mt.Pipeline(
        axis="pp", schedule="Interleaved1F1B", microbatches=8, stages_per_rank=2
    )


def test_builders_are_picklable_and_seeded() -> None:
    recipe = shrink(load_recipe("debug"), 2)
    model_fn = pickle.loads(pickle.dumps(recipe.model_fn()))
    first, second = model_fn(), recipe.build_model()
    for (fqn, a), (_, b) in zip(first.named_parameters(), second.named_parameters()):
        assert torch.equal(a, b), fqn
    optimizer = pickle.loads(pickle.dumps(OptimizerBuilder("adamw", 0.5)))(first.parameters())
    assert isinstance(optimizer, torch.optim.AdamW) and optimizer.defaults["lr"] == 0.5


# ----------------------------------------------------------------------------- errors


def test_an_unknown_key_names_it_and_the_allowed_keys() -> None:
    message = _error(BASE + "[parallel]\nzeroo = 3\n")
    assert message.startswith("bad.toml: unknown key parallel.zeroo = 3")
    assert "did you mean 'zero'?" in message
    assert "'sequence_parallel'" in message and "'pipeline'" in message


def test_an_unknown_key_in_the_pipeline_table() -> None:
    message = _error(BASE + "[parallel.pipeline]\nschedul = '1F1B'\n")
    assert "unknown key parallel.pipeline.schedul" in message
    assert "did you mean 'schedule'?" in message


def test_an_unknown_section_names_the_allowed_sections() -> None:
    message = _error(BASE + "[optim]\nlr = 1.0\n")
    assert message.startswith("bad.toml: unknown section [optim]")
    for section in ("'model'", "'mesh'", "'parallel'", "'rules'", "'train'"):
        assert section in message


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (
            '[parallel]\nzero = "3"\n',
            'parallel.zero = "3" is a string, but zero must be one of 0, 1, 2, 3',
        ),
        (
            "[parallel]\nzero = 5\n",
            "parallel.zero = 5 is not allowed; zero must be one of 0, 1, 2, 3",
        ),
        ('[parallel]\nprecision = "bf32"\n', 'precision must be one of "fp32", "bf16", "fp16"'),
        (
            "[parallel]\nsequence_parallel = 1\n",
            "is an integer, but sequence_parallel must be a boolean",
        ),
        (
            '[parallel]\nfsdp = "dp"\n',
            'parallel.fsdp = "dp" is a string, but fsdp must be an array of strings',
        ),
        (
            "[train]\nsteps = 0\n",
            "train.steps = 0 is out of range; steps must be a positive integer",
        ),
        ("[train]\nlr = true\n", "train.lr = true is a boolean, but lr must be a positive number"),
        ('[train]\noptimizer = "lion"\n', 'optimizer must be one of "sgd", "adam", "adamw"'),
        ('[parallel.pipeline]\nschedule = "2F2B"\n', 'schedule must be one of "GPipe", "1F1B"'),
    ],
)
def test_a_wrong_value_names_the_key_the_value_and_what_is_allowed(
    extra: str, expected: str
) -> None:
    message = _error(BASE + extra)
    assert message.startswith("bad.toml: ") and expected in message
    assert "Write e.g." in message


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (BASE.replace("tp = 2", 'tp = "2"'), 'mesh.tp = "2" is a string, but mesh sizes must be'),
        (BASE.replace("tp = 2", "tp = -1"), "has -1 on several axes ['dp', 'tp']"),
        (BASE.replace("dp = -1\ntp = 2\n", ""), "[mesh] is empty"),
        ("[model]\npreset = 'debug'\n", "missing section [mesh]"),
        (BASE + "[parallel]\nfsdp = ['data']\n", "names axis 'data', which [mesh] does not have"),
        (BASE + "[parallel]\ntp = 'dp'\n", "axis 'dp' has two jobs"),
        (
            BASE + "[parallel.pipeline]\naxis = 'pp'\n",
            "parallel.pipeline.axis = \"pp\" names axis 'pp'",
        ),
        (
            BASE + "[parallel]\nmicrobatches = 2\n[parallel.pipeline]\nmicrobatches = 4\n",
            "disagree",
        ),
        (BASE + "pp = 1\n[parallel.pipeline]\n", "mesh.pp = 1, but [parallel.pipeline] lays"),
        (
            BASE.replace('preset = "debug"', 'preset = "debug"\ndim = 65'),
            "not divisible by n_heads=4",
        ),
        (BASE.replace('preset = "debug"', 'preset = "llama2"'), 'preset must be one of "debug"'),
        ("parallel = 3\n" + BASE, "parallel = 3 is an integer, but [parallel] must be a table"),
        (BASE + "[train\n", "not valid TOML"),
    ],
)
def test_inconsistent_recipes_say_why(text: str, expected: str) -> None:
    assert expected in _error(text)


# ----------------------------------------------------------------------------- spec strings


@pytest.mark.parametrize(
    ("text", "spec"),
    [
        ("P()", P()),
        ("P('tp', None)", P("tp", None)),
        ('P(None, "tp")', P(None, "tp")),
        ("P(('dp', 'tp'), None)", P(("dp", "tp"), None)),
        ("  P('tp',)  ", P("tp")),
    ],
)
def test_spec_strings_parse_to_specs(text: str, spec: P) -> None:
    assert parse_spec(text) == spec


@pytest.mark.parametrize(
    "text",
    [
        "P(__import__('os'))",
        "__import__('os').system('true')",
        "P(tp)",
        "P('tp', 1)",
        "P(('dp', 2))",
        "P(*['tp'])",
        "P(unreduced='dp')",
        "Q('tp')",
        "P('tp'",
        "P('')",
        "P('tp') + P()",
    ],
)
def test_spec_strings_that_are_not_literal_specs_are_refused(text: str) -> None:
    with pytest.raises(RecipeError, match=r"P\("):
        parse_spec(text, where="rules.x")


def test_explicit_rules_keep_their_order_and_plan() -> None:
    rules_table = r"""
[rules]
'layers\.\d+\.attention\.w[qkv]\.weight' = "P('tp', None)"
'layers\.\d+\.attention\.wo\.weight' = "P(None, 'tp')"
'layers\.\d+\.feed_forward\.w[13]\.weight' = "P('tp', None)"
'layers\.\d+\.feed_forward\.w2\.weight' = "P(None, 'tp')"
'output\.weight' = "P('tp', None)"
'.*' = "P()"
"""
    recipe = recipe_from_toml(BASE + "[parallel]\nsequence_parallel = true\n" + rules_table)
    rules = recipe.rules()
    assert [spec for _, spec in rules.patterns] == [
        P("tp", None),
        P(None, "tp"),
        P("tp", None),
        P(None, "tp"),
        P("tp", None),
        P(),
    ]
    assert rules.logical == (("seq", "tp"),) and rules.fsdp == ("dp",)
    plan = _plan(recipe, 4)
    assert plan.tp_axis == "tp" and plan.sequence_parallel
    assert 'bad.toml: rules."[": the key is not a valid regex' in _error(
        BASE + "[rules]\n'[' = \"P()\"\n"
    )
    assert "is an integer, but a rule's value must be a spec string" in _error(
        BASE + "[rules]\n'.*' = 3\n"
    )


# ----------------------------------------------------------------------------- shrink


def _check_shrunk(recipe: Recipe, small: Recipe, world: int) -> None:
    """The structure a shrunk recipe keeps (see ``shrink``'s docstring)."""
    sizes, original = small.mesh_axes(), recipe.mesh_axes()
    assert list(sizes) == list(original) and math.prod(sizes.values()) == world
    par, pipe = small.parallel, small.parallel.pipeline
    first_data = par.fsdp[0] if par.fsdp else None
    for axis, size in sizes.items():
        if original[axis] == 1 and axis != first_data:
            assert size == 1, (axis, sizes)
        if axis != first_data and original[axis] > 0:
            assert size <= original[axis], (axis, sizes)
    tp = sizes[par.tp] if par.tp else 1
    if small.model.moe is not None:  # the debug MoE, its experts split over the expert axis
        assert small.model.moe.n_experts % sizes.get("ep", 1) == 0
        return
    config = small.model.config
    assert config.head_dim == 16 and config.n_heads == max(4, 2 * tp)
    assert config.n_kv_heads % tp == 0 and config.vocab_size % tp == 0
    stages = sizes[pipe.axis] * pipe.stages_per_rank if pipe else 1
    assert config.n_layers == max(2, stages) and config.max_seq_len >= small.train.seq_len
    micro = pipe.microbatches if pipe else par.microbatches
    assert micro is not None
    data_ranks = math.prod(sizes[axis] for axis in par.fsdp)
    assert small.train.batch_size % (data_ranks * micro) == 0
    assert small.train.batch_size <= max(8, data_ranks * micro)
    assert dataclasses.replace(small.parallel, microbatches=1, pipeline=None) == (
        dataclasses.replace(recipe.parallel, microbatches=1, pipeline=None)
    )


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_recipes_shrink_to_plans_or_say_why(name: str, world: int) -> None:
    recipe = load_recipe(name)
    try:
        small = shrink(recipe, world)
        _check_shrunk(recipe, small, world)
        _plan(small, world)
    except mt.MeshtrainError as err:
        assert world != 4, f"{name} must plan on 4 ranks: {err}"
        assert "--world 4" in err.message
    if world == 4 and recipe.parallel.pipeline is not None:  # pipeline and bf16 data axis kept
        assert small.mesh_axes() == {"pp": 2, "dp": 2, "tp": 1}


@st.composite
def _variants(draw: st.DrawFn) -> tuple[Recipe, int]:
    """A shipped recipe with its options and mesh order redrawn, and a world size."""
    recipe = load_recipe(draw(st.sampled_from(SHIPPED)))
    mesh = draw(st.permutations(recipe.mesh))
    pipe = recipe.parallel.pipeline
    if pipe is not None:
        schedule = draw(
            st.sampled_from(
                [
                    "GPipe",
                    "1F1B",
                    "Interleaved1F1B",
                    "LoopedBFS",
                    "InterleavedZeroBubble",
                    "ZBVZeroBubble",
                ]
            )
        )
        single = schedule in ("GPipe", "1F1B")
        pipe = dataclasses.replace(
            pipe,
            schedule=schedule,
            stages_per_rank=1 if single else 2,
            microbatches=draw(st.sampled_from([None, 1, 2, 4, 8])),
        )
    parallel = dataclasses.replace(
        recipe.parallel,
        zero=draw(st.integers(0, 3)),
        precision=draw(st.sampled_from(["fp32", "bf16", "fp16"])),
        activation_checkpointing=draw(st.sampled_from(["none", "full", "selective"])),
        sequence_parallel=draw(st.booleans()),
        microbatches=1 if pipe else draw(st.integers(1, 4)),
        pipeline=pipe,
    )
    train = dataclasses.replace(recipe.train, batch_size=draw(st.integers(1, 64)))
    world = draw(st.sampled_from(WORLDS))
    return dataclasses.replace(recipe, mesh=tuple(mesh), parallel=parallel, train=train), world


@given(_variants())
def test_shrunk_recipes_plan_or_raise_a_meshtrain_error_that_says_why(
    case: tuple[Recipe, int],
) -> None:
    recipe, world = case
    try:
        small = shrink(recipe, world)
    except RecipeError as err:
        assert "--world" in err.message or "no data axis" in err.message
        return
    _check_shrunk(recipe, small, world)
    try:
        _plan(small, world)
    except mt.MeshtrainError as err:
        assert len(err.message) > 40 and type(err).__name__.endswith("Error")


def test_the_shrunk_model_keeps_grouped_query_attention_where_tp_allows() -> None:
    recipe = load_recipe("llama3_8b")  # 32 query heads share 8 kv heads: ratio 4
    assert [
        (c.n_heads, c.n_kv_heads)
        for c in (shrink(recipe, world).model.config for world in (2, 4, 8))
    ] == [(4, 1), (4, 2), (8, 4)]  # tp 1, 2, 4: kv heads a multiple of tp


def test_a_mesh_without_a_data_axis_cannot_absorb_extra_ranks() -> None:
    recipe = recipe_from_toml(BASE.replace("dp = -1\n", "") + "[parallel]\nfsdp = []\n")
    assert shrink(recipe, 2).mesh_axes() == {"tp": 2}
    with pytest.raises(RecipeError, match="2 of 4 ranks are left over with no data axis"):
        shrink(recipe, 4)


@pytest.mark.parametrize("name", PRETRAIN)  # the fine-tuning recipes write no [rules]
def test_shipped_rules_give_the_plan_of_the_models_logical_axes(name: str) -> None:
    """The ``[rules]`` block each shipped recipe spells out lays every parameter out as the
    model's logical-axis rules do: same specs, styles, units and memory (on the recipe shrunk to
    8 ranks, which keeps every parameter name and mesh axis)."""
    recipe = shrink(load_recipe(name), 8)
    assert recipe.explicit_rules is not None
    logical = dataclasses.replace(recipe, explicit_rules=None)
    explicit, implicit = _plan(recipe, 8), _plan(logical, 8)

    def layouts(plan: mt.Plan) -> list[tuple[str, tuple[object, ...]]]:
        """Each parameter's spec, padded with None to its rank (P('tp') is P('tp', None))."""
        return [(p.fqn, (*p.spec, *(None,) * (len(p.shape) - len(p.spec)))) for p in plan.params]

    assert layouts(explicit) == layouts(implicit)
    assert explicit.styles == implicit.styles and explicit.units == implicit.units
    assert explicit.memory == implicit.memory
