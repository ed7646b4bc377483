"""Recipes: one TOML file naming a model, a mesh, rules, parallel options and training settings.

A recipe is read once and validated whole: an unknown section or key, or a value of the wrong
type, is a :class:`~meshtrain.RecipeError` naming the file, the ``section.key``, the value, what is
allowed and how to fix it. Each section is a frozen dataclass; a new section is a new dataclass,
a key table in ``_SECTIONS`` and a field of :class:`Recipe`. :func:`shrink` turns a recipe into the
same structure on a few CPU ranks, for ``meshtrain check``. See ``docs/recipes.md``.

Example:
    >>> recipe = load_recipe("debug")
    >>> recipe.mesh_axes(), recipe.parallel.zero
    ({'dp': -1, 'tp': 2}, 3)
"""

from __future__ import annotations

import ast
import dataclasses
import json
import math
import re
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from meshtrain.models.llama import Llama, LlamaConfig, build_llama, default_rules
from meshtrain.plan.pipeline import SCHEDULES, Pipeline
from meshtrain.spec.errors import MeshtrainError, RecipeError, did_you_mean
from meshtrain.spec.partition import P
from meshtrain.spec.rules import Rules

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

PRESETS = ("debug", "llama3_8b", "llama3_70b", "llama3_405b")
OPTIMIZERS = ("sgd", "adam", "adamw")
_AXIS = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_KINDS = {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
          list: "an array", dict: "a table"}  # fmt: skip


@dataclass(frozen=True)
class _Key:
    """What one key accepts: Python types as tomllib reads them, an example, allowed values."""

    kinds: tuple[type, ...]
    example: Any
    choices: tuple[Any, ...] = ()
    positive: bool = False

    def describe(self) -> str:
        if self.choices:
            return "one of " + ", ".join(_toml(c) for c in self.choices)
        if self.kinds == (list,):
            return "an array of strings"
        what = _KINDS[self.kinds[0]]
        return f"a positive {what.split()[-1]}" if self.positive else what


_POSITIVE_INT = _Key((int,), 1, positive=True)
_STR, _BOOL = _Key((str,), "tp"), _Key((bool,), True)
_LLAMA_KEYS = {
    f.name: _Key((int,), 2, positive=True) if f.type == "int" else _Key((int, float), 1.0, positive=True)
    for f in dataclasses.fields(LlamaConfig)
}
_SECTIONS: dict[str, dict[str, _Key]] = {
    "model": {"name": _Key((str,), "llama", ("llama",)), "preset": _Key((str,), "debug", PRESETS),
              **_LLAMA_KEYS},  # fmt: skip
    "mesh": {},  # axis = size (checked by _mesh)
    "parallel": {
        "zero": _Key((int,), 3, (0, 1, 2, 3)),
        "fsdp": _Key((list,), ["dp"]),
        "tp": _STR,
        "sequence_parallel": _BOOL,
        "activation_checkpointing": _Key((str,), "selective", ("none", "full", "selective")),
        "compile": _BOOL,
        "precision": _Key((str,), "bf16", ("fp32", "bf16", "fp16")),
        "microbatches": _POSITIVE_INT,
        "pipeline": _Key((dict,), {}),
    },
    "parallel.pipeline": {
        "axis": _Key((str,), "pp"),
        "schedule": _Key((str,), "1F1B", SCHEDULES),
        "microbatches": _POSITIVE_INT,
        "stages_per_rank": _POSITIVE_INT,
    },
    "rules": {},  # regex = "P(...)" (checked by _rules)
    "train": {
        "batch_size": _Key((int,), 8, positive=True),
        "seq_len": _Key((int,), 16, positive=True),
        "optimizer": _Key((str,), "adamw", OPTIMIZERS),
        "lr": _Key((int, float), 1e-3, positive=True),
        "steps": _Key((int,), 3, positive=True),
    },
}


@dataclass(frozen=True)
class ModelSection:
    """``[model]``: the architecture (only ``llama`` for now) and its config, overrides applied."""

    name: str
    preset: str
    config: LlamaConfig


@dataclass(frozen=True)
class PipelineSection:
    """``[parallel.pipeline]``: the arguments of :class:`~meshtrain.Pipeline`."""

    axis: str = "pp"
    schedule: str = "1F1B"
    microbatches: int | None = None
    stages_per_rank: int = 1

    def to_pipeline(self) -> Pipeline:
        return Pipeline(axis=self.axis, schedule=self.schedule, microbatches=self.microbatches,
                        stages_per_rank=self.stages_per_rank)  # fmt: skip


@dataclass(frozen=True)
class ParallelSection:
    """``[parallel]``: data-parallel stage, axes, sequence parallelism and compute options."""

    zero: int = 3
    fsdp: tuple[str, ...] = ("dp",)
    tp: str = "tp"
    sequence_parallel: bool = False
    activation_checkpointing: str = "none"
    compile: bool = False
    precision: str = "fp32"
    microbatches: int = 1
    pipeline: PipelineSection | None = None


@dataclass(frozen=True)
class TrainSection:
    """``[train]``: global sequences per step, tokens per sequence, optimizer, steps."""

    batch_size: int = 8
    seq_len: int = 16
    optimizer: str = "adamw"
    lr: float = 1e-3
    steps: int = 3


@dataclass(frozen=True)
class LlamaBuilder:
    """A picklable ``() -> Llama``: ranks rebuild the same seeded model from it."""

    config: LlamaConfig
    seed: int = 0

    def __call__(self) -> Llama:
        return build_llama(self.config, seed=self.seed)


@dataclass(frozen=True)
class OptimizerBuilder:
    """A picklable ``params -> Optimizer``: SGD (momentum 0.9), Adam, or AdamW (weight decay 0.1).

    Example:
        >>> OptimizerBuilder("sgd", 0.1)([nn.Parameter(torch.zeros(2))]).defaults["momentum"]
        0.9
    """

    name: str
    lr: float

    def __call__(self, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        if self.name == "sgd":
            return torch.optim.SGD(params, lr=self.lr, momentum=0.9)
        if self.name == "adam":
            return torch.optim.Adam(params, lr=self.lr)
        return torch.optim.AdamW(params, lr=self.lr, weight_decay=0.1)


@dataclass(frozen=True)
class Recipe:
    """A validated recipe; ``source`` is the file it came from (for messages).

    Example:
        >>> recipe = recipe_from_toml('[model]\\nname = "llama"\\n[mesh]\\ndp = -1\\n')
        >>> recipe.parallel.tp, recipe.parallel.fsdp, sorted(recipe.plan_options())[:3]
        ('', ('dp',), ['activation_checkpointing', 'compile', 'global_batch'])
    """

    source: str
    model: ModelSection
    mesh: tuple[tuple[str, int], ...]
    parallel: ParallelSection = field(default_factory=ParallelSection)
    train: TrainSection = field(default_factory=TrainSection)
    explicit_rules: tuple[tuple[str, P], ...] | None = None

    @property
    def name(self) -> str:
        return Path(self.source).stem

    def mesh_axes(self) -> dict[str, int]:
        """Axis → size, in order, as ``mt.make_mesh`` takes them (one may be -1)."""
        return dict(self.mesh)

    def build_model(self, device: str | torch.device = "cpu", seed: int = 0) -> Llama:
        """The model, seeded (``device="meta"``: shapes only)."""
        return build_llama(self.model.config, seed=seed, device=device)

    def model_fn(self) -> LlamaBuilder:
        return LlamaBuilder(self.model.config)

    def optimizer_fn(self) -> OptimizerBuilder:
        return OptimizerBuilder(self.train.optimizer, self.train.lr)

    def rules(self) -> Rules:
        """``[rules]`` as regex rules, else the model's default logical-axis rules."""
        par = self.parallel
        tp = par.tp or None
        if self.explicit_rules is None:
            return default_rules(tp=tp, fsdp=par.fsdp, sequence_parallel=par.sequence_parallel)
        logical = (("seq", tp),) if par.sequence_parallel and tp else ()
        return Rules(self.explicit_rules, logical=logical, fsdp=par.fsdp)

    def plan_options(self) -> dict[str, Any]:
        """Keyword arguments of ``mt.plan`` besides the rules (pipeline included)."""
        par = self.parallel
        options: dict[str, Any] = {
            "zero": par.zero, "precision": par.precision, "compile": par.compile,
            "activation_checkpointing": par.activation_checkpointing,
            "optimizer": self.train.optimizer, "global_batch": self.train.batch_size,
            "seq_len": self.train.seq_len,
        }  # fmt: skip
        if par.pipeline is not None:
            options["pipeline"] = par.pipeline.to_pipeline()
        else:
            options["microbatches"] = par.microbatches
        return options

    def microbatches(self) -> int:
        """Micro-batches per step (a pipeline's; one per stage when it does not say)."""
        pipe = self.parallel.pipeline
        if pipe is None:
            return self.parallel.microbatches
        return pipe.microbatches or self.mesh_axes()[pipe.axis] * pipe.stages_per_rank


def load_recipe(path_or_name: str | Path) -> Recipe:
    """Read a recipe from a path, or a bare name as ``recipes/<name>.toml`` under the current
    directory, then under the repository root.

    Example:
        >>> load_recipe("llama3_8b").model.config.n_layers
        32
    """
    path = _find(path_or_name)
    try:
        text = path.read_text()
    except OSError as err:
        raise RecipeError(f"cannot read recipe {str(path)!r}: {err}.") from None
    return recipe_from_toml(text, source=str(path))


def recipe_from_toml(text: str, source: str = "<string>") -> Recipe:
    """Validate recipe text (``source`` names it in errors); see :func:`load_recipe`."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise RecipeError(f"{source}: not valid TOML ({err}). Fix the syntax.") from None
    for name, table in data.items():
        if name not in _SECTIONS or name == "parallel.pipeline":
            raise RecipeError(
                f"{source}: unknown section [{name}]"
                f"{did_you_mean(name, _TOP, 'sections')}. Remove it or rename it."
            )
        if not isinstance(table, dict):
            raise RecipeError(
                f"{source}: {name} = {_toml(table)} is {_kind(table)}, but [{name}] must be a "
                f"table. Write it as a section: [{name}] followed by key = value lines."
            )
    for required in ("model", "mesh"):
        if required not in data:
            raise RecipeError(f"{source}: missing section [{required}]; every recipe needs one.")
    mesh = _mesh(source, data["mesh"])
    parallel = _parallel(source, data.get("parallel", {}), dict(mesh))
    return Recipe(
        source=source,
        model=_model(source, data["model"]),
        mesh=mesh,
        parallel=parallel,
        train=TrainSection(**_table(source, "train", data.get("train", {}))),
        explicit_rules=_rules(source, data["rules"]) if "rules" in data else None,
    )


def parse_spec(text: str, *, where: str = "spec") -> P:
    """A ``P(...)`` spec string, without eval: each entry is a literal (None, an axis name, or a
    tuple of axis names).

    Example:
        >>> parse_spec("P(('dp', 'tp'), None)")
        P(('dp', 'tp'), None)
    """
    fix = "Write a spec like \"P('tp', None)\": entries None, 'axis' or ('axis1', 'axis2')."
    try:
        node = ast.parse(text.strip(), mode="eval").body
    except SyntaxError:
        raise RecipeError(f"{where} = {_toml(text)} is not P(...) syntax. {fix}") from None
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "P"):
        raise RecipeError(f"{where} = {_toml(text)} is not a call of P(...). {fix}")
    if node.keywords or any(isinstance(arg, ast.Starred) for arg in node.args):
        raise RecipeError(f"{where} = {_toml(text)} has keyword or starred arguments. {fix}")
    entries = []
    for arg in node.args:
        try:
            entry = ast.literal_eval(arg)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            raise RecipeError(
                f"{where} = {_toml(text)}: entry {ast.unparse(arg)!r} is not a literal. {fix}"
            ) from None
        ok = entry is None or isinstance(entry, str)
        if not ok and not (isinstance(entry, tuple) and all(isinstance(a, str) for a in entry)):
            raise RecipeError(f"{where} = {_toml(text)}: entry {entry!r} is not allowed. {fix}")
        entries.append(entry)
    try:
        return P(*entries)
    except MeshtrainError as err:
        raise RecipeError(f"{where} = {_toml(text)}: {err.message}") from None


# ----------------------------------------------------------------------------- sections

_TOP = tuple(name for name in _SECTIONS if "." not in name)


def _model(source: str, table: dict[str, Any]) -> ModelSection:
    values = _table(source, "model", table)
    name, preset = values.pop("name", "llama"), values.pop("preset", "debug")
    try:
        config = LlamaConfig.preset(preset, **values)
    except MeshtrainError as err:
        raise RecipeError(f"{source}: [model] preset {preset!r} with {values}: {err.message}")
    return ModelSection(name, preset, config)


def _mesh(source: str, table: dict[str, Any]) -> tuple[tuple[str, int], ...]:
    fix = "Write axis = size, e.g. dp = -1 and tp = 2, in the order of the mesh's dims."
    if not table:
        raise RecipeError(f"{source}: [mesh] is empty. {fix}")
    for axis, size in table.items():
        if not _AXIS.fullmatch(axis):
            raise RecipeError(f"{source}: mesh.{axis}: the axis name is not an identifier. {fix}")
        if type(size) is not int or (size < 1 and size != -1):
            raise RecipeError(
                f"{source}: mesh.{axis} = {_toml(size)} is not a positive integer or -1. {fix}"
            )
    if sum(size == -1 for size in table.values()) > 1:
        raise RecipeError(
            f"{source}: [mesh] has -1 on several axes {[a for a, s in table.items() if s == -1]}; "
            "only one axis can take the remaining ranks. Give the others explicit sizes."
        )
    return tuple(table.items())


def _parallel(source: str, table: dict[str, Any], mesh: dict[str, int]) -> ParallelSection:
    values = _table(source, "parallel", table)
    pipeline = None
    if "pipeline" in values:
        pipeline = PipelineSection(**_table(source, "parallel.pipeline", values.pop("pipeline")))
    values.setdefault("tp", "tp" if "tp" in mesh else "")
    values["fsdp"] = tuple(values.get("fsdp", ("dp",) if "dp" in mesh else ()))
    parallel = ParallelSection(**values, pipeline=pipeline)
    roles = [(f"parallel.fsdp = {_toml(list(parallel.fsdp))}", axis) for axis in parallel.fsdp]
    roles += [(f'parallel.tp = "{parallel.tp}"', parallel.tp)] if parallel.tp else []
    if pipeline is not None:
        roles.append((f'parallel.pipeline.axis = "{pipeline.axis}"', pipeline.axis))
        if parallel.microbatches not in (1, pipeline.microbatches):
            raise RecipeError(
                f"{source}: parallel.microbatches = {parallel.microbatches} and "
                f"parallel.pipeline.microbatches = {_toml(pipeline.microbatches)} disagree; a "
                "pipeline accumulates over its own micro-batches. Set them in [parallel.pipeline]."
            )
    seen: dict[str, str] = {}
    for key, axis in roles:
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
    return parallel


def _rules(source: str, table: dict[str, Any]) -> tuple[tuple[str, P], ...]:
    rules = []
    for pattern, text in table.items():
        where = f"{source}: rules.{_toml(pattern)}"
        if not isinstance(text, str):
            raise RecipeError(f"{where} = {_toml(text)} is {_kind(text)}; write a spec string "
                              "such as \"P('tp', None)\".")  # fmt: skip
        try:
            re.compile(pattern)
        except re.error as err:
            raise RecipeError(f"{where}: the key is not a valid regex ({err}).") from None
        rules.append((pattern, parse_spec(text, where=where)))
    return tuple(rules)


def _table(source: str, section: str, table: Mapping[str, Any]) -> dict[str, Any]:
    """Check every key of a section against ``_SECTIONS``; numbers become floats where asked."""
    keys = _SECTIONS[section]
    values: dict[str, Any] = {}
    for key, value in table.items():
        spec = keys.get(key)
        where = f"{source}: {section}.{key} = {_toml(value)}"
        if spec is None:
            raise RecipeError(
                f"{source}: unknown key {section}.{key} = {_toml(value)}"
                f"{did_you_mean(key, list(keys), f'keys of [{section}]')}. Remove it or use one "
                "of those keys."
            )
        example = f"Write e.g. {key} = {_toml(spec.example)}."
        wrong_type = type(value) not in spec.kinds or (
            spec.kinds == (list,) and not all(isinstance(item, str) for item in value)
        )
        if wrong_type:
            raise RecipeError(f"{where} is {_kind(value)}, but {key} must be "
                              f"{spec.describe()}. {example}")  # fmt: skip
        if spec.choices and value not in spec.choices:
            raise RecipeError(f"{where} is not allowed; {key} must be {spec.describe()}. {example}")
        if spec.positive and value <= 0:
            raise RecipeError(f"{where} is out of range; {key} must be {spec.describe()}. {example}")
        values[key] = float(value) if float in spec.kinds else value
    return values


def _find(path_or_name: str | Path) -> Path:
    path = Path(path_or_name)
    if path.suffix == ".toml" or len(path.parts) > 1 or path.is_file():
        if not path.is_file():
            raise RecipeError(f"recipe file {str(path)!r} does not exist.")
        return path
    roots = [Path.cwd() / "recipes", Path(__file__).resolve().parents[1] / "recipes"]
    for root in roots:
        if (root / f"{path}.toml").is_file():
            return root / f"{path}.toml"
    known = sorted({p.stem for root in roots if root.is_dir() for p in root.glob("*.toml")})
    raise RecipeError(
        f"no recipe named {str(path)!r} in {' or '.join(str(r) for r in roots)}"
        f"{did_you_mean(str(path), known, 'recipes')}. Give a path to a .toml file or a known name."
    )


def _toml(value: Any) -> str:
    return json.dumps(value, default=str, ensure_ascii=False)


def _kind(value: Any) -> str:
    return _KINDS.get(type(value), type(value).__name__)

