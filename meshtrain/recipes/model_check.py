"""Does a recipe's model match the files it is built and started from? Checked by the launcher
before any rank starts (:func:`~meshtrain.recipes.preflight.check_plan`), from ``config.json``
files and safetensors headers only: a mismatch is one line and exit status 2, not a traceback on
every rank.

:func:`check_model` refuses a ``[model] hf`` directory whose ``model_type`` transformers does not
know; an ``[checkpoint] init_from`` of another architecture than the recipe's model, or of the
same architecture with another config (each differing key named with both values and the
``--set`` that fixes it); and a QLoRA recipe (``[lora] quantize_base``) launched without torchao.
:func:`check_architecture` and :func:`check_torchao` read the recipe as parsed and import no
torch, so the launcher runs them with its first, torch-free checks. :func:`check_llama_config` is
the Llama half, also used when weights are loaded
(:func:`~meshtrain.recipes.pretrained.load_pretrained`).

Example:
    >>> from meshtrain.models.llama import LlamaConfig
    >>> check_llama_config(LlamaConfig.debug(), {"model_type": "gpt2", "n_embd": 64},
    ...                    Path("gpt2/config.json"))
    Traceback (most recent call last):
    ...
    meshtrain.errors.CheckpointError: 'gpt2/config.json' describes a gpt2 model, but the recipe builds meshtrain's Llama: point init_from at a Llama checkpoint (model_type 'llama'), or train that model itself with [model] hf = 'gpt2'.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import json
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from meshtrain.errors import CheckpointError, RecipeError

if TYPE_CHECKING:
    from meshtrain.models.llama import LlamaConfig
    from meshtrain.recipes.sections import ModelSection

__all__ = [
    "HF_KEYS",
    "LLAMA_KEYS",
    "check_architecture",
    "check_llama_config",
    "check_model",
    "check_model_type",
    "check_torchao",
]

#: The Llama config values a checkpoint's config.json must agree with (shapes cannot tell
#: ``norm_eps`` or ``rope_theta``).
LLAMA_KEYS = (
    "dim",
    "n_layers",
    "n_heads",
    "n_kv_heads",
    "vocab_size",
    "ffn_dim",
    "norm_eps",
    "rope_theta",
)
#: The keys a transformers config.json needs to describe a Llama.
_LLAMA_HF_KEYS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
    "vocab_size",
)
#: transformers config keys that fix a model's weights or numerics, compared between a
#: ``[model] hf`` directory and the ``init_from`` it starts from (where both have them).
HF_KEYS = (
    "model_type",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "vocab_size",
    "head_dim",
    "rms_norm_eps",
    "layer_norm_eps",
    "layer_norm_epsilon",
    "rope_theta",
    "n_embd",
    "n_layer",
    "n_head",
    "n_inner",
    "d_model",
    "tie_word_embeddings",
)


def check_architecture(model: object, start: str, source: str) -> None:
    """Before torch is imported (:func:`~meshtrain.recipes.preflight.check_launch`): a recipe
    whose ``[model]`` table (``model``, as parsed) builds meshtrain's Llama refuses an
    ``init_from`` directory whose config.json describes another architecture. Unreadable files
    are left to :func:`check_model` and the loader.

    Example:
        >>> check_architecture({"preset": "debug"}, "/nonexistent", "r.toml")  # nothing to read
    """
    if not isinstance(model, Mapping) or model.get("hf") or model.get("factory"):
        return
    config = _read_json(Path(start) / "config.json")
    if isinstance(config, dict) and not _meshtrain_names(start):
        _check_is_llama(config, Path(start) / "config.json", f"{source}: checkpoint.init_from: ")


def check_model(
    source: str, model: ModelSection, *, init_from: str = "", quantize_base: str = ""
) -> None:
    """Refuse (:class:`RecipeError`, :class:`CheckpointError`) the model of the recipe ``source``
    (its ``[model]`` section, ``[checkpoint] init_from`` and ``[lora] quantize_base``) when it
    cannot be built or started as written; see the module docstring. Reads no weights."""
    if model.kind == "hf":
        check_model_type(model.hf, f"{source}: [model] hf = {model.hf!r}")
    if init_from:  # checked on a resume too, as the launcher checks the file
        _check_init_from(source, model, init_from)
    if quantize_base:
        from meshtrain.adapters.nf4 import torchao_nf4

        if torchao_nf4() is None:
            raise _no_torchao(source, quantize_base)


def check_torchao(lora: object, source: str) -> None:
    """Before torch is imported (:func:`~meshtrain.recipes.preflight.check_launch`): a QLoRA
    recipe (``[lora] quantize_base``; ``lora`` is the table as parsed) needs torchao installed.

    Example:
        >>> check_torchao({"rank": 8}, "r.toml")  # no quantized base: nothing needed
    """
    base = lora.get("quantize_base") if isinstance(lora, Mapping) else None
    if base and not _installed("torchao"):
        raise _no_torchao(source, base)


def _no_torchao(source: str, base: object) -> RecipeError:
    return RecipeError(
        f"{source}: [lora] quantize_base = {base!r} trains an NF4 base with torchao, which is "
        "not installed: `pip install meshtrain[qlora]`, or remove quantize_base (`meshtrain "
        "plan` sizes the recipe without torchao)."
    )


def _installed(package: str) -> bool:
    """Whether ``package`` can be found, without importing it."""
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):  # a None entry in sys.modules: made unimportable
        return False


def check_model_type(directory: str, where: str) -> None:
    """The ``model_type`` of ``directory``'s config.json is one transformers knows (its missing
    config.json or transformers itself are left to the model's builder).

    Example:
        >>> check_model_type("/nonexistent", "[model] hf")  # no config.json: the builder says so
    """
    from meshtrain.train.hf.files import read_config

    config = read_config(directory)
    transformers = _known_model_types() if config is not None else None
    if config is None or transformers is None or config.get("model_type") in transformers[1]:
        return
    version, known = transformers
    kind = config.get("model_type")
    if kind is None:
        what = 'names no "model_type"'
    else:
        close = difflib.get_close_matches(str(kind), known, n=3)
        what = f"has model_type {kind!r}, which transformers {version} does not know" + (
            f" (close: {', '.join(close)})" if close else ""
        )
    raise RecipeError(
        f"{where}: {str(Path(directory) / 'config.json')!r} {what}, so it cannot build the "
        'model. Set "model_type" to the architecture\'s (e.g. "llama"), or use a transformers '
        "version that has it."
    )


def check_llama_config(
    config: LlamaConfig, hf: Mapping[str, Any], source: Path, prefix: str = ""
) -> None:
    """Refuse (:class:`CheckpointError`) a transformers ``config.json`` (``hf``, read from
    ``source``) of another architecture than meshtrain's Llama, or of a Llama other than
    ``config``: each differing key with both values and the ``--set`` that matches it."""
    from meshtrain.models.llama_hf import llama_config_from_hf

    _check_is_llama(hf, source, prefix)
    theirs = llama_config_from_hf(hf, f"{prefix}{source}")
    differ = [name for name in LLAMA_KEYS if getattr(config, name) != getattr(theirs, name)]
    if not differ:
        return
    values = "; ".join(
        f"{name} = {getattr(config, name)!r} here but {getattr(theirs, name)!r} there"
        for name in differ
    )
    keys = ", ".join("multiple_of / ffn_dim_multiplier" if n == "ffn_dim" else n for n in differ)
    sets = " ".join(
        f"--set model.{key}={value!r}" for n in differ for key, value in _sets(n, theirs)
    )
    raise CheckpointError(
        f"{prefix}the model differs from the one {str(source)!r} describes: {values}. Set "
        f"[model] {keys} to match ({sets}), or give another init_from, or use [model] hf = "
        f"{str(source.parent)!r} to train the transformers model itself."
    )


def _check_is_llama(hf: Mapping[str, Any], source: Path, prefix: str) -> None:
    """``hf`` (a config.json) describes a Llama: its ``model_type`` and the keys one needs."""
    kind, missing = hf.get("model_type"), [key for key in _LLAMA_HF_KEYS if key not in hf]
    if kind in (None, "llama") and not missing:
        return
    what = f"a {kind} model" if kind not in (None, "llama") else f"no {', '.join(missing)}"
    raise CheckpointError(
        f"{prefix}{str(source)!r} describes {what}, but the recipe builds meshtrain's Llama: "
        "point init_from at a Llama checkpoint (model_type 'llama'), or train that model "
        f"itself with [model] hf = {str(source.parent)!r}."
    )


def _sets(name: str, theirs: LlamaConfig) -> list[tuple[str, Any]]:
    """The recipe keys (and values) that give ``theirs``'s ``name``."""
    if name == "ffn_dim":
        return [
            ("multiple_of", theirs.multiple_of),
            ("ffn_dim_multiplier", theirs.ffn_dim_multiplier),
        ]
    return [(name, getattr(theirs, name))]


def _check_init_from(recipe: str, model: ModelSection, start: str) -> None:
    """``init_from``'s config.json (a directory's; a lone .safetensors file has none) describes
    the recipe's model."""
    from meshtrain.train.hf.files import read_config

    hf = read_config(start) if Path(start).is_dir() else None
    if hf is None:
        return
    source, prefix = Path(start) / "config.json", f"{recipe}: checkpoint.init_from: "
    if model.config is not None and not _meshtrain_names(start):
        check_llama_config(model.config, hf, source, prefix)
    elif model.kind == "hf":
        _check_same_hf(read_config(model.hf) or {}, hf, source, prefix)


def _check_same_hf(
    ours: Mapping[str, Any], theirs: Mapping[str, Any], source: Path, prefix: str
) -> None:
    """A ``[model] hf`` model and its ``init_from`` agree on every :data:`HF_KEYS` both have."""
    differ = [key for key in HF_KEYS if key in ours and key in theirs and ours[key] != theirs[key]]
    if differ:
        values = "; ".join(
            f"{key} = {ours[key]!r} here but {theirs[key]!r} there" for key in differ
        )
        raise CheckpointError(
            f"{prefix}the model differs from the one {str(source)!r} describes: {values}. Point "
            "[model] hf and init_from at the same architecture and size (init_from may be the "
            "[model] hf directory itself)."
        )


def _meshtrain_names(start: str) -> bool:
    """Whether ``start``'s weights use meshtrain's own Llama names (then config.json is not read
    to load them, as :func:`~meshtrain.recipes.pretrained.load_pretrained` does); read from the
    safetensors index or header, without torch."""
    names = _tensor_names(Path(start))
    return "model.embed_tokens.weight" not in names and "tok_embeddings.weight" in names


def _tensor_names(directory: Path) -> set[str]:
    """The tensor names of a model directory's safetensors (empty when unreadable)."""
    index = _read_json(directory / "model.safetensors.index.json")
    if isinstance(index, dict) and isinstance(index.get("weight_map"), dict):
        return set(index["weight_map"])
    try:
        with (directory / "model.safetensors").open("rb") as file:
            (length,) = struct.unpack("<Q", file.read(8))
            header = json.loads(file.read(length))
    except (OSError, ValueError, struct.error):
        return set()
    return set(header) - {"__metadata__"} if isinstance(header, dict) else set()


def _read_json(path: Path) -> object:
    """``path``'s JSON, or None when it is missing or unreadable (reported elsewhere)."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _known_model_types() -> tuple[str, frozenset[str]] | None:
    """transformers' version and the ``model_type`` names it knows, or None when transformers is
    not installed."""
    try:  # an optional dependency (the test extra), imported by name
        transformers = importlib.import_module("transformers")
        auto = importlib.import_module("transformers.models.auto.configuration_auto")
    except ImportError:
        return None
    return str(transformers.__version__), frozenset(auto.CONFIG_MAPPING_NAMES)
