"""Pretrained weights in and out of a recipe's model: ``[checkpoint] init_from`` and
``meshtrain export RUN_DIR --format hf``.

In: :func:`load_pretrained` loads a transformers directory or a safetensors file into a model,
planned and applied or not, each rank reading its slices (:func:`meshtrain.train.hf.load.load_hf`).
For meshtrain's Llama it picks the name and rotary mapping
(:mod:`meshtrain.models.llama_hf`) when the checkpoint uses transformers' names, and checks that
``config.json`` describes a Llama, and the same one (also what shapes cannot tell: ``rope_theta``,
``rms_norm_eps``; :func:`~meshtrain.recipes.model_check.check_llama_config`); any other model
loads by its own names. meshtrain's mixture of experts reads transformers' Qwen3-MoE names and
fused expert layout the same way (:mod:`meshtrain.models.moe_hf`; a config.json describing
another model is refused by field). :func:`initialise_from` is what a run calls once its model is applied: it
loads ``init_from``, unless the run resumes from a checkpoint of its own (then ``init_from`` is
not read at all).

Out: :func:`export_run` writes the newest intact checkpoint of a run as a transformers
directory (:func:`meshtrain.train.hf.export.export_hf`): for meshtrain's Llama a
``LlamaForCausalLM`` config.json and transformers' names and layout (for its mixture of
experts a ``Qwen3MoeForCausalLM``'s, where Qwen3-MoE can hold it); for ``[model] hf`` the
original config.json with the weights under their own names; every export carries the tokenizer
the run trained with (:mod:`meshtrain.recipes.tokenizer_files`).

Example::

    report = export_run("runs/debug", "out/debug-hf", max_shard_size="2GB")
    model = transformers.AutoModelForCausalLM.from_pretrained("out/debug-hf")
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from meshtrain.adapters import LoRALinear, merge_lora
from meshtrain.errors import CheckpointError, MeshtrainError
from meshtrain.lower.pipeline import PipelinedModel
from meshtrain.models.llama import LlamaConfig
from meshtrain.models.llama_hf import hf_config_from_llama, hf_sources, llama_to_hf
from meshtrain.models.moe import MoEConfig
from meshtrain.models.moe_hf import (
    check_moe_config,
    hf_config_from_moe,
    moe_hf_sources,
    moe_to_hf,
)
from meshtrain.recipes.model_check import check_llama_config
from meshtrain.recipes.recipe import Recipe
from meshtrain.recipes.schema import model_section
from meshtrain.recipes.tokenizer_files import (
    MODEL_TOKENIZER_FILES,
    check_tokenizer_files,
    run_tokenizer,
    write_tokenizer_files,
)
from meshtrain.train.checkpoint import find_resume_point, list_checkpoints
from meshtrain.train.checkpoint.files import canonical_fqn, read_state_file
from meshtrain.train.hf.export import ExportReport, Rename, Transform, export_hf
from meshtrain.train.hf.files import read_config, weight_files
from meshtrain.train.hf.load import LoadReport, load_hf

__all__ = ["EXPORT_FORMATS", "export_run", "initialise_from", "load_pretrained"]

EXPORT_FORMATS = ("hf",)
#: Files beside config.json that an ``[model] hf`` export copies when the source has them (the
#: tokenizer's only when the run trained on it: :data:`MODEL_TOKENIZER_FILES`).
COPIED_FILES = ("generation_config.json",)


def load_pretrained(
    path: str | Path,
    model: nn.Module | PipelinedModel,
    progress: Callable[[int, int], None] | None = None,
) -> LoadReport:
    """Load the transformers directory or safetensors file at ``path`` into ``model`` (see the
    module docstring); call on every rank alike, before or after ``mt.apply``. ``progress``:
    :func:`~meshtrain.train.hf.load.load_hf`'s (tensors filled out of the total).

    Example::

        model = mt.apply(plan, build_llama(config))
        load_pretrained("checkpoints/Llama-3.2-1B", model)
    """
    modules = model.modules if isinstance(model, PipelinedModel) else [model]
    adapters = _adapter_fqns(modules)
    config = getattr(modules[0], "config", None)
    if isinstance(config, MoEConfig):
        return _load_moe(path, model, config, adapters, progress)
    if not isinstance(config, LlamaConfig):
        return load_hf(path, modules, exclude=adapters, progress=progress)
    weights = weight_files(path)
    own_names = {canonical_fqn(fqn) for fqn, _ in model.named_parameters()}
    if own_names & set(weights.files) and "model.embed_tokens.weight" not in weights.files:
        return load_hf(path, modules, exclude=adapters, progress=progress)  # its own names
    hf_config = read_config(path) if Path(path).is_dir() else None
    if hf_config is not None:
        check_llama_config(config, hf_config, Path(path) / "config.json")
        tied = bool(hf_config.get("tie_word_embeddings", False))
    else:
        tied = "lm_head.weight" not in weights.files
    sources = hf_sources(config, tied=tied)
    return load_hf(path, modules, sources=sources, exclude=adapters, progress=progress)


def _load_moe(
    path: str | Path,
    model: nn.Module | PipelinedModel,
    config: MoEConfig,
    exclude: set[str],
    progress: Callable[[int, int], None] | None,
) -> LoadReport:
    """meshtrain's MoE: its own names, or transformers' Qwen3-MoE names and fused expert layout
    (:mod:`meshtrain.models.moe_hf`), whose config.json must describe the same model. The
    routers' balancing biases are not in a transformers checkpoint: they start at zero."""
    modules = model.modules if isinstance(model, PipelinedModel) else [model]
    weights = weight_files(path)
    own_names = {canonical_fqn(fqn) for fqn, _ in model.named_parameters()}
    if own_names & set(weights.files) and "model.embed_tokens.weight" not in weights.files:
        return load_hf(path, modules, exclude=exclude, progress=progress)
    hf_config = read_config(path) if Path(path).is_dir() else None
    if hf_config is not None:
        check_moe_config(config, hf_config, str(Path(path) / "config.json"))
    tied = bool((hf_config or {}).get("tie_word_embeddings", "lm_head.weight" not in weights.files))
    biases = {
        canonical_fqn(fqn)
        for module in modules
        for fqn, _ in module.named_buffers()
        if fqn.endswith("router.expert_bias")
    }
    sources = moe_hf_sources(config, tied=tied)
    return load_hf(path, modules, sources=sources, exclude=exclude | biases, progress=progress)


def _adapter_fqns(modules: list[nn.Module]) -> set[str]:
    """The LoRA adapters' parameters (no pretrained checkpoint holds them)."""
    return {
        canonical_fqn(f"{prefix}.{name}")
        for module in modules
        for prefix, sub in module.named_modules()
        if isinstance(sub, LoRALinear)
        for name in ("lora_A", "lora_B")
    }


def initialise_from(
    recipe: Recipe,
    model: nn.Module | PipelinedModel,
    progress: Callable[[int, int], None] | None = None,
) -> LoadReport | None:
    """Load ``[checkpoint] init_from`` into the applied ``model``, unless there is none or the
    run will resume from a checkpoint of its own (``checkpoint.resume`` and a complete
    checkpoint in its directory): that run's weights come from there. Call on every rank."""
    start = recipe.checkpoint.init_from
    if not start:
        return None
    if recipe.checkpoint.resume and list_checkpoints(recipe.checkpoint_dir):
        return None
    return load_pretrained(start, model, progress)


def export_run(
    run_dir: str | Path,
    out_dir: str | Path,
    *,
    format: str = "hf",
    max_shard_size: int | str = "5GB",
    dtype: torch.dtype | None = None,
    transform: Transform | None = None,
    progress: Callable[[int, int], None] | None = None,
    say: Callable[[str], None] | None = None,
) -> ExportReport:
    """Write the newest intact checkpoint of the run in ``run_dir`` (a run directory or its
    checkpoints directory) to ``out_dir`` as a transformers directory; ``transform`` is
    :func:`~meshtrain.train.hf.export.export_hf`'s hook (e.g. a LoRA merge). Runs in one
    process, no process group. ``say`` gets a line for each newer checkpoint passed over (the
    report names the checkpoint exported)."""
    if format not in EXPORT_FORMATS:
        raise CheckpointError(
            f"unknown export format {format!r}: meshtrain export writes "
            f"{', '.join(repr(name) for name in EXPORT_FORMATS)} (a transformers directory)."
        )
    root = Path(run_dir)
    directory = root / "checkpoints" if (root / "checkpoints").is_dir() else root
    if not directory.is_dir():
        raise CheckpointError(
            f"{str(root)!r} is not a directory: give a run directory (logging.run_dir, e.g. "
            "runs/debug) or its checkpoints directory."
        )
    point = find_resume_point(directory)
    if point.checkpoint is None:
        damaged = "; ".join(point.describe_passed_over())
        raise CheckpointError(
            f"no intact checkpoint in {str(directory)!r}"
            + (f" ({damaged})" if damaged else "")
            + ": nothing to export. Train the run first (`meshtrain checkpoints DIR` lists "
            "what is there)."
        )
    if say is not None:
        for line in point.describe_passed_over():
            say(f"warning: {line}")
    state = read_state_file(point.checkpoint)
    recipe = state.get("extra", {}).get("recipe")
    config, rename, copied = _export_target(recipe, point.checkpoint)
    check_tokenizer_files(recipe)  # before any weight is written
    transform = transform or _lora_merge(recipe)
    report = export_hf(
        point.checkpoint,
        out_dir,
        config=config,
        rename=rename,
        transform=transform,
        max_shard_size=max_shard_size,
        dtype=dtype,
        copy_files=copied,
        progress=progress,
    )
    write_tokenizer_files(recipe, report.out_dir)  # so transformers encodes and generates from it
    return report


def _lora_merge(recipe: Recipe) -> Transform | None:
    """The merge of a LoRA run's adapters into their base weights (``[lora] alpha`` from the
    recipe the checkpoint records), or None for a run without adapters."""
    table = recipe.get("lora") if isinstance(recipe, dict) else None
    if not isinstance(table, dict) or "alpha" not in table:
        return None
    return partial(merge_adapters, alpha=float(table["alpha"]))


def merge_adapters(
    fqn: str, tensor: torch.Tensor, checkpoint: Mapping[str, torch.Tensor], *, alpha: float
) -> list[tuple[str, torch.Tensor]]:
    """An export :data:`~meshtrain.train.hf.export.Transform`: a base weight with LoRA adapters
    beside it comes out merged (``W + (alpha / r)·B·A``, :func:`~meshtrain.merge_lora`); the
    adapters themselves are dropped; every other tensor passes unchanged.

    Example:
        >>> import torch
        >>> state = {"wq.weight": torch.ones(2, 3), "wq.lora_A": torch.ones(1, 3),
        ...          "wq.lora_B": torch.ones(2, 1)}
        >>> merge_adapters("wq.weight", state["wq.weight"], state, alpha=2.0)[0][1][0, 0].item()
        3.0
        >>> merge_adapters("wq.lora_A", state["wq.lora_A"], state, alpha=2.0)
        []
    """
    prefix, _, name = fqn.rpartition(".")
    if name in ("lora_A", "lora_B"):
        return []  # folded into the base weight
    base = f"{prefix}." if prefix else ""
    if name != "weight" or f"{base}lora_A" not in checkpoint:
        return [(fqn, tensor)]
    state = {
        fqn: tensor,
        f"{base}lora_A": checkpoint[f"{base}lora_A"],
        f"{base}lora_B": checkpoint[f"{base}lora_B"],
    }
    return list(merge_lora(state, alpha=alpha).items())


def _export_target(
    recipe: Any, checkpoint: Path
) -> tuple[dict[str, Any], Rename | None, list[Path]]:
    """config.json, the rename and the files to copy, for the model the run's recipe names."""
    table = recipe.get("model") if isinstance(recipe, dict) else None
    if not isinstance(table, dict):
        raise CheckpointError(
            f"{str(checkpoint)!r} does not record the recipe that trained it, so the model's "
            "architecture is unknown. Export it from Python: "
            "meshtrain.train.hf.export.export_hf(checkpoint, out, config=...)."
        )
    try:
        model = model_section(str(checkpoint), dict(table))
    except MeshtrainError as err:
        raise CheckpointError(
            f"the recipe recorded in {str(checkpoint)!r}: {err.message}"
        ) from None
    if model.kind == "hf":
        config = read_config(model.hf)
        if config is None:
            raise CheckpointError(
                f"the run's model came from {model.hf!r}, whose config.json is gone; restore "
                "that directory (its config.json describes the architecture) and export again."
            )
        names = COPIED_FILES + (MODEL_TOKENIZER_FILES if run_tokenizer(recipe) == "model" else ())
        copied = [Path(model.hf) / name for name in names if (Path(model.hf) / name).is_file()]
        return config, None, copied
    if model.moe is not None:
        return hf_config_from_moe(model.moe), partial(moe_to_hf, model.moe), []
    if model.config is None:
        raise CheckpointError(
            f"the run's model is a factory ({model.factory!r}): meshtrain does not know its "
            "transformers architecture. Export it from Python with "
            "meshtrain.train.hf.export.export_hf(checkpoint, out, config=..., rename=...)."
        )
    return hf_config_from_llama(model.config), partial(llama_to_hf, model.config), []
