"""What a recipe file may contain, and the checks that turn a bad one into a clear RecipeError.

Every message names the file, the ``section.key``, the value, what is allowed and how to fix it.
The key tables in :data:`SECTIONS` and the section dataclasses are the whole schema: a new section
is one more key table and dataclass here and one more field of :class:`meshtrain.recipes.Recipe`.

Example:
    >>> check_table("r.toml", "train", {"steps": "3"})
    Traceback (most recent call last):
    ...
    meshtrain.errors.RecipeError: r.toml: train.steps = "3" is a string, but steps must be a positive integer. Write e.g. steps = 3.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from meshtrain.errors import MeshtrainError, RecipeError, did_you_mean
from meshtrain.models.llama import LlamaConfig
from meshtrain.plan.pipeline import SCHEDULES
from meshtrain.recipes.source import find_recipe as find_recipe  # re-exported
from meshtrain.spec.partition import P

PRESETS = ("debug", "llama3_8b", "llama3_70b", "llama3_405b")
OPTIMIZERS = ("sgd", "adam", "adamw")
DATA_SOURCES = ("corpus", "synthetic", "tokens")
_AXIS = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_KINDS = {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
          list: "an array", dict: "a table"}  # fmt: skip
_SPEC_FIX = "Write a spec like \"P('tp', None)\": entries None, 'axis' or ('axis1', 'axis2')."


@dataclass(frozen=True)
class Key:
    """What one key accepts: Python types as tomllib reads them, an example, allowed values."""

    kinds: tuple[type, ...]
    example: Any
    choices: tuple[Any, ...] = ()
    positive: bool = False
    nonnegative: bool = False
    items: tuple[type, ...] = (str,)  # what an array's items are
    length: int | None = None  # an array's required length

    def describe(self) -> str:
        if self.choices:
            return "one of " + ", ".join(toml_value(choice) for choice in self.choices)
        if self.kinds == (list,) and self.items != (str,):
            return f"an array of {self.length} numbers, each in [0, 1)"
        if self.kinds == (list,):
            return "a non-empty array of strings" if self.positive else "an array of strings"
        what = _KINDS[float if float in self.kinds else self.kinds[0]]
        if self.nonnegative:
            return f"a non-negative {what.split()[-1]} (0 or more)"
        return f"a positive {what.split()[-1]}" if self.positive else what


def _positive(example: Any, *kinds: type) -> Key:
    return Key(kinds or (int,), example, positive=True)


def _nonnegative(example: Any, *kinds: type) -> Key:
    return Key(kinds or (int,), example, nonnegative=True)


_LLAMA_KEYS = {
    f.name: _positive(2) if f.type == "int" else _positive(1.0, int, float)
    for f in dataclasses.fields(LlamaConfig)
}

#: Section → key → what it accepts. ``mesh`` (axis = size) and ``rules`` (regex = spec string)
#: have free-form keys and their own checks.
SECTIONS: dict[str, dict[str, Key]] = {
    "model": {
        "name": Key((str,), "llama", ("llama",)),
        "preset": Key((str,), "debug", PRESETS),
        "factory": Key((str,), "my_models:tiny_cnn"),
        "hf": Key((str,), "models/tiny-llama"),
        "meta_init": Key((bool,), False),
        **_LLAMA_KEYS,
    },
    "mesh": {},
    "parallel": {
        "zero": Key((int,), 3, (0, 1, 2, 3)),
        "fsdp": Key((list,), ["dp"]),
        "tp": Key((str,), "tp"),
        "sequence_parallel": Key((bool,), True),
        "activation_checkpointing": Key((str,), "selective", ("none", "full", "selective")),
        "compile": Key((bool,), True),
        "precision": Key((str,), "bf16", ("fp32", "bf16", "fp16")),
        "microbatches": _positive(2),
        "pipeline": Key((dict,), {}),
        "offload": Key((bool,), True),
        "offload_optimizer": Key((bool,), True),
    },
    "parallel.pipeline": {
        "axis": Key((str,), "pp"),
        "schedule": Key((str,), "1F1B", SCHEDULES),
        "microbatches": _positive(8),
        "stages_per_rank": _positive(2),
    },
    "rules": {},
    "train": {
        "batch_size": _positive(8),
        "seq_len": _positive(16),
        "optimizer": Key((str,), "adamw", OPTIMIZERS),
        "lr": _positive(1e-3, int, float),
        "min_lr": _nonnegative(1e-4, int, float),
        "warmup_steps": _nonnegative(10),
        "steps": _positive(3),
        "weight_decay": _nonnegative(0.1, int, float),
        "betas": Key((list,), [0.9, 0.95], items=(int, float), length=2),
        "eps": _positive(1e-8, int, float),
        "max_norm": _positive(1.0, int, float),
        "seed": _nonnegative(0),
        "on_nonfinite": Key((str,), "skip", ("skip", "stop")),
        "max_consecutive_skips": _positive(10),
        "max_total_skips": _nonnegative(100),
    },
    "lora": {
        "rank": _positive(8),
        "alpha": _positive(16, int, float),
        "targets": Key((list,), [r"layers\.\d+\.attention\.w[qkvo]"], positive=True),
        "quantize_base": Key((str,), "nf4", ("nf4",)),
    },
    "data": {
        "source": Key((str,), "corpus", DATA_SOURCES),
        "path": Key((str,), "data/tokens"),
        "tokenizer": Key((str,), "byte"),
        "corpus_bytes": _positive(4_000_000),
        "samples": _positive(4096),
        "shuffle": Key((bool,), True),
        "seed": _nonnegative(0),
    },
    "checkpoint": {
        "dir": Key((str,), "runs/debug/checkpoints"),
        "interval": _nonnegative(100),
        "keep_last": _nonnegative(3),
        "async": Key((bool,), False),
        "resume": Key((bool,), True),
        "init_from": Key((str,), "model.safetensors"),
        "export": Key((str,), "runs/debug/model.safetensors"),
    },
    "logging": {
        "run_dir": Key((str,), "runs/debug"),
        "console": Key((bool,), True),
        "jsonl": Key((bool,), True),
        "wandb": Key((str,), "offline", ("offline", "online", "disabled")),
        "wandb_project": Key((str,), "meshtrain"),
        "wandb_entity": Key((str,), "my-team"),
        "log_every": _positive(10),
    },
}
TOP_SECTIONS = tuple(name for name in SECTIONS if "." not in name)


@dataclass(frozen=True)
class ModelSection:
    """``[model]``: meshtrain's Llama (``preset`` and config overrides), a ``factory``
    (``"package.module:function"``) or a local Hugging Face directory (``hf``). ``config`` is the
    Llama's (None for the others)."""

    name: str
    preset: str
    config: LlamaConfig | None
    factory: str = ""
    hf: str = ""
    meta_init: bool = True  # start on the meta device: each rank allocates only its shards

    @property
    def kind(self) -> str:
        """'llama', 'factory' or 'hf'."""
        return "factory" if self.factory else "hf" if self.hf else "llama"


@dataclass(frozen=True)
class PipelineSection:
    """``[parallel.pipeline]``: the arguments of :class:`~meshtrain.Pipeline`."""

    axis: str = "pp"
    schedule: str = "1F1B"
    microbatches: int | None = None
    stages_per_rank: int = 1


@dataclass(frozen=True)
class ParallelSection:
    """``[parallel]``: data-parallel stage and axes, tensor/sequence/pipeline parallelism, compute."""

    zero: int = 3
    fsdp: tuple[str, ...] = ("dp",)
    tp: str = "tp"
    sequence_parallel: bool = False
    activation_checkpointing: str = "none"
    compile: bool = False
    precision: str = "fp32"
    microbatches: int = 1
    pipeline: PipelineSection | None = None
    offload: bool = False
    offload_optimizer: bool = False


@dataclass(frozen=True)
class TrainSection:
    """``[train]``: global sequences per step, tokens per sequence, optimizer and its schedule
    (linear warmup over ``warmup_steps``, cosine to ``min_lr`` at ``steps``), clipping, seed,
    what a non-finite loss does (``skip`` its update or ``stop``) and how many skipped steps end
    the run (``max_consecutive_skips`` in a row, ``max_total_skips`` in all; 0: no bound)."""

    batch_size: int = 8
    seq_len: int = 16
    optimizer: str = "adamw"
    lr: float = 1e-3
    min_lr: float = 0.0
    warmup_steps: int = 0
    steps: int = 3
    weight_decay: float = 0.1
    max_norm: float = 1.0
    seed: int = 0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    on_nonfinite: str = "skip"
    max_consecutive_skips: int = 10
    max_total_skips: int = 100


@dataclass(frozen=True)
class LoRASection:
    """``[lora]``: adapters of ``rank`` with scale ``alpha / rank`` on the Linears whose FQNs
    fully match one of ``targets`` (regexes), every other parameter frozen; ``quantize_base =
    "nf4"`` stores the adapted base weights in 4-bit NF4 (QLoRA)."""

    rank: int = 8
    alpha: float = 16.0
    targets: tuple[str, ...] = ()
    quantize_base: str = ""


@dataclass(frozen=True)
class DataSection:
    """``[data]``: ``corpus`` (the Python standard library's docstrings, tokenized locally into
    ``path`` on first use), ``tokens`` (a prepared token directory at ``path``) or ``synthetic``
    (``samples`` random sequences); the tokenizer; shuffling and its seed."""

    source: str = "corpus"
    path: str = "data/corpus"
    tokenizer: str = "byte"
    corpus_bytes: int | None = None
    samples: int = 4096
    shuffle: bool = True
    seed: int = 0


@dataclass(frozen=True)
class CheckpointSection:
    """``[checkpoint]``: where and how often to save (``interval`` 0: only at the end), how many
    to keep (0: all), async saving, resuming from the latest one in ``dir``, a safetensors file
    to start from and one to export the final model to."""

    dir: str = ""
    interval: int = 0
    keep_last: int = 3
    async_save: bool = False
    resume: bool = True
    init_from: str = ""
    export: str = ""


@dataclass(frozen=True)
class LoggingSection:
    """``[logging]``: the run directory (metrics.jsonl, plan files, wandb's offline run), the
    console progress bar, the JSONL file, wandb's mode and project, and how often to log."""

    run_dir: str = ""
    console: bool = True
    jsonl: bool = True
    wandb: str = "offline"
    wandb_project: str = "meshtrain"
    wandb_entity: str = ""
    log_every: int = 1


def check_sections(source: str, data: Mapping[str, Any]) -> None:
    """Only known top-level sections, each a table; ``[model]`` and ``[mesh]`` present."""
    for name, table in data.items():
        if name not in TOP_SECTIONS:
            raise RecipeError(
                f"{source}: unknown section [{name}]"
                f"{did_you_mean(name, TOP_SECTIONS, 'sections')}. Remove it or rename it."
            )
        if not isinstance(table, dict):
            raise RecipeError(
                f"{source}: {name} = {toml_value(table)} is {_kind(table)}, but [{name}] must be "
                f"a table. Write it as a section: [{name}] followed by key = value lines."
            )
    for required in ("model", "mesh"):
        if required not in data:
            raise RecipeError(f"{source}: missing section [{required}]; every recipe needs one.")


def check_table(source: str, section: str, table: Mapping[str, Any]) -> dict[str, Any]:
    """The section's values, each checked against :data:`SECTIONS` (numbers become floats where
    a float is wanted)."""
    keys = SECTIONS[section]
    values: dict[str, Any] = {}
    for key, value in table.items():
        spec = keys.get(key)
        where = f"{source}: {section}.{key} = {toml_value(value)}"
        if spec is None:
            raise RecipeError(
                f"{source}: unknown key {section}.{key} = {toml_value(value)}"
                f"{did_you_mean(key, list(keys), f'keys of [{section}]')}. Remove it or use one "
                "of those keys."
            )
        example = f"Write e.g. {key} = {toml_value(spec.example)}."
        wrong_type = type(value) not in spec.kinds or (
            spec.kinds == (list,) and not all(type(item) in spec.items for item in value)
        )
        if wrong_type:
            raise RecipeError(
                f"{where} is {_kind(value)}, but {key} must be {spec.describe()}. {example}"
            )
        if isinstance(value, float) and not math.isfinite(value):
            raise RecipeError(
                f"{where} is not a finite number; {key} must be {spec.describe()}. {example}"
            )
        if spec.choices and value not in spec.choices:
            raise RecipeError(f"{where} is not allowed; {key} must be {spec.describe()}. {example}")
        if isinstance(value, list):
            _check_array(where, key, spec, value, example)
        elif (spec.positive and value <= 0) or (spec.nonnegative and value < 0):
            raise RecipeError(
                f"{where} is out of range; {key} must be {spec.describe()}. {example}"
            )
        if isinstance(value, list) and float in spec.items:
            value = tuple(float(item) for item in value)
        values[key] = float(value) if float in spec.kinds else value
    return values


def _check_array(where: str, key: str, spec: Key, value: list[Any], example: str) -> None:
    """An array's length (non-empty when ``positive``) and, for numbers, each in [0, 1)."""
    wrong_length = spec.length is not None and len(value) != spec.length
    if wrong_length or (spec.positive and not value):
        raise RecipeError(
            f"{where} has {len(value)} items; {key} must be {spec.describe()}. {example}"
        )
    if float in spec.items and not all(math.isfinite(v) and 0 <= v < 1 for v in value):
        raise RecipeError(f"{where} is out of range; {key} must be {spec.describe()}. {example}")


def lora_section(source: str, table: dict[str, Any]) -> LoRASection:
    """``[lora]``: ``targets`` required, each a valid regex."""
    values = check_table(source, "lora", table)
    if "targets" not in values:
        raise RecipeError(
            f"{source}: [lora] has no targets; give the Linear modules to adapt as regexes that "
            "fully match their FQNs, e.g. targets = ['layers\\.\\d+\\.attention\\.w[qkvo]']."
        )
    for pattern in values["targets"]:
        try:
            re.compile(pattern)
        except re.error as err:
            raise RecipeError(
                f"{source}: lora.targets = {toml_value(values['targets'])}: {pattern!r} is not a "
                f"valid regex ({err}). Fix the pattern."
            ) from None
    values["targets"] = tuple(values["targets"])
    return LoRASection(**values)


def check_mesh(source: str, table: Mapping[str, Any]) -> tuple[tuple[str, int], ...]:
    """``[mesh]``: identifier axes with positive sizes, at most one -1, in file order."""
    fix = "Write axis = size, e.g. dp = -1 and tp = 2, in the order of the mesh's dims."
    if not table:
        raise RecipeError(f"{source}: [mesh] is empty. {fix}")
    for axis, size in table.items():
        if not _AXIS.fullmatch(axis):
            raise RecipeError(f"{source}: mesh.{axis}: the axis name is not an identifier. {fix}")
        if type(size) is not int or (size < 1 and size != -1):
            raise RecipeError(
                f"{source}: mesh.{axis} = {toml_value(size)} is {_kind(size)}, but mesh sizes "
                f"must be positive integers or -1. {fix}"
            )
    free = [axis for axis, size in table.items() if size == -1]
    if len(free) > 1:
        raise RecipeError(
            f"{source}: [mesh] has -1 on several axes {free}; only one axis can take the "
            "remaining ranks. Give the others explicit sizes."
        )
    return tuple(table.items())


def check_axis_jobs(source: str, jobs: list[tuple[str, str]], mesh: Mapping[str, int]) -> None:
    """Each ``(key, axis)`` names a mesh axis, and no axis has two jobs (data, tp, pipeline)."""
    seen: dict[str, str] = {}
    for key, axis in jobs:
        if axis not in mesh:
            raise RecipeError(
                f"{source}: {key} names axis '{axis}', which [mesh] does not have"
                f"{did_you_mean(axis, list(mesh), 'axes')}. Add it to [mesh] or name a mesh axis."
            )
        if axis in seen:
            raise RecipeError(
                f"{source}: axis '{axis}' has two jobs ({seen[axis]} and {key}); each mesh axis "
                "is a data, tensor-parallel or pipeline axis. Use separate axes."
            )
        seen[axis] = key


def model_section(source: str, table: dict[str, Any]) -> ModelSection:
    """``[model]``: the preset with its overrides, built (and so checked) as a LlamaConfig; or a
    factory or a Hugging Face directory, which take no Llama keys."""
    values = check_table(source, "model", table)
    factory, hf = values.pop("factory", ""), values.pop("hf", "")
    meta_init = values.pop("meta_init", True)
    if factory or hf:
        if (factory and hf) or values:
            given = ["factory"] * bool(factory) + ["hf"] * bool(hf) + sorted(values)
            raise RecipeError(
                f"{source}: [model] gives {given}: a recipe's model is one of a Llama preset "
                '(preset + its config keys), factory = "package.module:function", or hf = '
                '"DIR" — pick one.'
            )
        return ModelSection("factory" if factory else "hf", "", None, factory, hf, meta_init)
    name, preset = values.pop("name", "llama"), values.pop("preset", "debug")
    try:
        config = LlamaConfig.preset(preset, **values)
    except MeshtrainError as err:
        raise RecipeError(
            f"{source}: [model] preset {toml_value(preset)} with overrides {values}: {err.message}"
        ) from None
    return ModelSection(name, preset, config, meta_init=meta_init)


def parallel_section(source: str, table: dict[str, Any], mesh: dict[str, int]) -> ParallelSection:
    """``[parallel]``: tp defaults to "tp" and fsdp to ["dp"] when the mesh has those axes; every
    named axis must exist and have one job."""
    values = check_table(source, "parallel", table)
    pipe = None
    if "pipeline" in values:
        pipe = PipelineSection(**check_table(source, "parallel.pipeline", values.pop("pipeline")))
    values.setdefault("tp", "tp" if "tp" in mesh else "")
    values["fsdp"] = tuple(values.get("fsdp", ("dp",) if "dp" in mesh else ()))
    par = ParallelSection(**values, pipeline=pipe)
    jobs = [(f"parallel.fsdp = {toml_value(list(par.fsdp))}", axis) for axis in par.fsdp]
    jobs += [(f"parallel.tp = {toml_value(par.tp)}", par.tp)] if par.tp else []
    if pipe is not None:
        jobs.append((f"parallel.pipeline.axis = {toml_value(pipe.axis)}", pipe.axis))
        if par.microbatches not in (1, pipe.microbatches):
            raise RecipeError(
                f"{source}: parallel.microbatches = {par.microbatches} and "
                f"parallel.pipeline.microbatches = {toml_value(pipe.microbatches)} disagree; a "
                "pipeline accumulates over its own micro-batches. Set them in [parallel.pipeline]."
            )
    check_axis_jobs(source, jobs, mesh)
    if pipe is not None and mesh[pipe.axis] == 1:
        raise RecipeError(
            f"{source}: mesh.{pipe.axis} = 1, but [parallel.pipeline] lays its stages along "
            f"'{pipe.axis}'. Give it at least 2 ranks, or remove [parallel.pipeline]."
        )
    return par


def check_rules(source: str, table: Mapping[str, Any]) -> tuple[tuple[str, P], ...]:
    """``[rules]``: ordered ``regex = "P(...)"`` pairs."""
    rules = []
    for pattern, text in table.items():
        where = f"{source}: rules.{toml_value(pattern)}"
        if not isinstance(text, str):
            raise RecipeError(
                f"{where} = {toml_value(text)} is {_kind(text)}, but a rule's value must be a "
                "spec string. " + _SPEC_FIX
            )
        try:
            re.compile(pattern)
        except re.error as err:
            raise RecipeError(f"{where}: the key is not a valid regex ({err}).") from None
        rules.append((pattern, parse_spec(text, where=where)))
    return tuple(rules)


def parse_spec(text: str, *, where: str = "spec") -> P:
    """A ``P(...)`` spec string, never eval'd: the call's arguments are read with
    ``ast.literal_eval``; each must be None, an axis name or a tuple of axis names.

    Example:
        >>> parse_spec("P(('dp', 'tp'), None)")
        P(('dp', 'tp'), None)
    """
    shown = f"{where} = {toml_value(text)}"
    try:
        node = ast.parse(text.strip(), mode="eval").body
    except SyntaxError:
        raise RecipeError(f"{shown} is not P(...) syntax. {_SPEC_FIX}") from None
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "P"):
        raise RecipeError(f"{shown} is not a call of P(...). {_SPEC_FIX}")
    if node.keywords or any(isinstance(arg, ast.Starred) for arg in node.args):
        raise RecipeError(f"{shown} has keyword or starred arguments. {_SPEC_FIX}")
    entries: list[object] = []
    for arg in node.args:
        try:
            entry = ast.literal_eval(arg)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            raise RecipeError(
                f"{shown}: entry {ast.unparse(arg)} is not a literal. {_SPEC_FIX}"
            ) from None
        axes = entry if isinstance(entry, tuple) else (entry,)
        if not (entry is None or all(isinstance(axis, str) for axis in axes)):
            raise RecipeError(f"{shown}: entry {entry!r} is not allowed. {_SPEC_FIX}")
        entries.append(entry)
    try:
        return P(*entries)
    except MeshtrainError as err:
        raise RecipeError(f"{shown}: {err.message}") from None


def toml_value(value: Any) -> str:
    """A value as a recipe would write it.

    Example:
        >>> toml_value(["dp"]), toml_value(True)
        ('["dp"]', 'true')
    """
    return json.dumps(value, default=str, ensure_ascii=False)


def _kind(value: Any) -> str:
    return _KINDS.get(type(value), type(value).__name__)
