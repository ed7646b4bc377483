"""Recipes: one TOML file naming a model, a mesh, rules, parallel options and training settings.

A recipe is read once and validated whole against :mod:`meshtrain.recipes.schema` (one frozen
dataclass per section): an unknown section or key, or a value of the wrong type, is a
:class:`~meshtrain.RecipeError` naming the file, the ``section.key``, the value, what is allowed and
how to fix it. :func:`shrink` gives the same structure on a few CPU ranks, for ``meshtrain check``.
See ``docs/recipes.md``.

Example:
    >>> recipe = load_recipe("debug")
    >>> recipe.mesh_axes(), recipe.parallel.zero
    ({'dp': -1, 'tp': 2}, 3)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from meshtrain.errors import RecipeError
from meshtrain.models.llama import LlamaConfig, default_rules
from meshtrain.models.moe import MoEConfig
from meshtrain.models.moe import default_rules as moe_rules
from meshtrain.plan.options import PlanOptions
from meshtrain.plan.pipeline.schedule import Pipeline
from meshtrain.recipes.models import (
    AdaptedBuilder,
    FactoryBuilder,
    HFBuilder,
    LlamaBuilder,
    MoEBuilder,
    read_hf_config,
    resolve_factory,
)
from meshtrain.recipes.schema import (
    CheckpointSection,
    DataSection,
    LoggingSection,
    LoRASection,
    ModelSection,
    OptimizerName,
    ParallelSection,
    TrainSection,
    build_section,
    check_mesh,
    check_rules,
    check_sections,
    check_table,
    lora_section,
    model_section,
    parallel_section,
)
from meshtrain.recipes.sections import EvalSection, ProfileSection
from meshtrain.recipes.source import apply_overrides as apply_overrides  # re-exported
from meshtrain.recipes.source import named_directories, parse_recipe, read_recipe, recipe_name
from meshtrain.spec.partition import P
from meshtrain.spec.rules import Rules

if TYPE_CHECKING:  # the train layer imports DCP and DTensor: only when a recipe starts a run
    from meshtrain.train.checkpoint import CheckpointConfig
    from meshtrain.train.metrics import LoggingConfig

ModelBuilder = LlamaBuilder | MoEBuilder | FactoryBuilder | HFBuilder


@dataclass(frozen=True)
class OptimizerBuilder:
    """A picklable ``params -> Optimizer``: SGD (momentum 0.9), Adam, or AdamW (weight decay 0.1),
    Adam's ``betas`` and ``eps`` as the recipe gives them. Frozen parameters are left out (they
    have no gradient and get no state).

    Example:
        >>> OptimizerBuilder("adamw", 1e-3, betas=(0.9, 0.95))([nn.Parameter(torch.zeros(2))]).defaults["betas"]
        (0.9, 0.95)
    """

    name: OptimizerName
    lr: float
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    offload_states: bool = False

    def __call__(self, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        optimizer = self._build([param for param in params if param.requires_grad])
        if not self.offload_states:
            return optimizer
        from meshtrain.train.offload import offload_states

        return offload_states(optimizer)

    def _build(self, params: list[nn.Parameter]) -> torch.optim.Optimizer:
        if self.name == "sgd":
            return torch.optim.SGD(params, lr=self.lr, momentum=0.9)
        if self.name == "adam":
            return torch.optim.Adam(params, lr=self.lr, betas=self.betas, eps=self.eps)
        return torch.optim.AdamW(
            params, lr=self.lr, weight_decay=self.weight_decay, betas=self.betas, eps=self.eps
        )


@dataclass(frozen=True)
class Recipe:
    """A validated recipe; ``source`` is the file it came from (named in messages).

    Example:
        >>> recipe = recipe_from_toml('[model]\\npreset = "debug"\\n[mesh]\\ndp = -1\\n')
        >>> recipe.parallel.tp, recipe.parallel.fsdp, recipe.plan_options().zero
        ('', ('dp',), 3)
    """

    source: str
    model: ModelSection
    mesh: tuple[tuple[str, int], ...]
    parallel: ParallelSection = field(default_factory=ParallelSection)
    train: TrainSection = field(default_factory=TrainSection)
    explicit_rules: tuple[tuple[str, P], ...] | None = None
    data: DataSection = field(default_factory=DataSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    logging: LoggingSection = field(default_factory=LoggingSection)
    lora: LoRASection | None = None
    eval: EvalSection = field(default_factory=EvalSection)
    profile: ProfileSection = field(default_factory=ProfileSection)
    raw: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    @property
    def name(self) -> str:
        return recipe_name(self.source)

    @property
    def run_dir(self) -> Path:
        """``logging.run_dir``, by default ``runs/<recipe name>``."""
        return named_directories(self.logging.run_dir, self.checkpoint.dir, self.name)[0]

    @property
    def checkpoint_dir(self) -> Path:
        """``checkpoint.dir``, by default ``<run_dir>/checkpoints``."""
        return named_directories(self.logging.run_dir, self.checkpoint.dir, self.name)[1]

    def mesh_axes(self) -> dict[str, int]:
        """Axis → size, in order, as ``mt.make_mesh`` takes them (one may be -1)."""
        return dict(self.mesh)

    def build_model(
        self, device: str | torch.device = "cpu", seed: int = 0, *, adapters: bool = True
    ) -> nn.Module:
        """The model, initialised from ``seed`` (``device="meta"``: shapes only), with the
        ``[lora]`` adapters unless ``adapters=False`` (then :meth:`adapt` adds them, e.g. once
        base weights are loaded)."""
        return self.model_fn(seed=seed, device=str(torch.device(device)), adapters=adapters)()

    def adapt(self, model: nn.Module, seed: int = 0) -> nn.Module:
        """``model`` with the ``[lora]`` adapters (every other parameter frozen), or unchanged
        without a ``[lora]`` section."""
        builder = self.model_fn(seed=seed)
        return builder.adapt(model) if isinstance(builder, AdaptedBuilder) else model

    def model_fn(
        self, *, seed: int = 0, device: str = "cpu", adapters: bool = True
    ) -> ModelBuilder | AdaptedBuilder:
        """A picklable builder of the recipe's model (:mod:`meshtrain.recipes.models`)."""
        base = self._base_fn(seed=seed, device=device)
        if self.lora is None or not adapters:
            return base
        lora = self.lora
        return AdaptedBuilder(base, lora.rank, lora.alpha, lora.targets, lora.quantize_base, seed)

    def _base_fn(self, *, seed: int, device: str) -> ModelBuilder:
        model = self.model
        if model.factory:
            return FactoryBuilder(model.factory, seed, device)
        if model.hf:
            return HFBuilder(model.hf, seed, device)
        if model.moe is not None:
            return MoEBuilder(model.moe, seed, device)
        assert model.config is not None
        return LlamaBuilder(model.config, seed, device)

    def optimizer_fn(self) -> OptimizerBuilder:
        """The optimizer ``[train]`` names, with its hyper-parameters (a picklable builder)."""
        train = self.train
        return OptimizerBuilder(
            train.optimizer,
            train.lr,
            train.weight_decay,
            train.betas,
            train.eps,
            self.parallel.offload_optimizer,
        )

    def rules(self) -> Rules:
        """``[rules]`` as regex rules (plus the sequence rule under sequence parallelism), else
        the model's own: the Llama's logical-axis rules, a Hugging Face model's tensor-parallel
        plan (:meth:`Rules.from_hf`); a factory's model needs ``[rules]``. ``[parallel]
        context`` adds ``("seq", axis)`` (context parallelism)."""
        rules = self._rules()
        axis = self.parallel.context
        if not axis:
            return rules
        context = Rules(
            rules.patterns,
            logical=(("seq", axis), *rules.logical),
            fsdp=rules.fsdp,
            allow_unmatched=rules.allow_unmatched,
            allow_unused=rules.allow_unused,
            gathered=rules.gathered,
            generated=tuple(rules.generated),
        )
        context.notes = rules.notes  # what from_hf noted still holds
        return context

    def _rules(self) -> Rules:
        par = self.parallel
        tp = par.tp or None
        if self.explicit_rules is None and self.model.kind == "hf":
            return Rules.from_hf(
                self.build_model("meta", adapters=False),
                fsdp=par.fsdp,
                tp=tp or "tp",
                sequence_parallel=par.sequence_parallel and tp is not None,
            )
        if self.explicit_rules is None and self.model.kind == "factory":
            raise RecipeError(
                f"{self.source}: [model] factory {self.model.factory!r} needs [rules] (regex = "
                'spec string, first match wins), e.g. \'".*"\' = "P()" to replicate everything '
                "and shard with data parallelism only."
            )
        if self.explicit_rules is None and self.model.kind == "moe":  # experts over ep if any
            return moe_rules(
                tp=tp,
                fsdp=par.fsdp,
                ep=par.ep or None,
                sequence_parallel=par.sequence_parallel,
                expert_tp=par.expert_tp and tp is not None,
            )
        if self.explicit_rules is None:
            return default_rules(tp=tp, fsdp=par.fsdp, sequence_parallel=par.sequence_parallel)
        logical = (("seq", tp),) if par.sequence_parallel and tp else ()
        return Rules(self.explicit_rules, logical=logical, fsdp=par.fsdp)

    def example_inputs(self) -> torch.Tensor | None:
        """One batch as the recipe's data hand it to the model (token ids, ``[rows, seq_len]``)
        for the plan-time proof, for a factory's model (``[model] factory``: meshtrain cannot
        know its inputs); ``None`` for meshtrain's models and ``transformers`` ones, which take
        token ids the proof builds itself."""
        if self.model.factory is None:
            return None
        return torch.zeros(max(1, self.train.batch_size), self.train.seq_len, dtype=torch.long)

    def plan_options(self) -> PlanOptions:
        """The options of ``mt.plan`` besides the rules, the pipeline included:
        ``mt.plan(model, mesh, recipe.rules(), recipe.plan_options())``."""
        par, pipe, train = self.parallel, self.parallel.pipeline, self.train
        pipeline = None
        if pipe is not None:
            pipeline = Pipeline(
                axis=pipe.axis,
                schedule=pipe.schedule,
                microbatches=pipe.microbatches,
                stages_per_rank=pipe.stages_per_rank,
            )
        return PlanOptions(
            zero=par.zero,
            precision=par.precision,
            activation_checkpointing=par.activation_checkpointing,
            compile=par.compile,
            optimizer=train.optimizer,
            offload=par.offload,
            offload_optimizer=par.offload_optimizer,
            global_batch=train.batch_size,
            seq_len=train.seq_len,
            # the train step divides the loss by the global token count: gradients are summed
            grad_reduction="sum",
            microbatches=par.microbatches if pipe is None else 1,
            pipeline=pipeline,
            context_balance=par.context_balance,  # type: ignore[arg-type]  # checked by the schema
            context_method=par.context_method,  # type: ignore[arg-type]
        )

    def logging_config(self) -> LoggingConfig:
        """``[logging]``'s sinks as the train layer takes them (the run directory aside)."""
        from meshtrain.train.metrics import LoggingConfig

        log = self.logging
        return LoggingConfig(
            console=log.console,
            jsonl=log.jsonl,
            wandb=log.wandb,
            wandb_project=log.wandb_project,
            wandb_entity=log.wandb_entity or None,
            log_every=log.log_every,
        )

    def checkpoint_config(self) -> CheckpointConfig:
        """``[checkpoint]``'s saving as the train layer takes it (resuming and the files in and
        out are the recipe's run's)."""
        from meshtrain.train.checkpoint import CheckpointConfig

        checkpoint = self.checkpoint
        return CheckpointConfig(
            directory=self.checkpoint_dir,
            interval=checkpoint.interval,
            keep_last=checkpoint.keep_last,
            async_save=checkpoint.async_save,
        )


def load_recipe(path_or_name: str | Path, overrides: Sequence[str] = ()) -> Recipe:
    """Read a recipe from a path, or a bare name as ``recipes/<name>.toml`` under the current
    directory, then under the repository root; ``overrides`` are ``section.key=value`` strings
    (``--set``), applied before validation.

    Example:
        >>> load_recipe("llama3_8b").model.config.n_layers
        32
        >>> load_recipe("debug", ["train.steps=50", "data.source=synthetic"]).train.steps
        50
    """
    text, source = read_recipe(path_or_name)
    return recipe_from_toml(text, source=source, overrides=overrides)


def recipe_from_toml(text: str, source: str = "<string>", overrides: Sequence[str] = ()) -> Recipe:
    """Validate recipe text; ``source`` names it in errors (see :func:`load_recipe`)."""
    data, source = parse_recipe(text, source, overrides)
    return recipe_from_data(data, source)


def recipe_from_data(data: dict[str, Any], source: str = "<data>") -> Recipe:
    """Validate a parsed recipe (the dict a run records in its checkpoints, ``Recipe.raw``)."""
    check_sections(source, data)
    mesh = check_mesh(source, data["mesh"])
    model = model_section(source, data["model"])
    hf_config = read_hf_config(model.hf) if model.hf else {}  # before any rank starts
    if model.factory:
        resolve_factory(model.factory)
    train = _train_section(source, check_table(source, "train", data.get("train", {})))
    _check_seq_len(source, model, hf_config, train)
    return Recipe(
        source=source,
        model=model,
        mesh=mesh,
        parallel=parallel_section(source, data.get("parallel", {}), dict(mesh)),
        train=train,
        explicit_rules=check_rules(source, data["rules"]) if "rules" in data else None,
        data=build_section(DataSection, check_table(source, "data", data.get("data", {}))),
        checkpoint=build_section(
            CheckpointSection, check_table(source, "checkpoint", data.get("checkpoint", {}))
        ),
        logging=build_section(
            LoggingSection, check_table(source, "logging", data.get("logging", {}))
        ),
        lora=lora_section(source, data["lora"]) if "lora" in data else None,
        eval=build_section(EvalSection, check_table(source, "eval", data.get("eval", {}))),
        profile=build_section(
            ProfileSection, check_table(source, "profile", data.get("profile", {}))
        ),
        raw=data,
    )


def _check_seq_len(
    source: str, model: ModelSection, hf_config: dict[str, Any], train: TrainSection
) -> None:
    """``train.seq_len`` within the positions the model covers (Llama's rotary tables, an HF
    config's ``max_position_embeddings``); a factory's model is checked when it is built."""
    if model.config is not None or model.moe is not None:
        config = model.config or model.moe
        limit, where = config.max_seq_len, f"preset {model.preset!r}"  # type: ignore[union-attr]
        name, fix = "max_seq_len", "model.max_seq_len"
    elif isinstance(hf_config.get("max_position_embeddings"), int):
        limit, where = hf_config["max_position_embeddings"], f"{model.hf}/config.json"
        name, fix = "max_position_embeddings", "max_position_embeddings in that config.json"
    else:
        return
    if train.seq_len > limit:
        raise RecipeError(
            f"{source}: train.seq_len = {train.seq_len} is longer than the model's {name} = "
            f"{limit} ({where}). Lower train.seq_len, or raise {fix} to {train.seq_len}."
        )


def _train_section(source: str, values: dict[str, Any]) -> TrainSection:
    """``[train]`` with its schedule consistent: ``min_lr`` ≤ ``lr`` (a warmup longer than the
    run is a ramp over the whole run: see :class:`~meshtrain.train.schedule.WarmupCosine`)."""
    train = build_section(TrainSection, values)
    if train.min_lr > train.lr:
        raise RecipeError(
            f"{source}: train.min_lr = {train.min_lr} is above train.lr = {train.lr}; the cosine "
            "decays from lr down to min_lr. Set min_lr ≤ lr."
        )
    return train


# ----------------------------------------------------------------------------- shrink


def shrink(recipe: Recipe, world: int) -> Recipe:
    """The same structure on ``world`` CPU ranks, small enough for ``meshtrain check``.

    Mesh: axes keep their names and order. First every axis the recipe uses (size ≠ 1) gets the
    smallest factor of the ranks left (2 for powers of two), in this order: the axes a plan cannot
    do without (the pipeline axis; under bf16/fp16 also the first data axis, since low precision
    is lowered through FSDP), then the tensor-parallel axis, then the other data axes. Then the
    tensor-parallel axis grows towards its recipe size, then the pipeline axis, by the factors
    left; the first data axis takes the rest; every other axis is 1. A world too small to give
    a needed axis 2 ranks, or ranks left with no data axis to take them, is a RecipeError.

    Model: a factory's or Hugging Face directory's model is kept as it is (it is the user's to
    make small); meshtrain's Llama becomes a Llama of the same structure: ``n_layers = max(2, pipeline stages)``, ``head_dim``
    16, ``n_heads = max(4, 2·tp)``, ``n_kv_heads`` divisible by tp and as close to the recipe's
    query/kv ratio as that allows, vocab 256, ``multiple_of`` 32, no ffn multiplier,
    ``max_seq_len`` ≥ ``seq_len``; ``[lora]`` is kept (the same module names), its NF4 base
    dense (NF4 quantizes whole 16,384-element blocks, more than the shrunk weights hold). Options,
    rules and the optimizer are kept; micro-batches are
    capped (2 without a pipeline, one per stage with one); ``seq_len`` ≤ 16 (a multiple of tp
    under sequence parallelism); ``batch_size`` the smallest multiple of data ranks ×
    micro-batches that is ≥ min(recipe batch, 8); ``steps`` ≤ 3.

    Example:
        >>> small = shrink(load_recipe("llama3_8b"), 4)
        >>> small.mesh_axes(), small.model.config.dim, small.train.batch_size
        ({'dp': 2, 'tp': 2}, 64, 8)
    """
    sizes = _shrink_mesh(recipe, world)
    par, pipe = recipe.parallel, recipe.parallel.pipeline
    tp = sizes[par.tp] if par.tp else 1
    stages = sizes[pipe.axis] * pipe.stages_per_rank if pipe is not None else 1
    seq_len = min(recipe.train.seq_len, 16)
    if par.sequence_parallel:
        seq_len = -(-seq_len // tp) * tp
    model = recipe.model
    if model.config is not None:
        model = dataclasses.replace(model, config=_small_llama(model.config, tp, stages, seq_len))
    if model.moe is not None:
        ep = sizes[par.ep] if par.ep else 1
        model = dataclasses.replace(model, moe=_small_moe(model.moe, ep, stages, seq_len))
    if pipe is not None:
        micro = min(pipe.microbatches or stages, stages)
        pipe = dataclasses.replace(pipe, microbatches=micro)
        par = dataclasses.replace(par, pipeline=pipe)
    else:
        micro = min(par.microbatches, 2)
        par = dataclasses.replace(par, microbatches=micro)
    per_step = math.prod(sizes[axis] for axis in par.fsdp) * micro
    batch = -(-min(recipe.train.batch_size, 8) // per_step) * per_step
    train = dataclasses.replace(
        recipe.train,
        batch_size=batch,
        seq_len=seq_len,
        steps=min(recipe.train.steps, 3),
        warmup_steps=min(recipe.train.warmup_steps, recipe.train.steps, 3),
    )
    adapters = recipe.lora
    if adapters is not None and adapters.quantize_base and model.config is not None:
        adapters = dataclasses.replace(adapters, quantize_base="")
    return dataclasses.replace(
        recipe,
        model=model,
        mesh=tuple(sizes.items()),
        parallel=par,
        train=train,
        lora=adapters,
    )


def _small_llama(config: LlamaConfig, tp: int, stages: int, seq_len: int) -> LlamaConfig:
    """The shrunk Llama of :func:`shrink`'s docstring."""
    n_heads = max(4, 2 * tp)
    target = n_heads * config.n_kv_heads / config.n_heads
    kv_choices = [d for d in range(tp, n_heads + 1, tp) if n_heads % d == 0]
    n_kv_heads = max((d for d in kv_choices if d <= target), default=kv_choices[0])
    return LlamaConfig(
        dim=16 * n_heads,
        n_layers=max(2, stages),
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        vocab_size=-(-256 // tp) * tp,
        multiple_of=math.lcm(32, tp),
        norm_eps=config.norm_eps,
        rope_theta=config.rope_theta,
        max_seq_len=max(64, seq_len),
    )


def _small_moe(config: MoEConfig, ep: int, stages: int, seq_len: int) -> MoEConfig:
    """The shrunk mixture of experts: :meth:`MoEConfig.debug` with the recipe's routing
    (scores, balance, top-k up to 2) and enough experts for ``ep`` ranks (at least 2 each)."""
    return MoEConfig.debug(
        n_layers=max(2 + min(config.first_dense_layers, 1), stages),
        n_experts=ep * max(2, -(-8 // ep)),
        top_k=min(config.top_k, 2),
        first_dense_layers=min(config.first_dense_layers, 1),
        n_shared_experts=min(config.n_shared_experts, 1),
        score_func=config.score_func,
        norm_topk_prob=config.norm_topk_prob,
        balance=config.balance,
        qk_norm=config.qk_norm,
        max_seq_len=max(64, seq_len),
    )


def _shrink_mesh(recipe: Recipe, world: int) -> dict[str, int]:
    """Axis sizes for ``world`` ranks (the rule is in :func:`shrink`'s docstring)."""
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise RecipeError(f"world={world!r}: give a positive number of ranks.")
    original, par = recipe.mesh_axes(), recipe.parallel
    data = list(par.fsdp)
    needed = {par.pipeline.axis: "a pipeline"} if par.pipeline is not None else {}
    if par.precision != "fp32" and data:
        needed[data[0]] = f"{par.precision} (lowered through FSDP over a data axis)"
    least = 2 ** len(needed)
    if world == 1:  # one rank: low precision needs no data axis
        needed = {axis: why for axis, why in needed.items() if axis not in data}
    expert = par.ep if recipe.model.kind == "moe" else ""
    order = [*needed, *(axis for axis in (par.tp, expert, *data) if axis and axis not in needed)]
    sizes = dict.fromkeys(original, 1)
    left = world

    def grow(axis: str, times: float) -> None:
        nonlocal left
        while times > 0 and left > 1:
            factor = min(f for f in range(2, left + 1) if left % f == 0)
            cap = original[axis] if original[axis] > 0 else math.inf
            if sizes[axis] * factor > cap:
                return
            sizes[axis] *= factor
            left //= factor
            times -= 1

    for axis in order:
        grow(axis, 1 if original[axis] != 1 else 0)
    for axis in (par.tp, par.pipeline.axis if par.pipeline is not None else "", expert):
        if axis:
            grow(axis, math.inf)
    short = [f"'{axis}' ≥ 2 for {why}" for axis, why in needed.items() if sizes[axis] < 2]
    if short:
        raise RecipeError(
            f"{recipe.source}: on {world} rank(s) the shrunk recipe cannot keep "
            f"{' and '.join(short)}; use a world of at least {least} ranks (--world {least})."
        )
    if left > 1:
        if not data:
            raise RecipeError(
                f"{recipe.source}: {left} of {world} ranks are left over with no data axis to "
                f"take them (mesh {_format_mesh(sizes)}, parallel.fsdp empty). Use a smaller world "
                "or add a data axis."
            )
        sizes[data[0]] *= left
    return sizes


def describe_shrink(recipe: Recipe, small: Recipe) -> str:
    """One line: the recipe's mesh and model next to the shrunk ones.

    Example:
        >>> recipe = load_recipe("debug")
        >>> describe_shrink(recipe, shrink(recipe, 2))
        'debug: mesh {dp: -1, tp: 2} → {dp: 1, tp: 2}; Llama 131.4K → 131.4K parameters (2 layers, dim 64, 4 heads, 2 kv heads); batch 8 × 16 tokens in 1 micro-batch'
    """
    pipe = small.parallel.pipeline
    micro = (pipe.microbatches or 1) if pipe is not None else small.parallel.microbatches
    before, after = recipe.model.config, small.model.config
    moe, small_moe = recipe.model.moe, small.model.moe
    if moe is not None and small_moe is not None:
        model = (
            f"MoE {_count(moe.num_params())} → {_count(small_moe.num_params())} parameters "
            f"({small_moe.n_layers} layers, dim {small_moe.dim}, {small_moe.n_experts} experts, "
            f"top-{small_moe.top_k})"
        )
    elif before is None or after is None:
        model = f"{small.model.kind} {small.model.factory or small.model.hf!r} (kept as it is)"
    else:
        model = (
            f"Llama {_count(before.num_params())} → {_count(after.num_params())} parameters "
            f"({after.n_layers} layers, dim {after.dim}, {after.n_heads} heads, "
            f"{_plural(after.n_kv_heads, 'kv head')})"
        )
    if small.lora is not None:
        dense = (
            " on a dense base"
            if recipe.lora and recipe.lora.quantize_base and not small.lora.quantize_base
            else ""
        )
        model += f", LoRA rank {small.lora.rank}{dense}"
    return (
        f"{recipe.name}: mesh {_format_mesh(recipe.mesh_axes())} → "
        f"{_format_mesh(small.mesh_axes())}; {model}; batch {small.train.batch_size} × "
        f"{small.train.seq_len} tokens in {_plural(micro, 'micro-batch', 'es')}"
    )


def _plural(count: int, noun: str, ending: str = "s") -> str:
    return f"{count} {noun}{ending if count != 1 else ''}"


def _format_mesh(sizes: dict[str, int]) -> str:
    return "{" + ", ".join(f"{axis}: {size}" for axis, size in sizes.items()) + "}"


def _count(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.{2 if unit == 'B' else 1}f}{unit}"
    return str(n)
