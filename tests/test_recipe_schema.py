"""The recipe schema is declared once, as the sections' dataclasses: the key tables, the section
list, ``--set`` (in ``train``, ``plan`` and ``check``, every section ``lora`` included), "did you
mean" and the key reference of docs/recipes.md are derived from them."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from meshtrain import RecipeError
from meshtrain import launch as launch_module
from meshtrain.cli import main
from meshtrain.plan.options import SCHEDULES, PlanOptions
from meshtrain.recipes import load_recipe
from meshtrain.recipes.schema import key_table, reference_table
from meshtrain.recipes.sections import SECTION_NAMES, SECTION_TYPES, FreeForm
from meshtrain.recipes.source import apply_overrides
from meshtrain.testing import harness
from meshtrain.train.guard import ON_NONFINITE

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "recipes.md"
BEGIN, END = "<!-- recipe keys: begin -->\n", "<!-- recipe keys: end -->\n"

#: One override per section, each with a value other than the recipe's (on debug_lora).
ONE_PER_SECTION = {
    "model": ("model.n_layers=4", lambda r: r.model.config.n_layers == 4),
    "mesh": ("mesh.tp=1", lambda r: r.mesh_axes() == {"dp": -1, "tp": 1}),
    "parallel": ("parallel.zero=2", lambda r: r.parallel.zero == 2),
    "parallel.pipeline": (
        "parallel.pipeline.microbatches=4",
        lambda r: r.parallel.pipeline.microbatches == 4,
    ),
    "rules": ("rules.'.*'=P()", lambda r: r.explicit_rules is not None),
    "train": ("train.on_nonfinite=stop", lambda r: r.train.on_nonfinite == "stop"),
    "lora": ("lora.rank=8", lambda r: r.lora.rank == 8),
    "data": ("data.source=synthetic", lambda r: r.data.source == "synthetic"),
    "checkpoint": ("checkpoint.async=true", lambda r: r.checkpoint.async_save),
    "logging": ("logging.wandb=disabled", lambda r: r.logging_config().wandb == "disabled"),
    "eval": ("eval.every=5", lambda r: r.eval.every == 5),
    "profile": ("profile.steps=[2, 4]", lambda r: r.profile.steps == (2, 4)),
}


def test_the_docs_key_reference_is_the_schemas() -> None:
    text = DOCS.read_text()
    assert BEGIN in text and END in text, f"docs/recipes.md lost its {BEGIN.strip()} markers"
    documented = text.split(BEGIN)[1].split(END)[0]
    generated = reference_table()
    assert documented == generated, (
        "docs/recipes.md's key reference differs from the schema; paste this between the "
        f"markers:\n{generated}"
    )


def test_reading_and_checking_a_recipe_imports_no_torch_until_the_vocabularies_are_needed() -> None:
    code = (
        "import sys\n"
        "from meshtrain.recipes import schema, source\n"
        "from meshtrain.recipes.preflight import check_launch\n"
        "data, where = source.parse_recipe('[mesh]\\ndp = -1\\n', 'r.toml', ['lora.rank=8'])\n"
        "assert data == {'mesh': {'dp': -1}, 'lora': {'rank': 8}}, data\n"
        "check_launch(data, where, nproc=2)\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_every_field_of_every_section_is_a_key_with_its_default_doc_and_example() -> None:
    for section, section_type in SECTION_TYPES.items():
        keys = key_table(section)
        if isinstance(section_type, FreeForm):
            assert keys == {}
            continue
        defaults = section_type()
        for field in dataclasses.fields(section_type):
            if field.metadata["keys_from"] is not None:  # [model]'s LlamaConfig fields
                config = field.metadata["keys_from"]()
                assert {f.name for f in dataclasses.fields(config)} <= set(keys)
                continue
            key = keys[field.metadata["toml"] or field.name]
            assert key.default == getattr(defaults, field.name) and key.doc, (section, field.name)
            assert key.example is not None


def test_closed_choices_are_the_lower_layers_vocabularies() -> None:
    assert key_table("parallel.pipeline")["schedule"].choices == SCHEDULES
    assert key_table("train")["on_nonfinite"].choices == ON_NONFINITE
    assert key_table("parallel")["zero"].choices == (0, 1, 2, 3)
    assert key_table("lora")["quantize_base"].choices == ("nf4",)


def test_set_reaches_every_section() -> None:
    assert set(ONE_PER_SECTION) == set(SECTION_NAMES)
    for section, (override, applied) in ONE_PER_SECTION.items():
        extra = ["mesh.pp=2"] if section == "parallel.pipeline" else []
        recipe = load_recipe("debug_lora", [override, *extra])
        assert applied(recipe), (section, override)


def test_set_with_an_unknown_section_or_key_suggests_the_known_ones() -> None:
    with pytest.raises(RecipeError, match=r"a known section \(did you mean 'lora'\?"):
        load_recipe("debug_lora", ["lroa.rank=8"])
    with pytest.raises(RecipeError, match=r"unknown key lora.rnak = 8 \(did you mean 'rank'\?"):
        load_recipe("debug_lora", ["lora.rnak=8"])
    with pytest.raises(RecipeError, match=r"is not section\.key=value"):
        apply_overrides({}, ["rank=8"])


def test_plan_takes_set_for_lora(capsys: pytest.CaptureFixture[str]) -> None:
    trainable = {}
    for rank in ("4", "8"):
        assert (
            main(["plan", "debug_lora", "--world", "4", "--json", "--set", f"lora.rank={rank}"])
            == 0
        )
        trainable[rank] = json.loads(capsys.readouterr().out)["memory"]["optimizer_states"]
    assert trainable["8"] == 2 * trainable["4"] > 0  # the adapters' Adam states double


def test_train_takes_set_for_lora_and_passes_it_to_every_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    started: list[list[str]] = []

    def run_agent(arguments: list[str], **kwargs: Any) -> int:
        started.append(arguments)
        return 0

    monkeypatch.setattr(launch_module, "run_agent", run_agent)
    sets = [
        "--set",
        "lora.rank=8",
        "--set",
        'checkpoint.init_from=""',
        "--set",
        "data.source=synthetic",
        "--set",
        f"logging.run_dir={tmp_path}",
    ]
    assert main(["train", "debug_lora", "--nproc", "4", *sets]) == 0
    (arguments,) = started
    assert arguments[-len(sets) :] == sets


def test_check_takes_set_for_lora(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[Any, ...]] = []

    def compared(*args: Any, **kwargs: Any) -> None:
        calls.append(args)
        raise RecipeError("stop here")

    monkeypatch.setattr(harness, "assert_equivalent", compared)
    assert main(["check", "debug_lora", "--world", "2", "--set", "lora.rank=8"]) == 2
    ((model_fn, _, plan_arguments),) = calls
    assert model_fn.rank == 8 and isinstance(plan_arguments["options"], PlanOptions)
    assert main(["check", "debug_lora", "--world", "2", "--set", "lora.rank=0"]) == 2


def test_a_train_layer_error_is_one_line_and_exit_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from meshtrain.recipes import sizing
    from meshtrain.train.metrics import LoggingConfig

    def refused(*args: Any, **kwargs: Any) -> None:
        LoggingConfig(log_every=0)

    monkeypatch.setattr(sizing, "size_recipe", refused)
    assert main(["plan", "debug", "--world", "2"]) == 2
    err = capsys.readouterr().err
    assert err == "ConfigError: LoggingConfig(log_every=0): give 1 or more (1 logs every step).\n"


def test_set_keeps_the_text_for_a_string_key() -> None:
    recipe = load_recipe("debug", ["logging.wandb_entity=1234", "data.path=2024", "train.steps=50"])
    assert recipe.logging.wandb_entity == "1234" and recipe.data.path == "2024"
    assert recipe.train.steps == 50  # an integer key still reads a number


def test_plan_options_unpacked_with_stars_still_plans_with_a_deprecation_warning() -> None:
    import meshtrain as mt
    from meshtrain.models import LlamaConfig, build_llama
    from meshtrain.recipes import load_recipe

    recipe = load_recipe("debug")
    model = build_llama(LlamaConfig.debug(), device="meta")
    mesh = mt.make_mesh(dp=2, tp=2, world_size=4)
    expected = mt.plan(model, mesh, recipe.rules(), recipe.plan_options())
    with pytest.warns(DeprecationWarning, match="pass it whole"):
        unpacked = mt.plan(model, mesh, recipe.rules(), **recipe.plan_options())
    assert unpacked.to_json() == expected.to_json()
