"""The model a recipe names: meshtrain's Llama (``[model] preset``), a factory of the user's
(``[model] factory = "package.module:function"``) or a local Hugging Face ``transformers``
model directory (``[model] hf = "DIR"``: the architecture from its ``config.json``, built from
the config — nothing is downloaded; the weights come from ``[checkpoint] init_from``).

Each builder is a picklable ``() -> nn.Module`` seeded the same on every rank (initialise once,
on full tensors), with what the runtime needs to know of the model: its vocabulary (for data)
and its training FLOPs per token (for MFU).

Example:
    >>> builder = FactoryBuilder("torch.nn:Identity")
    >>> type(builder()).__name__
    'Identity'
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from meshtrain.adapters import lora
from meshtrain.errors import RecipeError
from meshtrain.models.llama import LlamaConfig, build_llama, llama_flops_per_token
from meshtrain.models.moe import MoEConfig, build_moe
from meshtrain.recipes.model_check import check_model_type


@dataclass(frozen=True)
class LlamaBuilder:
    """A picklable ``() -> Llama``, so ranks can rebuild the same seeded model.

    Example:
        >>> LlamaBuilder(LlamaConfig.debug())().config.n_layers
        2
    """

    config: LlamaConfig
    seed: int = 0
    device: str = "cpu"

    def __call__(self) -> nn.Module:
        return build_llama(self.config, seed=self.seed, device=self.device)


@dataclass(frozen=True)
class MoEBuilder:
    """A picklable ``() -> MoE`` (meshtrain's mixture of experts), seeded like the Llama's.

    Example:
        >>> MoEBuilder(MoEConfig.debug())().config.n_experts
        8
    """

    config: MoEConfig
    seed: int = 0
    device: str = "cpu"

    def __call__(self) -> nn.Module:
        return build_moe(self.config, seed=self.seed, device=self.device)


@dataclass(frozen=True)
class AdaptedBuilder:
    """A picklable ``() -> model`` with LoRA adapters: ``base()``, then
    :func:`~meshtrain.adapters.lora` with the recipe's ``[lora]`` (``lora_A`` drawn from
    ``seed``, the same on every rank).

    Example:
        >>> builder = AdaptedBuilder(LlamaBuilder(LlamaConfig.debug()), 4, 8.0, (".*wq",))
        >>> sorted({n.rsplit(".", 1)[-1] for n, p in builder().named_parameters() if p.requires_grad})
        ['lora_A', 'lora_B']
    """

    base: Any
    rank: int
    alpha: float
    targets: tuple[str, ...]
    quantize_base: str = ""
    seed: int = 0

    def __call__(self) -> nn.Module:
        return self.adapt(self.base())

    def adapt(self, model: nn.Module) -> nn.Module:
        """Adapters on ``model`` (already built, e.g. with base weights loaded)."""
        generator = torch.Generator().manual_seed(self.seed)
        return lora(
            model,
            rank=self.rank,
            alpha=self.alpha,
            targets=list(self.targets),
            quantize_base=self.quantize_base or None,
            generator=generator,
        )


@dataclass(frozen=True)
class FactoryBuilder:
    """``package.module:function`` called with no arguments (under ``device`` and ``seed``)."""

    target: str
    seed: int = 0
    device: str = "cpu"

    def __call__(self) -> nn.Module:
        function = resolve_factory(self.target)
        torch.manual_seed(self.seed)
        with torch.device(self.device):
            model = function()
        if not isinstance(model, nn.Module):
            raise RecipeError(
                f"[model] factory {self.target!r} returned a {type(model).__name__}, not an "
                "nn.Module; point it at a function that builds the model."
            )
        return model


@dataclass(frozen=True)
class HFBuilder:
    """A ``transformers`` model built from the ``config.json`` of a local directory: the class
    its ``architectures`` names, random weights from ``seed`` as :func:`~meshtrain.materialise`
    gives them (load real ones with ``[checkpoint] init_from``), the key-value cache off
    (training)."""

    directory: str
    seed: int = 0
    device: str = "cpu"

    def __call__(self) -> nn.Module:
        transformers = _transformers(self.directory)
        check_model_type(self.directory, f"[model] hf = {self.directory!r}")
        config = transformers.AutoConfig.from_pretrained(self.directory, local_files_only=True)
        config.use_cache = False
        names = getattr(config, "architectures", None) or []
        cls = getattr(transformers, names[0], None) if names else None
        if cls is None:
            raise RecipeError(
                f"[model] hf {self.directory!r}: config.json names architectures {names}, none of "
                f'which transformers {transformers.__version__} has. Set "architectures" to a '
                'model class (e.g. ["LlamaForCausalLM"]).'
            )
        with torch.device("meta"):
            model = cls(config)
        if self.device == "meta":
            return model
        from meshtrain.lower.materialise import materialise  # DTensor: when a model is built

        # the values mt.materialise gives the same model started on the meta device
        return materialise(model, device=self.device, seed=self.seed)


def resolve_factory(target: str) -> Any:
    """The callable ``package.module:function`` names, or a RecipeError saying what is wrong."""
    module_name, _, attribute = target.partition(":")
    if not module_name or not attribute:
        raise RecipeError(
            f"[model] factory {target!r} is not 'package.module:function'; e.g. "
            'factory = "my_models:tiny_cnn" (the module importable from the working directory).'
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise RecipeError(
            f"[model] factory {target!r}: cannot import {module_name!r} ({err}). Run from the "
            "directory that holds it, or put it on PYTHONPATH."
        ) from None
    function = getattr(module, attribute, None)
    if not callable(function):
        raise RecipeError(
            f"[model] factory {target!r}: module {module_name!r} has no callable {attribute!r}."
        )
    return function


def read_hf_config(directory: str) -> dict[str, Any]:
    """``config.json`` of a local model directory, checked to exist and to name an
    architecture (RecipeError otherwise)."""
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise RecipeError(
            f"[model] hf {directory!r} has no config.json: give a local transformers model "
            "directory (save_pretrained writes one); nothing is downloaded."
        )
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise RecipeError(f"[model] hf: {str(path)!r} is not readable JSON ({err}).") from None
    if not config.get("architectures"):
        raise RecipeError(
            f'[model] hf: {str(path)!r} names no "architectures" (e.g. ["LlamaForCausalLM"]); '
            "meshtrain builds the class it names."
        )
    return dict(config)


def vocab_size(model: nn.Module) -> int | None:
    """The vocabulary a token model reads: its config's, else its first embedding's."""
    size = getattr(getattr(model, "config", None), "vocab_size", None)
    if isinstance(size, int):
        return size
    embedding = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    return embedding.num_embeddings if embedding is not None else None


def flops_per_token(model: nn.Module, seq_len: int) -> float:
    """Training FLOPs per token, ``6·N + 12·L·d·s`` (PaLM's convention): ``N`` the parameters
    outside embeddings, ``L``/``d`` the config's layers and hidden size when it has them (for
    the attention term), for meshtrain's Llama its exact formula."""
    config = getattr(model, "config", None)
    if isinstance(config, LlamaConfig):
        return llama_flops_per_token(config, seq_len)
    if isinstance(config, MoEConfig):  # only the experts a token is routed to compute
        active = config.num_active_params() - config.vocab_size * config.dim  # embedding
        return float(6 * active + 12 * config.n_layers * config.dim * seq_len)
    embedded = {
        id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()
    }
    matmul = sum(p.numel() for p in model.parameters() if id(p) not in embedded)
    layers = getattr(config, "num_hidden_layers", 0) or 0
    width = getattr(config, "hidden_size", 0) or 0
    return float(6 * matmul + 12 * layers * width * seq_len)


def _transformers(directory: str) -> Any:
    # transformers imports torchao when it is installed, and torchao logs a line per compiled
    # extension this machine cannot load: import it first, quietly (once per process)
    from meshtrain.adapters.nf4 import torchao_nf4

    torchao_nf4()
    try:
        return importlib.import_module("transformers")
    except ImportError:
        raise RecipeError(
            f"[model] hf {directory!r} needs the transformers package: pip install 'meshtrain[hf]'."
        ) from None
