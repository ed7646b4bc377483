"""What a recipe file may contain, and the checks that turn a bad one into a clear RecipeError.

Every message names the file, the ``section.key``, the value, what is allowed and how to fix it.
The sections are declared once, as dataclasses in :mod:`meshtrain.recipes.sections`; the key
tables here (:func:`key_table`, :data:`SECTIONS`), the "did you mean" lists and the key reference
of ``docs/recipes.md`` (:func:`reference_table`) are derived from them. This module imports no
torch until a recipe is checked (the vocabularies of the plan and train layers are read then).

Example:
    >>> check_table("r.toml", "train", {"steps": "3"})
    Traceback (most recent call last):
    ...
    meshtrain.errors.RecipeError: r.toml: train.steps = "3" is a string, but steps must be a positive integer. Write e.g. steps = 3.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import math
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from meshtrain.errors import MeshtrainError, RecipeError, did_you_mean
from meshtrain.recipes.sections import (
    SECTION_NAMES,
    SECTION_TYPES,
    TOP_SECTIONS,
    CheckpointSection,
    DataSection,
    DataSource,
    FreeForm,
    LoggingSection,
    LoRASection,
    ModelSection,
    OptimizerName,
    ParallelSection,
    PipelineSection,
    TrainSection,
)
from meshtrain.recipes.source import find_recipe as find_recipe  # re-exported
from meshtrain.tables import toml_value

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

    from meshtrain.spec.partition import P

__all__ = [
    "DATA_SOURCES",
    "OPTIMIZERS",
    "SECTION_NAMES",
    "TOP_SECTIONS",
    "CheckpointSection",
    "DataSection",
    "Key",
    "LoRASection",
    "LoggingSection",
    "ModelSection",
    "ParallelSection",
    "PipelineSection",
    "TrainSection",
    "build_section",
    "check_table",
    "key_table",
    "parse_spec",
    "reference_table",
]

OPTIMIZERS: tuple[str, ...] = typing.get_args(OptimizerName)
DATA_SOURCES: tuple[str, ...] = typing.get_args(DataSource)
_AXIS = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_KINDS = {
    bool: "a boolean",
    int: "an integer",
    float: "a number",
    str: "a string",
    list: "an array",
    dict: "a table",
}
_SPEC_FIX = "Write a spec like \"P('tp', None)\": entries None, 'axis' or ('axis1', 'axis2')."
Section = TypeVar("Section", bound="DataclassInstance")


@dataclass(frozen=True)
class Key:
    """What one key accepts, derived from its field: Python types as tomllib reads them, an
    example, allowed values, bounds, an array's item types and length; its doc and default.

    Example:
        >>> key_table("parallel")["zero"].describe()
        'one of 0, 1, 2, 3'
    """

    kinds: tuple[type, ...]
    example: Any
    choices: tuple[Any, ...] = ()
    positive: bool = False
    nonnegative: bool = False
    items: tuple[type, ...] = (str,)  # what an array's items are
    length: int | None = None  # an array's required length
    doc: str = ""
    default: Any = None
    shown: str = ""  # the default as the docs show it, when not the value itself
    resume: str = "refuse"  # sections.Resume: whether a resume may change it

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


@functools.cache
def _type_names() -> dict[str, Any]:
    """The names the sections' annotations use from lower layers (imported on first use)."""
    from meshtrain.models.llama import LlamaConfig
    from meshtrain.models.moe import MoEConfig
    from meshtrain.plan.options import Checkpointing, Precision, ZeroStage
    from meshtrain.train.data.documents import DocumentFormat
    from meshtrain.train.guard import OnNonFinite
    from meshtrain.train.metrics.config import WandbMode
    from meshtrain.train.schedule import Decay

    return {
        "LlamaConfig": LlamaConfig,
        "MoEConfig": MoEConfig,
        "Checkpointing": Checkpointing,
        "Precision": Precision,
        "ZeroStage": ZeroStage,
        "WandbMode": WandbMode,
        "OnNonFinite": OnNonFinite,
        "Decay": Decay,
        "DocumentFormat": DocumentFormat,
    }


@functools.cache
def key_table(section: str) -> dict[str, Key]:
    """TOML key → :class:`Key` of a section (``"parallel.pipeline"`` for the nested table), in
    field order; empty for the free-form ``mesh`` and ``rules``.

    Example:
        >>> list(key_table("parallel.pipeline"))
        ['axis', 'schedule', 'microbatches', 'stages_per_rank']
    """
    section_type = SECTION_TYPES[section]
    if isinstance(section_type, FreeForm):
        return {}
    hints = typing.get_type_hints(section_type, localns=_type_names())
    keys: dict[str, Key] = {}
    for field in dataclasses.fields(section_type):
        expand = field.metadata.get("keys_from")
        if expand is not None:  # a key two configs share keeps the first's entry
            keys.update(
                {
                    k: v
                    for k, v in _config_keys(expand(), field.metadata["resume"]).items()
                    if k not in keys
                }
            )
        else:
            keys[field.metadata["toml"] or field.name] = _derive(field, hints[field.name])
    return keys


def _derive(field: dataclasses.Field[Any], hint: Any) -> Key:
    """A field's :class:`Key`: ``Literal`` → choices; ``tuple`` → an array (fixed length unless
    ``...``); a dataclass → a table; ``float`` also takes integers; ``X | None`` is ``X``."""
    meta = field.metadata
    hint = _without_none(hint)
    choices = meta["choices"]() if callable(meta["choices"]) else meta["choices"]
    items: tuple[type, ...] = (str,)
    length = None
    if typing.get_origin(hint) is Literal:
        choices = tuple(choice for choice in typing.get_args(hint) if choice != "")  # "": unset
        kinds: tuple[type, ...] = (type(choices[0]),)
    elif typing.get_origin(hint) is tuple:
        args = typing.get_args(hint)
        kinds, items = (list,), _kinds_of(args[0])
        length = None if args[-1] is Ellipsis else len(args)
    elif dataclasses.is_dataclass(hint):
        kinds = (dict,)
    else:
        kinds = _kinds_of(hint)
    return Key(
        kinds,
        meta["example"],
        tuple(choices),
        positive=meta["bound"] == "positive",
        nonnegative=meta["bound"] == "nonnegative",
        items=items,
        length=length,
        doc=meta["doc"],
        default=field.default,
        shown=meta["shown"],
        resume=meta["resume"],
    )


def _config_keys(config_type: type, resume: str) -> dict[str, Key]:
    """A model config's fields as ``[model]`` keys (each an override of the preset's): numbers
    positive, or non-negative where the field's default is 0 (a count that may be none)."""
    hints = {name: _without_none(hint) for name, hint in typing.get_type_hints(config_type).items()}
    examples = {int: 2, float: 1.0, bool: True, str: ""}
    numbers = {
        field.name for field in dataclasses.fields(config_type) if hints[field.name] in (int, float)
    }
    zero = {field.name for field in dataclasses.fields(config_type) if field.default == 0}
    return {
        field.name: Key(
            _kinds_of(hints[field.name]),
            examples.get(hints[field.name], 1.0),
            positive=field.name in numbers - zero,
            nonnegative=field.name in numbers & zero,
            doc=f"the preset's `{config_type.__name__}.{field.name}`, overridden",
            shown="the preset's",
            resume=resume,
        )
        for field in dataclasses.fields(config_type)
    }


def _without_none(hint: Any) -> Any:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        return args[0] if len(args) == 1 else hint
    return hint


def _kinds_of(hint: Any) -> tuple[type, ...]:
    return (int, float) if hint is float else (hint,)


def build_section(section_type: type[Section], values: Mapping[str, Any]) -> Section:
    """The section's dataclass from checked values keyed by TOML name (``async`` →
    ``async_save``).

    Example:
        >>> build_section(CheckpointSection, {"async": True}).async_save
        True
    """
    names = {
        field.metadata.get("toml") or field.name: field.name
        for field in dataclasses.fields(section_type)
    }
    return section_type(**{names[key]: value for key, value in values.items()})


def __getattr__(name: str) -> Any:
    """``SECTIONS`` (section → key → :class:`Key`) and ``PRESETS``, derived on first use."""
    if name == "SECTIONS":
        return {section: key_table(section) for section in SECTION_NAMES}
    if name == "PRESETS":
        from meshtrain.models.llama import _PRESETS

        return _PRESETS
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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


def check_table(
    source: str, section: str, table: Mapping[str, Any], *, keys: Mapping[str, Key] | None = None
) -> dict[str, Any]:
    """The section's values, each checked against its :func:`key_table` (or ``keys``: the
    launcher's torch-free subset, :mod:`~meshtrain.recipes.quick_check`; numbers become floats
    where a float is wanted, arrays tuples)."""
    keys = key_table(section) if keys is None else keys
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
        if isinstance(value, list):
            value = tuple(float(item) if float in spec.items else item for item in value)
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
    return build_section(LoRASection, values)


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
    from meshtrain.models.llama import LlamaConfig

    values = check_table(source, "model", table)
    own = {field.name for field in dataclasses.fields(ModelSection)}
    section = build_section(ModelSection, {k: v for k, v in values.items() if k in own})
    overrides = {key: value for key, value in values.items() if key not in own}
    if section.name == "moe" and not (section.factory or section.hf):
        return _moe_section(source, section, overrides)
    if section.factory or section.hf:
        others = sorted(set(values) - {"factory", "hf", "meta_init"})
        if (section.factory and section.hf) or others:
            given = [key for key in ("factory", "hf") if values.get(key)] + others
            raise RecipeError(
                f"{source}: [model] gives {given}: a recipe's model is one of a Llama preset "
                '(preset + its config keys), factory = "package.module:function", or hf = '
                '"DIR" — pick one.'
            )
        return dataclasses.replace(section, name=section.kind, preset="")
    try:
        config = LlamaConfig.preset(section.preset, **overrides)
    except MeshtrainError as err:
        raise RecipeError(
            f"{source}: [model] preset {toml_value(section.preset)} with overrides {overrides}: "
            f"{err.message}"
        ) from None
    return dataclasses.replace(section, config=config)


def _moe_section(source: str, section: ModelSection, overrides: dict[str, Any]) -> ModelSection:
    """``[model] name = "moe"``: the preset with its overrides, built as a MoEConfig."""
    from meshtrain.models.moe_presets import moe_preset

    try:
        config = moe_preset(section.preset, **overrides)
    except MeshtrainError as err:
        raise RecipeError(
            f'{source}: [model] name = "moe", preset {toml_value(section.preset)} with '
            f"overrides {overrides}: {err.message}"
        ) from None
    return dataclasses.replace(section, moe=config)


def parallel_section(source: str, table: dict[str, Any], mesh: dict[str, int]) -> ParallelSection:
    """``[parallel]``: tp, ep and fsdp default to "tp", "ep" and ["dp"] when the mesh has those axes; every
    named axis must exist and have one job."""
    values = check_table(source, "parallel", table)
    pipe = None
    if "pipeline" in values:
        pipe = build_section(
            PipelineSection, check_table(source, "parallel.pipeline", values.pop("pipeline"))
        )
    default = ParallelSection()  # its axes where the mesh has them
    values.setdefault("tp", default.tp if default.tp in mesh else "")
    values.setdefault("ep", default.ep if default.ep in mesh else "")
    values.setdefault("fsdp", tuple(axis for axis in default.fsdp if axis in mesh))
    par = dataclasses.replace(build_section(ParallelSection, values), pipeline=pipe)
    jobs = [(f"parallel.fsdp = {toml_value(list(par.fsdp))}", axis) for axis in par.fsdp]
    jobs += [(f"parallel.tp = {toml_value(par.tp)}", par.tp)] if par.tp else []
    jobs += [(f"parallel.ep = {toml_value(par.ep)}", par.ep)] if par.ep else []
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
    from meshtrain.spec.partition import P

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


def _kind(value: Any) -> str:
    return _KINDS.get(type(value), type(value).__name__)


def reference_table() -> str:
    """The key reference of ``docs/recipes.md``, as a Markdown table derived from the sections
    (``tests/test_recipe_schema.py`` keeps the docs equal to it).

    Example:
        >>> print(reference_table().splitlines()[2])
        | `[model]` | `name` | one of "llama", "moe" | `"llama"` | refused | meshtrain's Llama, or its mixture of experts ([MoE](moe.md)) |
    """
    lines = [
        "| section | key | type | default | on resume | meaning |",
        "|---|---|---|---|---|---|",
    ]
    shown = {"safe": "safe", "refuse": "refused"}
    for section, section_type in SECTION_TYPES.items():
        if isinstance(section_type, FreeForm):
            rows = [
                (
                    section_type.key,
                    section_type.value,
                    section_type.default,
                    shown[section_type.resume],
                    section_type.doc,
                )
            ]
        else:
            rows = [
                (
                    f"`{key}`",
                    spec.describe(),
                    spec.shown or f"`{toml_value(spec.default)}`",
                    shown[spec.resume],
                    spec.doc,
                )
                for key, spec in key_table(section).items()
                if spec.kinds != (dict,)  # a nested table: its own rows
            ]
        for index, (key, kind, default, resume, doc) in enumerate(rows):
            name = f"`[{section}]`" if index == 0 else ""
            lines.append(f"| {name} | {key} | {kind} | {default} | {resume} | {doc} |")
    return "\n".join(lines) + "\n"
