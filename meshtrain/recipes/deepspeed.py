"""A DeepSpeed ``ds_config.json`` translated into a meshtrain recipe, key by key, or refused.

Why: a team moving from DeepSpeed has a config whose every key means something to training.
:func:`translate_deepspeed` maps each key it knows to the recipe key with the same meaning
(ZeRO stage → ``parallel.zero`` over an FSDP ``dp`` axis, offload → ``parallel.offload`` /
``offload_optimizer``, bf16/fp16 → ``parallel.precision``, fp16's loss-scaler settings →
``train.loss_scale``, ``initial_loss_scale``, ``loss_scale_window``, ``loss_scale_hysteresis``,
``min_loss_scale``, gradient accumulation →
``parallel.microbatches``, clipping → ``train.max_norm``, the optimizer and scheduler sections →
``[train]``), and sorts the rest into three kinds, all of them listed, none dropped silently:

- **left to the recipe**: values ``"auto"`` (Hugging Face's Trainer fills them from its own
  arguments; here the recipe key of the same meaning does, its default or ``--set``, and
  :meth:`Translation.resolve` names each value it took — :data:`AUTO_FROM_RECIPE`; an ``"auto"``
  with no such key is refused by name);
- **tuning knobs**: buffer and bucket sizes, overlap and pinning switches that change speed or
  memory but not the numbers a step computes (FSDP2 decides these per module);
- **refused**: anything else — an unknown key, a value meshtrain cannot reproduce (the OneCycle
  schedule's momentum cycle, consecutive hysteresis in the loss scaler) — raises
  :class:`DeepSpeedConfigError` naming every such key and why (``meshtrain recipe
  from-deepspeed`` exits 2).

Schedules: ``WarmupLR`` (a constant rate after warmup), ``WarmupDecayLR`` (``train.decay =
"linear"``, to 0 at ``total_num_steps``) and ``WarmupCosineLR``. :meth:`Translation.override`
applies the command's ``--set`` (and ``--steps``) on top, as a recipe's ``--set`` does.

Example:
    >>> result = translate_deepspeed({"zero_optimization": {"stage": 2},
    ...                               "gradient_clipping": 1.0}, model="debug")
    >>> result.settings["parallel.zero"], result.settings["train.max_norm"]
    (2, 1.0)
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeGuard

from meshtrain.errors import DeepSpeedConfigError
from meshtrain.tables import flatten_table, toml_value

if TYPE_CHECKING:
    from meshtrain.recipes.recipe import Recipe

#: the optimizer's and scheduler's ``params`` stay together under their section
_WHOLE_TABLES = ("optimizer.params", "scheduler.params")

__all__ = ["DeepSpeedConfigError", "Translation", "read_deepspeed", "translate_deepspeed"]

#: Keys that tune speed or memory, never the numbers a step computes.
TUNING_KEYS = frozenset(
    {
        "zero_optimization.overlap_comm",
        "zero_optimization.contiguous_gradients",
        "zero_optimization.reduce_bucket_size",
        "zero_optimization.allgather_bucket_size",
        "zero_optimization.allgather_partitions",
        "zero_optimization.reduce_scatter",
        "zero_optimization.sub_group_size",
        "zero_optimization.round_robin_gradients",
        "zero_optimization.stage3_prefetch_bucket_size",
        "zero_optimization.stage3_param_persistence_threshold",
        "zero_optimization.stage3_max_live_parameters",
        "zero_optimization.stage3_max_reuse_distance",
        "zero_optimization.stage3_gather_16bit_weights_on_model_save",
        "zero_optimization.offload_optimizer.pin_memory",
        "zero_optimization.offload_param.pin_memory",
        "zero_optimization.offload_optimizer.buffer_count",
        "zero_optimization.offload_param.buffer_count",
        "zero_optimization.offload_param.buffer_size",
        "zero_optimization.offload_param.max_in_cpu",
        "zero_optimization.offload_optimizer.fast_init",
        "zero_allow_untested_optimizer",
        "wall_clock_breakdown",
        "communication_data_type",
    }
)
#: DeepSpeed's fp16 loss-scaler keys → the ``[train]`` key :class:`meshtrain.train.scaler.LossScaler`
#: honours it by, and how the value converts (``None``: refused).
SCALER: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "loss_scale": ("train.loss_scale", lambda v: float(v) if _number(v) and v >= 0 else None),
    "initial_scale_power": (
        "train.initial_loss_scale",
        lambda v: 2.0**v if _integer(v) and 0 <= v < 128 else None,
    ),
    "loss_scale_window": (
        "train.loss_scale_window",
        lambda v: v if _integer(v) and v > 0 else None,
    ),
    "hysteresis": ("train.loss_scale_hysteresis", lambda v: v if _integer(v) and v > 0 else None),
    "min_loss_scale": (
        "train.min_loss_scale",
        lambda v: float(v) if _number(v) and v >= 0 else None,
    ),
}
_OPTIMIZERS = {"adamw": "adamw", "adam": "adam", "sgd": "sgd"}

#: DeepSpeed keys whose ``"auto"`` the recipe fills (as Hugging Face's Trainer fills them from its
#: arguments), and the recipe key it fills each from ("" for a value meshtrain fixes).
AUTO_FROM_RECIPE = {
    "train_batch_size": "train.batch_size",
    "train_micro_batch_size_per_gpu": "train.batch_size",
    "gradient_accumulation_steps": "parallel.microbatches",
    "gradient_clipping": "train.max_norm",
    "optimizer.params.lr": "train.lr",
    "optimizer.params.betas": "train.betas",
    "optimizer.params.eps": "train.eps",
    "optimizer.params.weight_decay": "train.weight_decay",
    "scheduler.params.warmup_max_lr": "train.lr",
    "scheduler.params.warmup_num_steps": "train.warmup_steps",
    "scheduler.params.total_num_steps": "train.steps",
    "scheduler.params.warmup_min_lr": "",
    "bf16.enabled": "parallel.precision",
    "fp16.enabled": "parallel.precision",
}


@dataclass
class Translation:
    """The recipe keys a config maps to, and every key it left to the recipe or ignored."""

    settings: dict[str, Any] = field(default_factory=dict)
    auto: list[str] = field(default_factory=list)
    tuning: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)
    inactive: list[str] = field(default_factory=list)
    model: str = "debug"
    overridden: list[str] = field(default_factory=list)  # keys set on the command line
    resolved: list[str] = field(default_factory=list)  # each "auto" with the value it took
    micro_batch: int | None = None  # train_micro_batch_size_per_gpu given without a global batch

    def resolve(self, recipe: Recipe) -> list[str]:
        """Each ``"auto"`` key with the recipe value it takes (``recipe``: the
        :class:`~meshtrain.recipes.recipe.Recipe` the translation makes); kept in
        :attr:`resolved` for the recipe's header.

        Example:
            >>> from meshtrain.recipes import recipe_from_toml
            >>> out = translate_deepspeed({"gradient_clipping": "auto"})
            >>> out.resolve(recipe_from_toml(out.toml("ds.json")))
            ['gradient_clipping = "auto" → train.max_norm = 1.0']
        """
        self.resolved = [_resolution(key, recipe, self.micro_batch) for key in self.auto]
        return self.resolved

    def override(self, overrides: Sequence[str], source: str) -> None:
        """Apply ``section.key=value`` overrides to the translated settings (read as a recipe's
        ``--set`` reads them; the keys are checked with the recipe)."""
        from meshtrain.recipes.source import apply_overrides

        nested: dict[str, Any] = {}
        for key, value in self.settings.items():
            *sections, name = key.split(".")
            table = nested
            for section in sections:
                table = table.setdefault(section, {})
            table[name] = value
        self.settings = flatten_table(apply_overrides(nested, overrides, source))
        self.overridden = [item.partition("=")[0] for item in overrides]

    def toml(self, source: str) -> str:
        """The recipe as TOML, with the keys left to defaults or ignored as comments."""
        lines = [f"# Translated from {source} by meshtrain recipe from-deepspeed."]
        if self.resolved:
            lines.append('# "auto", filled from this recipe:')
            lines += [f"#   {line}" for line in self.resolved]
        elif self.auto:
            lines.append(f'# "auto" (filled from this recipe): {", ".join(self.auto)}')
        if self.tuning:
            lines.append(f"# tuning knobs (no effect on the numbers): {', '.join(self.tuning)}")
        if self.inactive:
            lines.append(f"# inactive (fp16 is not enabled): {', '.join(self.inactive)}")
        if self.overridden:
            lines.append(f"# set on the command line: {', '.join(self.overridden)}")
        lines += ["", "[model]"]
        model_path = Path(self.model)
        if model_path.is_dir():
            lines.append(f"hf = {toml_value(str(model_path))}")
        else:
            lines += ['name = "llama"', f"preset = {toml_value(self.model)}"]
        mesh = {"dp": -1, **{k[5:]: v for k, v in self.settings.items() if k.startswith("mesh.")}}
        lines += ["", "[mesh]", *(f"{axis} = {toml_value(size)}" for axis, size in mesh.items())]
        sections: dict[str, list[str]] = {}
        for key, value in sorted(self.settings.items()):
            if key.startswith("mesh."):
                continue
            section, name = key.rsplit(".", 1)
            sections.setdefault(section, []).append(f"{name} = {toml_value(value)}")
        for section, entries in sections.items():
            lines += ["", f"[{section}]", *entries]
        return "\n".join(lines) + "\n"


def read_deepspeed(path: str | Path) -> dict[str, Any]:
    """The JSON object in ``path`` (a :class:`DeepSpeedConfigError` naming the file if not)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise DeepSpeedConfigError(f"{path}: not a readable JSON file ({err}).") from None
    if not isinstance(data, dict):
        raise DeepSpeedConfigError(f"{path}: a DeepSpeed config is a JSON object.")
    return data


def translate_deepspeed(config: Mapping[str, Any], *, model: str = "debug") -> Translation:
    """Map every key of ``config`` (see the module docstring); raise on any refused key."""
    out = Translation(model=model)
    out.settings["parallel.fsdp"] = ["dp"]
    for key, value in flatten_table(config, keep=_WHOLE_TABLES).items():
        if key in TUNING_KEYS:
            out.tuning.append(key)
        elif value == "auto" and key in AUTO_FROM_RECIPE:
            out.auto.append(key)
        elif value == "auto":
            out.refused.append(
                f'{key} = "auto" (no recipe key fills it: give its value; "auto" is filled for '
                f"{', '.join(sorted(AUTO_FROM_RECIPE))})"
            )
        else:
            _map_key(out, key, value, config)
    _check_batch(out, config)
    if out.refused:
        raise DeepSpeedConfigError(
            f"{len(out.refused)} DeepSpeed key(s) cannot be translated: "
            + "; ".join(out.refused)
            + ". Fix or remove them, or set what they mean in the recipe."
        )
    return out


def _map_key(out: Translation, key: str, value: object, config: Mapping[str, Any]) -> None:
    handler = _HANDLERS.get(key)
    if handler is None and key.startswith("fp16."):
        handler = _fp16_scaler
    if handler is None:
        out.refused.append(f"{key} (unknown to meshtrain)")
        return
    problem = handler(out, key, value, config)
    if problem:
        out.refused.append(f"{key} = {json.dumps(value)} ({problem})")


def _zero_stage(out: Translation, key: str, value: object, _: object) -> str:
    if value not in (0, 1, 2, 3):
        return "stages are 0, 1, 2 and 3"
    out.settings["parallel.zero"] = value
    return ""


def _offload(out: Translation, key: str, value: object, _: object) -> str:
    if value not in ("cpu", "none"):
        return "meshtrain offloads to CPU memory only (no NVMe)"
    if value == "cpu":
        which = "parallel.offload_optimizer" if "offload_optimizer" in key else "parallel.offload"
        out.settings[which] = True
    return ""


def _precision(out: Translation, key: str, value: object, _: object) -> str:
    if not isinstance(value, bool):
        return 'true, false or "auto"'
    if value:
        wanted = "bf16" if key.startswith("bf16") else "fp16"
        if out.settings.get("parallel.precision", wanted) != wanted:
            return "bf16 and fp16 are both enabled"
        out.settings["parallel.precision"] = wanted
    return ""


def _fp16_scaler(out: Translation, key: str, value: object, config: Mapping[str, Any]) -> str:
    name = key.split(".", 1)[1]
    if name == "consecutive_hysteresis":
        return "" if value is False else "meshtrain refills hysteresis only when the scale grows"
    if name not in SCALER:
        return "not a loss-scaler setting meshtrain knows"
    if config.get("fp16", {}).get("enabled") is False:
        out.inactive.append(key)  # the loss scaler runs only under fp16
        return ""
    target, convert = SCALER[name]
    converted = convert(value)
    if converted is None:
        return "not a valid value for DeepSpeed's loss scaler"
    if not (name == "loss_scale" and converted == 0):  # 0: dynamic, the recipe's default
        out.settings[target] = converted
    return ""


def _number(value: object) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _integer(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _setting(target: str, check: Callable[[object], bool], what: str) -> Callable[..., str]:
    def handler(out: Translation, key: str, value: object, _: object) -> str:
        if not check(value):
            return what
        out.settings[target] = value
        return ""

    return handler


def _optimizer_type(out: Translation, key: str, value: object, config: Mapping[str, Any]) -> str:
    name = str(value).lower()
    if name not in _OPTIMIZERS:
        return f"meshtrain's optimizers are {', '.join(sorted(_OPTIMIZERS))}"
    params = config.get("optimizer", {}).get("params", {})
    if name == "adam" and params.get("adam_w_mode", True) is True:
        name = "adamw"  # DeepSpeed's Adam decouples weight decay (adam_w_mode) unless told not to
    out.settings["train.optimizer"] = _OPTIMIZERS[name]
    return ""


def _optimizer_param(out: Translation, key: str, value: object, config: Mapping[str, Any]) -> str:
    name = key.rsplit(".", 1)[1]
    if name == "torch_adam" or name == "adam_w_mode":
        return "" if value in (True, False) else "a boolean"
    targets: dict[str, tuple[str, Callable[[object], bool], str]] = {
        "lr": ("train.lr", _positive_number, "a positive finite number"),
        "eps": ("train.eps", _positive_number, "a positive finite number"),
        "weight_decay": ("train.weight_decay", _nonnegative_number, "a finite number ≥ 0"),
        "betas": ("train.betas", _betas, "two numbers in [0, 1), e.g. [0.9, 0.999]"),
    }
    if name == "momentum" and value == 0:
        return ""
    if name not in targets:
        return "meshtrain's optimizers take lr, betas, eps and weight_decay"
    target, check, what = targets[name]
    if not check(value):
        return what
    out.settings[target] = list(value) if isinstance(value, list) else value
    return ""


def _positive_number(value: object) -> TypeGuard[int | float]:
    return _number(value) and value > 0


def _nonnegative_number(value: object) -> TypeGuard[int | float]:
    return _number(value) and value >= 0


def _betas(value: object) -> bool:
    return isinstance(value, list) and len(value) == 2 and all(_unit(beta) for beta in value)


def _unit(value: object) -> TypeGuard[int | float]:
    return _number(value) and 0 <= value < 1


def _scheduler_type(out: Translation, key: str, value: object, config: Mapping[str, Any]) -> str:
    if value not in ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR"):
        return "meshtrain's schedule is a linear warmup then a constant rate, or a linear or cosine decay"
    if value == "WarmupDecayLR":
        out.settings["train.decay"] = "linear"  # down to 0 at total_num_steps
    return ""


def _scheduler_param(out: Translation, key: str, value: object, config: Mapping[str, Any]) -> str:
    name = key.rsplit(".", 1)[1]
    kind = config.get("scheduler", {}).get("type")
    if name in ("warmup_min_lr", "warmup_min_ratio"):
        return "" if value == 0 else "meshtrain's warmup starts from 0"
    if name == "warmup_type":
        return "" if value == "linear" else "meshtrain's warmup is linear"
    if name in ("warmup_num_steps", "total_num_steps") and not (
        _integer(value) and value >= (0 if name == "warmup_num_steps" else 1)
    ):
        return "a whole number of steps" + (" ≥ 0" if name == "warmup_num_steps" else " ≥ 1")
    if name in ("warmup_max_lr", "cos_min_ratio") and not (
        _positive_number(value) if name == "warmup_max_lr" else _unit(value)
    ):
        return "a positive finite number" if name == "warmup_max_lr" else "a number in [0, 1)"
    if name == "warmup_num_steps":
        out.settings["train.warmup_steps"] = value
    elif name == "total_num_steps":
        out.settings["train.steps"] = value
    elif name == "warmup_max_lr":
        out.settings["train.lr"] = value
        if kind == "WarmupLR":
            out.settings["train.min_lr"] = value  # constant after warmup
    elif name == "cos_min_ratio" and kind == "WarmupCosineLR":
        lr = config.get("optimizer", {}).get("params", {}).get("lr")
        if not isinstance(lr, int | float) or not _unit(value):
            return "needs optimizer.params.lr to set train.min_lr"
        out.settings["train.min_lr"] = lr * value
    else:
        return f"not a parameter of {kind}"
    return ""


def _check_batch(out: Translation, config: Mapping[str, Any]) -> None:
    """``train_batch_size`` is the global batch; with only the micro-batch size per GPU the
    global batch depends on the world, which a recipe does not fix (``--set`` it)."""
    micro = config.get("train_micro_batch_size_per_gpu")
    batch = config.get("train_batch_size")
    steps = config.get("gradient_accumulation_steps")
    if isinstance(batch, int) and isinstance(steps, int) and batch % steps:
        out.refused.append(
            f"train_batch_size = {batch} (not a multiple of gradient_accumulation_steps = {steps})"
        )
    if isinstance(micro, int) and not isinstance(batch, int):
        out.auto.append("train_micro_batch_size_per_gpu")  # the global batch is the recipe's
        out.micro_batch = micro


def _resolution(key: str, recipe: Recipe, micro_batch: int | None = None) -> str:
    """One ``"auto"`` key and the value it takes from ``recipe`` (see :data:`AUTO_FROM_RECIPE`);
    ``micro_batch``: the per-GPU batch given without a global one (a recipe fixes the global)."""
    target = AUTO_FROM_RECIPE[key]
    if not target:
        return f'{key} = "auto" → 0 (meshtrain\'s warmup starts from 0)'
    section, name = target.split(".")
    value = getattr(getattr(recipe, section), name)
    shown = json.dumps(list(value) if isinstance(value, tuple) else value)
    if key == "train_micro_batch_size_per_gpu" and micro_batch is not None:
        return (
            f"{key} = {micro_batch} → not kept: a recipe fixes the global batch, {target} = "
            f"{shown} sequences; for {micro_batch} per data-parallel rank set {target} = "
            f"{micro_batch} × data ranks × parallel.microbatches"
        )
    if key == "train_micro_batch_size_per_gpu":
        return (
            f'{key} = "auto" → {target} = {shown} sequences a step in all (each data-parallel '
            "rank's share: that ÷ its data ranks ÷ parallel.microbatches)"
        )
    return f'{key} = "auto" → {target} = {shown}'


def _positive_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _micro_batch(out: Translation, key: str, value: object, _: object) -> str:
    return "" if _positive_int(value) else "a positive integer"


# fmt: off
_HANDLERS: dict[str, Callable[[Translation, str, object, Mapping[str, Any]], str]] = {
    "zero_optimization.stage": _zero_stage,
    "zero_optimization.offload_optimizer.device": _offload,
    "zero_optimization.offload_param.device": _offload,
    "bf16.enabled": _precision,
    "fp16.enabled": _precision,
    "train_batch_size": _setting("train.batch_size", _positive_int, "a positive integer"),
    "train_micro_batch_size_per_gpu": _micro_batch,
    "gradient_accumulation_steps": _setting(
        "parallel.microbatches", _positive_int, "a positive integer"
    ),
    "gradient_clipping": _setting("train.max_norm", _positive_number, "a positive number"),
    "steps_per_print": _setting("logging.log_every", _positive_int, "a positive integer"),
    "optimizer.type": _optimizer_type,
    "scheduler.type": _scheduler_type,
    **{f"optimizer.params.{name}": _optimizer_param
       for name in ("lr", "betas", "eps", "weight_decay", "momentum", "torch_adam", "adam_w_mode")},
    **{f"scheduler.params.{name}": _scheduler_param
       for name in ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "total_num_steps",
                    "warmup_type", "warmup_min_ratio", "cos_min_ratio")},
}
# fmt: on
