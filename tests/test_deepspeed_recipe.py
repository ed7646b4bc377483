"""``meshtrain recipe from-deepspeed``: the Hugging Face / DeepSpeed example configs for ZeRO-2,
ZeRO-3 and ZeRO-3 with offload translate key by key, unmappable keys are refused by name with
exit status 2, and a translated plan trains like one device under its contract."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from meshtrain.cli import main
from meshtrain.recipes import load_recipe
from meshtrain.recipes.deepspeed import DeepSpeedConfigError, translate_deepspeed

# The Trainer integration's examples (transformers docs, "DeepSpeed": ZeRO-2 and ZeRO-3 configs),
# as users copy them; "auto" values are filled from the Trainer's arguments.
ZERO2 = json.loads("""
{
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000,
             "initial_scale_power": 16, "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW",
                  "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR",
                  "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                             "warmup_num_steps": "auto"}},
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": true},
                          "allgather_partitions": true, "allgather_bucket_size": 2e8,
                          "overlap_comm": true, "reduce_scatter": true,
                          "reduce_bucket_size": 2e8, "contiguous_gradients": true},
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": false
}
""")
ZERO3_OFFLOAD = json.loads("""
{
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000,
             "initial_scale_power": 16, "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW",
                  "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR",
                  "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                             "warmup_num_steps": "auto"}},
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu", "pin_memory": true},
        "offload_param": {"device": "cpu", "pin_memory": true},
        "overlap_comm": true, "contiguous_gradients": true, "sub_group_size": 1e9,
        "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto", "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9, "stage3_gather_16bit_weights_on_model_save": true
    },
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": false
}
""")
# ZeRO-3 without offload, with the values a Trainer run would have filled in.
ZERO3 = copy.deepcopy(ZERO3_OFFLOAD)
ZERO3["zero_optimization"]["offload_optimizer"] = {"device": "none"}
ZERO3["zero_optimization"]["offload_param"] = {"device": "none"}
ZERO3.update(
    {
        "bf16": {"enabled": True},
        "fp16": {"enabled": False},
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 1.0,
        "train_batch_size": 8,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": 3e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1},
        },
        "scheduler": {
            "type": "WarmupCosineLR",
            "params": {
                "warmup_min_ratio": 0,
                "warmup_num_steps": 2,
                "total_num_steps": 6,
                "cos_min_ratio": 0.1,
            },
        },
    }
)


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        (ZERO2, {"parallel.zero": 2, "parallel.offload_optimizer": True}),
        (
            ZERO3_OFFLOAD,
            {"parallel.zero": 3, "parallel.offload_optimizer": True, "parallel.offload": True},
        ),
        (
            ZERO3,
            {
                "parallel.zero": 3,
                "parallel.precision": "bf16",
                "parallel.microbatches": 2,
                "train.batch_size": 8,
                "train.max_norm": 1.0,
                "train.optimizer": "adamw",
                "train.lr": 3e-3,
                "train.betas": [0.9, 0.95],
                "train.weight_decay": 0.1,
                "train.warmup_steps": 2,
                "train.steps": 6,
            },
        ),
    ],
    ids=["zero2", "zero3-offload", "zero3"],
)
def test_the_example_configs_translate_key_by_key(
    tmp_path: Path, config: dict, expected: dict
) -> None:
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(config))
    out = tmp_path / "recipe.toml"
    assert main(["recipe", "from-deepspeed", str(path), "--model", "debug", "--out", str(out)]) == 0
    translation = translate_deepspeed(config)
    assert expected.items() <= translation.settings.items()
    recipe = load_recipe(str(out))
    assert recipe.parallel.zero == expected["parallel.zero"]
    assert recipe.parallel.offload_optimizer == expected.get("parallel.offload_optimizer", False)
    assert recipe.parallel.offload == expected.get("parallel.offload", False)
    if "train.steps" in expected:
        assert recipe.train.min_lr == pytest.approx(3e-4)  # cos_min_ratio × lr
        assert recipe.parallel.precision == "bf16" and recipe.parallel.microbatches == 2
    # every leaf is mapped, left to the recipe ("auto") or listed as a tuning knob
    assert "steps_per_print" not in translation.auto


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (
            {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}},
            "zero_optimization.offload_param.device",
        ),
        ({"scheduler": {"type": "OneCycle", "params": {}}}, "scheduler.type"),
        (
            {"fp16": {"enabled": True, "consecutive_hysteresis": True}},
            "fp16.consecutive_hysteresis",
        ),
        ({"fp16": {"enabled": True, "initial_scale_power": 16.5}}, "fp16.initial_scale_power"),
        (
            {"activation_checkpointing": {"partition_activations": True}},
            "activation_checkpointing.partition_activations",
        ),
        ({"optimizer": {"type": "Lamb", "params": {}}}, "optimizer.type"),
    ],
    ids=[
        "nvme",
        "one-cycle",
        "consecutive-hysteresis",
        "scale-power",
        "unknown-section",
        "optimizer",
    ],
)
def test_unmappable_keys_are_refused_by_name_with_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], change: dict, named: str
) -> None:
    with pytest.raises(DeepSpeedConfigError, match=named.replace(".", r"\.")):
        translate_deepspeed(change)
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(change))
    out = tmp_path / "recipe.toml"
    assert main(["recipe", "from-deepspeed", str(path), "--out", str(out)]) == 2
    assert named in capsys.readouterr().err
    assert not out.exists()


def test_the_fp16_loss_scaler_settings_become_recipe_keys(tmp_path: Path) -> None:
    """The ZeRO-2 example's scaler (window 1000, hysteresis 2, floor 1, 2**16) and a static
    scale reach the recipe's [train] keys; with fp16 off they are listed as inactive."""
    translation = translate_deepspeed(ZERO2)
    assert {
        "train.loss_scale_window": 1000,
        "train.loss_scale_hysteresis": 2,
        "train.min_loss_scale": 1.0,
        "train.initial_loss_scale": 65536.0,
    }.items() <= translation.settings.items()
    assert "train.loss_scale" not in translation.settings  # 0: dynamic, the default
    path, out = tmp_path / "ds.json", tmp_path / "recipe.toml"
    path.write_text(
        json.dumps({"fp16": {"enabled": True, "loss_scale": 128, "initial_scale_power": 12}})
    )
    assert main(["recipe", "from-deepspeed", str(path), "--out", str(out)]) == 0
    train = load_recipe(str(out)).train
    assert (train.loss_scale, train.initial_loss_scale) == (128.0, 4096.0)
    off = translate_deepspeed({"fp16": {"enabled": False, "hysteresis": 4}})
    assert off.inactive == ["fp16.hysteresis"] and "train.loss_scale_hysteresis" not in off.settings


def test_deepspeed_adam_is_adamw_unless_told_otherwise() -> None:
    params: dict[str, object] = {"lr": 1e-3}
    adam = {"optimizer": {"type": "Adam", "params": params}}
    assert translate_deepspeed(adam).settings["train.optimizer"] == "adamw"
    params["adam_w_mode"] = False
    assert translate_deepspeed(adam).settings["train.optimizer"] == "adam"


@pytest.mark.spmd
@pytest.mark.slow
@pytest.mark.parametrize(
    "example",
    [
        "zero3",
        pytest.param("zero2", marks=pytest.mark.extended),
        pytest.param("zero3-offload", marks=pytest.mark.extended),
    ],
)
def test_a_translated_plan_trains_like_one_device(tmp_path: Path, example: str) -> None:
    path = tmp_path / "ds_config.json"
    config = copy.deepcopy(
        {"zero3": ZERO3, "zero2": ZERO2, "zero3-offload": ZERO3_OFFLOAD}[example]
    )
    config["bf16"] = {"enabled": False}  # the fp32 contract: the tightest bound
    path.write_text(json.dumps(config))
    out = tmp_path / "recipe.toml"
    assert main(["recipe", "from-deepspeed", str(path), "--out", str(out)]) == 0
    assert main(["check", str(out), "--world", "2", "--steps", "3"]) == 0


def test_a_refusal_comes_before_torch_is_imported(tmp_path: Path) -> None:
    import subprocess
    import sys

    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"optimizer": {"type": "Lamb"}}))
    code = (
        "import sys\nfrom meshtrain.cli import main\n"
        f"code = main(['recipe', 'from-deepspeed', {str(path)!r}, '--out', 'x.toml'])\n"
        "print(code, 'torch' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        cwd=tmp_path,
    )
    assert done.stdout.split() == ["2", "False"]
    assert "optimizer.type" in done.stderr


@pytest.mark.parametrize(
    ("text", "named"),
    [
        (
            '{"optimizer": {"type": "AdamW", "params": {"betas": 0.9}}}',
            "optimizer.params.betas = 0.9 (two numbers in [0, 1)",
        ),
        (
            '{"optimizer": {"type": "AdamW", "params": {"lr": "abc"}}}',
            'optimizer.params.lr = "abc" (a positive finite number)',
        ),
        (
            '{"optimizer": {"type": "AdamW", "params": {"lr": null}}}',
            "optimizer.params.lr = null (a positive finite number)",
        ),
        (
            '{"optimizer": {"type": "AdamW", "params": {"lr": 1e400}}}',
            "optimizer.params.lr = Infinity (a positive finite number)",
        ),
        (
            '{"optimizer": {"type": "AdamW", "params": {"eps": NaN}}}',
            "optimizer.params.eps = NaN (a positive finite number)",
        ),
        (
            '{"optimizer": {"type": "AdamW", "params": {"weight_decay": -1}}}',
            "optimizer.params.weight_decay = -1 (a finite number ≥ 0)",
        ),
        (
            '{"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": "abc"}}}',
            'scheduler.params.warmup_num_steps = "abc" (a whole number of steps ≥ 0)',
        ),
        (
            '{"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 1e400}}}',
            "scheduler.params.warmup_num_steps = Infinity (a whole number of steps ≥ 0)",
        ),
        (
            '{"scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": null}}}',
            "scheduler.params.warmup_max_lr = null (a positive finite number)",
        ),
    ],
    ids=[
        "scalar-betas",
        "lr-text",
        "lr-null",
        "lr-overflow",
        "eps-nan",
        "decay-negative",
        "warmup-text",
        "warmup-overflow",
        "max-lr-null",
    ],
)
def test_values_of_the_wrong_type_or_range_are_one_line_naming_the_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, named: str
) -> None:
    """These used to end in tracebacks (TypeError for a scalar betas or null, ValueError for
    "abc", OverflowError for 1e400) or in a recipe that is not valid TOML."""
    path = tmp_path / "ds.json"
    path.write_text(text)
    out = tmp_path / "recipe.toml"
    assert main(["recipe", "from-deepspeed", str(path), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("DeepSpeedConfigError: ") and named in err
    assert not out.exists()


def test_an_output_in_a_missing_directory_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "ds.json"
    path.write_text("{}")
    out = tmp_path / "missing" / "recipe.toml"
    assert main(["recipe", "from-deepspeed", str(path), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"its directory {str(out.parent)!r} does not exist" in err


# DeepSpeed's documented WarmupDecayLR example (docs: "Learning Rate Schedulers")
WARMUP_DECAY = {
    "train_batch_size": 8,
    "scheduler": {
        "type": "WarmupDecayLR",
        "params": {
            "total_num_steps": 1000,
            "warmup_min_lr": 0,
            "warmup_max_lr": 0.001,
            "warmup_num_steps": 100,
        },
    },
}


def test_warmup_decay_lr_is_a_linear_decay_to_zero_at_its_total_steps(tmp_path: Path) -> None:
    from meshtrain.train.schedule import WarmupCosine

    path = tmp_path / "ds.json"
    path.write_text(json.dumps(WARMUP_DECAY))
    out = tmp_path / "recipe.toml"
    assert main(["recipe", "from-deepspeed", str(path), "--out", str(out)]) == 0
    train = load_recipe(str(out)).train
    assert (train.decay, train.lr, train.min_lr) == ("linear", 0.001, 0.0)
    assert (train.warmup_steps, train.steps) == (100, 1000)
    schedule = WarmupCosine(train.lr, train.warmup_steps, train.steps, train.min_lr, train.decay)
    # DeepSpeed's WarmupDecayLR after warmup: max_lr × (total - step) / (total - warmup)
    for step in (100, 250, 550, 999):
        assert schedule(step) == pytest.approx(0.001 * (1000 - step) / 900)


def test_set_and_steps_override_the_translation_and_are_said(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(WARMUP_DECAY))
    out = tmp_path / "recipe.toml"
    args = ["recipe", "from-deepspeed", str(path), "--out", str(out), "--steps", "20"]
    sets = ["--set", "mesh.tp=2", "--set", "train.seq_len=32", "--set", "data.source=synthetic"]
    assert main([*args, *sets]) == 0
    recipe = load_recipe(str(out))
    assert (recipe.train.steps, recipe.train.seq_len, recipe.data.source) == (20, 32, "synthetic")
    assert recipe.train.warmup_steps == 100  # longer than the run: the rate ramps it all
    assert recipe.raw["mesh"] == {"dp": -1, "tp": 2}
    text = out.read_text()
    assert "# set on the command line: mesh.tp, train.seq_len, data.source, train.steps" in text
    assert text.count("[mesh]") == 1
    assert main([*args, "--set", "train.no_such_key=1", "--out", str(tmp_path / "x.toml")]) == 2
    assert "no_such_key" in capsys.readouterr().err


CORPUS = Path(__file__).parent / "deepspeed_configs"


def _auto_keys(config: dict, prefix: str = "") -> list[str]:
    found = []
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            found += _auto_keys(value, name + ".")
        elif value == "auto":
            found.append(name)
    return found


@pytest.mark.slow
@pytest.mark.parametrize("path", sorted(CORPUS.glob("*.json")), ids=lambda path: path.stem)
def test_real_shaped_configs_translate_name_each_auto_and_pass_check(
    tmp_path: Path, path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """12 configs as people write them (Hugging Face's Trainer examples with "auto", DeepSpeed's
    documented schedules, fp16 with its loss-scaler keys, offload, Megatron-style batch keys):
    each translates, every "auto" is named with the recipe value it took (tuning knobs apart),
    and the translated plan trains like one device under ``meshtrain check``."""
    out = tmp_path / f"{path.stem}.toml"
    argv = ["recipe", "from-deepspeed", str(path), "--model", "debug", "--steps", "2"]
    assert main([*argv, "--out", str(out)]) == 0
    said = capsys.readouterr().out
    config = json.loads(path.read_text())
    autos = [k for k in _auto_keys(config) if not k.startswith("zero_optimization.")]
    for key in autos:
        assert f'  {key} = "auto" → ' in said, (key, said)
    assert said.count(" → ") == len(autos)
    header = out.read_text().split("\n[model]")[0]
    assert all(f'#   {key} = "auto" → ' in header for key in autos)
    assert main(["check", str(out), "--world", "2", "--steps", "2"]) == 0


def test_a_micro_batch_without_a_global_batch_is_said_not_kept_and_other_autos_refused() -> None:
    from meshtrain.recipes import recipe_from_toml

    translation = translate_deepspeed({"train_micro_batch_size_per_gpu": 4})
    (line,) = translation.resolve(recipe_from_toml(translation.toml("ds.json")))
    assert line.startswith("train_micro_batch_size_per_gpu = 4 → not kept: a recipe fixes the")
    assert "set train.batch_size = 4 × data ranks × parallel.microbatches" in line
    with pytest.raises(
        DeepSpeedConfigError, match=r'zero_optimization\.stage = "auto" \(no recipe'
    ):
        translate_deepspeed({"zero_optimization": {"stage": "auto"}})
