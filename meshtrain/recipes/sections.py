"""The recipe's sections, each one frozen dataclass: every key a field with its type, default,
one-line doc and example. This is the only place a recipe key is declared; the key tables, the
section list, ``--set``, "did you mean" and ``docs/recipes.md``'s key reference are derived from
it (:mod:`meshtrain.recipes.schema`). Adding a key is one field here.

Closed choices are ``Literal`` types; where a lower layer owns the vocabulary (precision,
checkpointing modes and ZeRO stages in :mod:`meshtrain.plan.options`, pipeline schedules,
``on_nonfinite`` in :mod:`meshtrain.train.step`, wandb modes in
:mod:`meshtrain.train.metrics.config`), the field reuses that one definition. Those are imported
only for type checking and resolved when the schema first checks a recipe, so this module (and
the launcher's first checks) imports no torch.

Example:
    >>> TrainSection().on_nonfinite, SECTION_NAMES[:4]
    ('skip', ('model', 'mesh', 'parallel', 'parallel.pipeline'))
"""

from __future__ import annotations

import dataclasses
import importlib
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from meshtrain.models.llama import LlamaConfig
    from meshtrain.models.moe import MoEConfig
    from meshtrain.plan.options import Checkpointing, Precision, ZeroStage
    from meshtrain.train.data.documents import DocumentFormat
    from meshtrain.train.guard import OnNonFinite
    from meshtrain.train.metrics.config import WandbMode
    from meshtrain.train.schedule import Decay

__all__ = [
    "RECIPE_SECTIONS",
    "SECTION_NAMES",
    "SECTION_TYPES",
    "TOP_SECTIONS",
    "CheckpointSection",
    "DataSection",
    "EvalSection",
    "FreeForm",
    "LoRASection",
    "LoggingSection",
    "ModelSection",
    "ParallelSection",
    "PipelineSection",
    "ProfileSection",
    "TrainSection",
    "about",
    "lazy",
    "resume_rule",
]

#: The optimizers a recipe builds (:class:`meshtrain.recipes.OptimizerBuilder`).
OptimizerName = Literal["sgd", "adam", "adamw"]
#: Where a recipe's tokens come from (:func:`meshtrain.recipes.run.train`).
DataSource = Literal["corpus", "synthetic", "tokens", "jsonl", "text", "parquet", "hf-dataset"]
#: How LoRA stores the adapted base weights: as they are ("") or in 4-bit NF4 (QLoRA).
QuantizeBase = Literal["", "nf4"]
Bound = Literal["positive", "nonnegative"]
#: Whether a resume may change a key: ``safe`` (the same training: the step count, logging, the
#: checkpoint schedule, evaluation, profiling, the mesh and the parallel layout, which DCP
#: reshards) or ``refuse`` (what training means: the model, data, batch, sequence, seeds, the
#: optimizer, precision, adapters; ``--allow-change KEY`` resumes with it on purpose).
Resume = Literal["safe", "refuse"]


def lazy(module: str, name: str) -> Callable[[], Any]:
    """``module.name``, imported when called (a vocabulary or class of a layer that loads torch).

    Example:
        >>> lazy("meshtrain.errors", "RecipeError")().__name__
        'RecipeError'
    """
    return lambda: getattr(importlib.import_module(module), name)


def about(
    doc: str,
    example: Any,
    *,
    bound: Bound | None = None,
    choices: tuple[Any, ...] | Callable[[], tuple[Any, ...]] = (),
    toml: str = "",
    shown: str = "",
    keys_from: Callable[[], type] | None = None,
    subsection: type | None = None,
    resume: Resume,
) -> dict[str, Any]:
    """A recipe key's metadata (``dataclasses.field(default=..., metadata=about(..., resume="refuse"))``): what the
    schema needs besides the field's type and default — a one-line ``doc`` (Markdown), an ``example`` value as TOML writes it, a ``bound``
    (``positive``: > 0, and an array non-empty; ``nonnegative``: ≥ 0), ``choices`` where the type
    is ``str`` (a tuple, or a function returning a lower layer's tuple), the ``toml`` name when
    it is not the field's, the default as the docs ``shown`` it, ``keys_from`` (a dataclass whose
    fields are the keys instead of this one), ``subsection`` (the dataclass of a table of its
    own, ``[parallel.pipeline]``) and, required, whether a ``resume`` may change it
    (:data:`Resume`).

    Example:
        >>> dataclasses.fields(PipelineSection)[0].metadata["doc"]
        'the mesh axis the stages are laid along'
    """
    return {
        "doc": doc,
        "example": example,
        "bound": bound,
        "choices": choices,
        "toml": toml,
        "shown": shown,
        "keys_from": keys_from,
        "subsection": subsection,
        "resume": resume,
    }


_LLAMA_CONFIG = lazy("meshtrain.models.llama", "LlamaConfig")
_MOE_CONFIG = lazy("meshtrain.models.moe", "MoEConfig")


def _presets() -> tuple[str, ...]:
    """The Llama's presets, then the mixture of experts' (``debug`` is both models')."""
    llama = lazy("meshtrain.models.llama", "_PRESETS")()
    moe = lazy("meshtrain.models.moe_presets", "MOE_PRESETS")()
    return (*llama, *(name for name in moe if name not in llama))


@dataclass(frozen=True)
class ModelSection:
    """``[model]``: meshtrain's Llama or its mixture of experts (``name = "moe"``; ``preset`` and
    config overrides), a ``factory`` (``"package.module:function"``) or a local Hugging Face
    directory (``hf``). ``config`` is the Llama's, ``moe`` the mixture of experts' (None for the
    others)."""

    name: str = field(
        default="llama",
        metadata=about(
            "meshtrain's Llama, or its mixture of experts ([MoE](moe.md))",
            "llama",
            choices=("llama", "moe"),
            resume="refuse",
        ),
    )
    preset: str = field(
        default="debug",
        metadata=about(
            "`LlamaConfig.preset(name)`, or for `moe` `moe_preset(name)`",
            "debug",
            choices=_presets,
            resume="refuse",
        ),
    )
    config: LlamaConfig | None = field(
        default=None, metadata=about("", 2, keys_from=_LLAMA_CONFIG, resume="refuse")
    )
    moe: MoEConfig | None = field(
        default=None, metadata=about("", 2, keys_from=_MOE_CONFIG, resume="refuse")
    )
    factory: str = field(
        default="",
        metadata=about(
            "instead of the Llama: a function returning an `nn.Module`, imported from the working "
            "directory, called under the recipe's seed; needs `[rules]`",
            "my_models:tiny_cnn",
            shown="—",
            resume="refuse",
        ),
    )
    hf: str = field(
        default="",
        metadata=about(
            "instead of the Llama: a local `transformers` model directory, built from its "
            "`config.json` (the class `architectures` names; nothing downloaded); without `[rules]`, "
            "`Rules.from_hf` ([bring your own model](bring-your-own-model.md))",
            "models/tiny-llama",
            shown="—",
            resume="refuse",
        ),
    )
    meta_init: bool = field(
        default=True,
        metadata=about(
            "start on the meta device: each rank allocates and initialises only its own shards "
            "(`mt.materialise`); `false` builds the full model on every rank first (for a factory "
            "model whose tensors no `reset_parameters()` sets)",
            False,
            resume="safe",
        ),
    )

    @property
    def kind(self) -> str:
        """'llama', 'moe', 'factory' or 'hf'."""
        return "factory" if self.factory else "hf" if self.hf else self.name


@dataclass(frozen=True)
class PipelineSection:
    """``[parallel.pipeline]``: the arguments of :class:`~meshtrain.Pipeline`."""

    axis: str = field(
        default="pp", metadata=about("the mesh axis the stages are laid along", "pp", resume="safe")
    )
    schedule: str = field(
        default="1F1B",
        metadata=about(
            "see [pipeline parallelism](pipeline.md)",
            "1F1B",
            choices=lazy("meshtrain.plan.options", "SCHEDULES"),
            resume="safe",
        ),
    )
    microbatches: int | None = field(
        default=None,
        metadata=about(
            "micro-batches per step", 8, bound="positive", shown="one per stage", resume="safe"
        ),
    )
    stages_per_rank: int = field(
        default=1,
        metadata=about("virtual stages per pipeline rank", 2, bound="positive", resume="safe"),
    )


@dataclass(frozen=True)
class ParallelSection:
    """``[parallel]``: data-parallel stage and axes, tensor/sequence/pipeline parallelism, compute."""

    zero: ZeroStage = field(
        default=3,
        metadata=about("data-parallel stage (see [the planner](plan.md))", 3, resume="safe"),
    )
    fsdp: tuple[str, ...] = field(
        default=("dp",),
        metadata=about(
            "data axes FSDP shards over (two: HSDP)",
            ["dp"],
            shown='`["dp"]` if the mesh has `dp`',
            resume="safe",
        ),
    )
    tp: str = field(
        default="tp",
        metadata=about(
            'the tensor-parallel axis; `""` for none',
            "tp",
            shown='`"tp"` if the mesh has `tp`, else `""`',
            resume="safe",
        ),
    )
    sequence_parallel: bool = field(
        default=False, metadata=about('add the `("seq", tp)` activation rule', True, resume="safe")
    )
    expert_tp: bool = field(
        default=False,
        metadata=about(
            "split each expert of meshtrain's MoE inside over `tp` too (its intermediate "
            "features; [mixture of experts](moe.md)); transformers models follow their own "
            "`moe_tp_experts` plan",
            True,
            resume="safe",
        ),
    )
    ep: str = field(
        default="ep",
        metadata=about(
            "the expert-parallel axis of meshtrain's mixture of experts: each rank holds its "
            'share of every layer\'s experts ([mixture of experts](moe.md)); `""` for none',
            "ep",
            shown='`"ep"` if the mesh has `ep`, else `""`',
            resume="safe",
        ),
    )
    context: str = field(
        default="",
        metadata=about(
            'the context-parallel axis: adds the `("seq", axis)` activation rule, each rank '
            'holding a share of every sequence ([long context](long-context.md)); `""` for none',
            "cp",
            resume="safe",
        ),
    )
    context_balance: str = field(
        default="headtail",
        metadata=about(
            "which chunks of a sequence a context rank holds (head-tail: equal causal work)",
            "headtail",
            choices=lambda: typing.get_args(lazy("meshtrain.plan.options", "ContextBalance")()),
            resume="safe",
        ),
    )
    context_method: str = field(
        default="ring",
        metadata=about(
            "how attention meets the other context ranks' keys and values",
            "ring",
            choices=lambda: typing.get_args(lazy("meshtrain.plan.options", "ContextMethod")()),
            resume="safe",
        ),
    )
    activation_checkpointing: Checkpointing = field(
        default="none", metadata=about("see [compute](compute.md)", "selective", resume="safe")
    )
    compile: bool = field(
        default=False, metadata=about("`torch.compile` each block", True, resume="safe")
    )
    precision: Precision = field(
        default="fp32",
        metadata=about("compute dtype (master weights stay fp32)", "bf16", resume="refuse"),
    )
    microbatches: int = field(
        default=1,
        metadata=about(
            "gradient accumulation without a pipeline", 2, bound="positive", resume="safe"
        ),
    )
    pipeline: PipelineSection | None = field(
        default=None,
        metadata=about("pipeline parallelism", {}, subsection=PipelineSection, resume="safe"),
    )
    offload: bool = field(
        default=False,
        metadata=about(
            "FSDP2's CPU offload: parameters, gradients and optimizer "
            "states on the host (needs `zero` ≥ 1)",
            True,
            resume="safe",
        ),
    )
    offload_optimizer: bool = field(
        default=False,
        metadata=about(
            "only the optimizer states on the host ([LoRA and "
            "QLoRA](lora.md#optimizer-state-offload))",
            True,
            resume="safe",
        ),
    )


@dataclass(frozen=True)
class TrainSection:
    """``[train]``: global sequences per step, tokens per sequence, optimizer and its schedule
    (linear warmup over ``warmup_steps``, a cosine or linear ``decay`` to ``min_lr`` at
    ``steps``), clipping, seed,
    what a non-finite loss does (``skip`` its update or ``stop``) and how many skipped steps end
    the run (``max_consecutive_skips`` in a row, ``max_total_skips`` in all; 0: no bound)."""

    batch_size: int = field(
        default=8,
        metadata=about(
            "sequences per optimizer step, over all data ranks",
            8,
            bound="positive",
            resume="refuse",
        ),
    )
    seq_len: int = field(
        default=16, metadata=about("tokens per sequence", 16, bound="positive", resume="refuse")
    )
    optimizer: OptimizerName = field(
        default="adamw",
        metadata=about("SGD with momentum 0.9, Adam or AdamW", "adamw", resume="refuse"),
    )
    lr: float = field(
        default=1e-3, metadata=about("peak learning rate", 1e-3, bound="positive", resume="refuse")
    )
    decay: Decay = field(
        default="cosine",
        metadata=about(
            "the rate's fall from `lr` to `min_lr` after warmup: cosine or linear",
            "cosine",
            resume="refuse",
        ),
    )
    min_lr: float = field(
        default=0.0,
        metadata=about(
            "the decay's floor, reached at `steps` (≤ `lr`)",
            1e-4,
            bound="nonnegative",
            resume="refuse",
        ),
    )
    warmup_steps: int = field(
        default=0,
        metadata=about(
            "linear warmup to `lr` (longer than `steps`: the rate ramps the whole run)",
            10,
            bound="nonnegative",
            resume="refuse",
        ),
    )
    steps: int = field(
        default=3, metadata=about("optimizer steps", 3, bound="positive", resume="safe")
    )
    weight_decay: float = field(
        default=0.1,
        metadata=about("AdamW's decoupled weight decay", 0.1, bound="nonnegative", resume="refuse"),
    )
    max_norm: float = field(
        default=1.0,
        metadata=about(
            "clip gradients to this global norm", 1.0, bound="positive", resume="refuse"
        ),
    )
    seed: int = field(
        default=0,
        metadata=about("the model's initialisation", 0, bound="nonnegative", resume="refuse"),
    )
    betas: tuple[float, float] = field(
        default=(0.9, 0.999),
        metadata=about(
            "Adam's and AdamW's (β1, β2); the 70B and 405B recipes use `[0.9, 0.95]`",
            [0.9, 0.95],
            resume="refuse",
        ),
    )
    eps: float = field(
        default=1e-8,
        metadata=about("Adam's and AdamW's ε", 1e-8, bound="positive", resume="refuse"),
    )
    on_nonfinite: OnNonFinite = field(
        default="skip",
        metadata=about(
            "a non-finite loss or gradient norm drops the step's update, or stops every rank",
            "skip",
            resume="safe",
        ),
    )
    max_consecutive_skips: int = field(
        default=10,
        metadata=about(
            "more skipped steps in a row end the run with a `TrainingError` ([reliability]"
            "(reliability.md#a-non-finite-guard-that-cannot-finish-a-ruined-run))",
            10,
            bound="positive",
            resume="safe",
        ),
    )
    max_total_skips: int = field(
        default=100,
        metadata=about(
            "more skipped steps over the run (resumes included) end it; 0: no bound",
            100,
            bound="nonnegative",
            resume="safe",
        ),
    )
    heartbeat_timeout: int = field(
        default=120,
        metadata=about(
            "seconds without a heartbeat from a rank (a thread that beats while the rank lives, "
            "however slow its step) before the launcher's watchdog names it, dumps the other "
            "ranks' stacks and ends the job with exit status 124; 0: no watchdog "
            "([details](reliability.md))",
            120,
            bound="nonnegative",
            resume="safe",
        ),
    )
    verify_every: int = field(
        default=0,
        metadata=about(
            "every N steps, check that replicated parameters and optimizer states are bitwise "
            "identical on their replicas (a `ReplicaDriftError` names the first that is not); "
            "0: never",
            100,
            bound="nonnegative",
            resume="safe",
        ),
    )
    loss_scale: float = field(
        default=0.0,
        metadata=about(
            "fp16: a fixed loss scale (DeepSpeed's static `loss_scale`); 0: the dynamic scaler "
            "([details](training.md#fp16-loss-scaling))",
            1024.0,
            bound="nonnegative",
            resume="refuse",
        ),
    )
    initial_loss_scale: float = field(
        default=65536.0,
        metadata=about(
            "fp16: the dynamic scaler's first scale (DeepSpeed: 2 ** `initial_scale_power`)",
            4096.0,
            bound="positive",
            resume="refuse",
        ),
    )
    loss_scale_window: int = field(
        default=2000,
        metadata=about(
            "fp16: finite steps in a row after which the dynamic scale doubles",
            1000,
            bound="positive",
            resume="refuse",
        ),
    )
    loss_scale_hysteresis: int = field(
        default=1,
        metadata=about(
            "fp16: overflows (each skipped) before the dynamic scale halves, refilled when it "
            "grows (DeepSpeed's `hysteresis`)",
            2,
            bound="positive",
            resume="refuse",
        ),
    )
    min_loss_scale: float = field(
        default=0.0,
        metadata=about(
            "fp16: the floor the dynamic scale does not halve below; 0: none",
            1.0,
            bound="nonnegative",
            resume="refuse",
        ),
    )


@dataclass(frozen=True)
class LoRASection:
    """``[lora]``: adapters of ``rank`` with scale ``alpha / rank`` on the Linears whose FQNs
    fully match one of ``targets`` (regexes), every other parameter frozen; ``quantize_base =
    "nf4"`` stores the adapted base weights in 4-bit NF4 (QLoRA)."""

    rank: int = field(
        default=8,
        metadata=about(
            "the adapters' rank r ([LoRA and QLoRA](lora.md))", 8, bound="positive", resume="refuse"
        ),
    )
    alpha: float = field(
        default=16.0,
        metadata=about(
            "the update is scaled by alpha / rank", 16, bound="positive", resume="refuse"
        ),
    )
    targets: tuple[str, ...] = field(
        default=(),
        metadata=about(
            "regexes: Linear modules whose FQNs a pattern fully matches get adapters; every other "
            "parameter is frozen",
            [r"layers\.\d+\.attention\.w[qkvo]"],
            bound="positive",
            shown="required",
            resume="refuse",
        ),
    )
    quantize_base: QuantizeBase = field(
        default="",
        metadata=about(
            "the adapted base weights in 4-bit NF4 (QLoRA)", "nf4", shown="none", resume="refuse"
        ),
    )


@dataclass(frozen=True)
class DataSection:
    """``[data]``: ``corpus`` (the Python standard library's docstrings, tokenized locally into
    ``path`` on first use), ``tokens`` (a prepared token directory at ``path``), ``synthetic``
    (``samples`` random sequences), or the user's files at ``path`` — ``jsonl``, ``text``,
    ``parquet``, ``hf-dataset`` (tokenised once into ``<run_dir>/data``, packed with document
    boundaries masked, see [your data](data.md)); the tokenizer; whether packed documents
    attend only within themselves; shuffling and its seed."""

    source: DataSource = field(
        default="corpus",
        metadata=about("see [training](training.md#data)", "corpus", resume="refuse"),
    )
    path: str = field(
        default="data/corpus",
        metadata=about(
            "the token directory (written once for `corpus`), or your file or directory",
            "data/tokens",
            resume="refuse",
        ),
    )
    tokenizer: str = field(
        default="byte",
        metadata=about(
            '`"byte"`, a `tokenizer.json` path (or its directory), or `"model"` (the '
            "`[model] hf` directory's)",
            "byte",
            resume="refuse",
        ),
    )
    text_field: str = field(
        default="text",
        metadata=about(
            "the record field (column) holding each document's text", "text", resume="refuse"
        ),
    )
    format: DocumentFormat = field(
        default="text",
        metadata=about(
            "`instruction`: records hold a prompt and a response; the prompt is masked from the "
            "loss",
            "instruction",
            resume="refuse",
        ),
    )
    prompt_field: str = field(
        default="prompt",
        metadata=about("the prompt's field (`instruction` format)", "prompt", resume="refuse"),
    )
    response_field: str = field(
        default="response",
        metadata=about("the response's field (`instruction` format)", "response", resume="refuse"),
    )
    validation: float = field(
        default=0.0,
        metadata=about(
            "the fraction of documents held out for `[eval]` (file sources)",
            0.01,
            bound="nonnegative",
            resume="refuse",
        ),
    )
    corpus_bytes: int | None = field(
        default=None,
        metadata=about(
            "how much of the corpus to tokenize",
            4_000_000,
            bound="positive",
            shown="all",
            resume="refuse",
        ),
    )
    samples: int = field(
        default=4096,
        metadata=about("sequences of `synthetic` data", 4096, bound="positive", resume="refuse"),
    )
    document_mask: bool = field(
        default=False,
        metadata=about(
            "file sources: each packed document attends only within itself (positions restart "
            "at every document; [packed documents](data.md#packed-documents))",
            True,
            resume="refuse",
        ),
    )
    shuffle: bool = field(default=True, metadata=about("shuffle each epoch", True, resume="refuse"))
    seed: int = field(
        default=0, metadata=about("the shuffle's seed", 0, bound="nonnegative", resume="refuse")
    )


@dataclass(frozen=True)
class CheckpointSection:
    """``[checkpoint]``: where and how often to save (``interval`` 0: only at the end), how many
    to keep (0: all), async saving, resuming from the latest one in ``dir``, a safetensors file
    to start from and one to export the final model to."""

    dir: str = field(
        default="",
        metadata=about(
            "where checkpoints go",
            "runs/debug/checkpoints",
            shown="`<run_dir>/checkpoints`",
            resume="safe",
        ),
    )
    interval: int = field(
        default=0,
        metadata=about(
            "save every N steps (and always at the last step)",
            100,
            bound="nonnegative",
            resume="safe",
        ),
    )
    keep_last: int = field(
        default=3,
        metadata=about("complete checkpoints kept (0: all)", 3, bound="nonnegative", resume="safe"),
    )
    async_save: bool = field(
        default=False, metadata=about("save in the background", False, toml="async", resume="safe")
    )
    resume: bool = field(
        default=True,
        metadata=about(
            "continue from the latest complete checkpoint in `dir`", True, resume="safe"
        ),
    )
    allow_unverified: bool = field(
        default=False,
        metadata=about(
            "resume from a checkpoint saved without checksums (older meshtrain, or stripped of "
            "them: nothing can tell a flipped byte in it); off, such a checkpoint is passed over",
            True,
            resume="safe",
        ),
    )
    allow_change: tuple[str, ...] = field(
        default=(),
        metadata=about(
            "recipe keys (or sections) a resume may change although they change what training "
            "means (`meshtrain train --allow-change KEY`; [details](reliability.md))",
            ["train.batch_size"],
            shown="`[]`",
            resume="safe",
        ),
    )
    init_from: str = field(
        default="",
        metadata=about(
            "a transformers model directory or a `.safetensors` file to start from, each rank "
            "reading its slices; ignored when the run resumes ([details]"
            "(training.md#hugging-face-checkpoints-in-and-out))",
            "model.safetensors",
            shown="none",
            resume="safe",
        ),
    )
    export: str = field(
        default="",
        metadata=about(
            "a `.safetensors` path to write the final model to",
            "runs/debug/model.safetensors",
            shown="none",
            resume="safe",
        ),
    )


@dataclass(frozen=True)
class LoggingSection:
    """``[logging]``: the run directory (metrics.jsonl, plan files, wandb's offline run), the
    console progress bar, the JSONL file, wandb's mode and project, and how often to log."""

    run_dir: str = field(
        default="",
        metadata=about(
            "metrics, plan files, wandb's run",
            "runs/debug",
            shown="`runs/<recipe name>`",
            resume="safe",
        ),
    )
    console: bool = field(default=True, metadata=about("progress on stdout", True, resume="safe"))
    jsonl: bool = field(
        default=True, metadata=about("`metrics.jsonl` in the run directory", True, resume="safe")
    )
    wandb: WandbMode = field(
        default="offline",
        metadata=about("offline needs no network or key", "offline", resume="safe"),
    )
    wandb_project: str = field(
        default="meshtrain", metadata=about("the wandb project", "meshtrain", resume="safe")
    )
    wandb_entity: str = field(
        default="",
        metadata=about("the wandb entity (team)", "my-team", shown="none", resume="safe"),
    )
    log_every: int = field(
        default=1,
        metadata=about(
            "log every N steps (and the first and last)", 10, bound="positive", resume="safe"
        ),
    )


@dataclass(frozen=True)
class EvalSection:
    """``[eval]``: validation loss and perplexity every ``every`` steps (0: never) over
    ``batches`` global batches of the held-out data (``data.validation``), on the run's plan;
    logged to the console, JSONL and wandb as ``val_loss`` and ``val_perplexity``."""

    every: int = field(
        default=0,
        metadata=about(
            "evaluate every N steps and at the end (0: off)", 50, bound="nonnegative", resume="safe"
        ),
    )
    batches: int = field(
        default=8,
        metadata=about("global batches per evaluation", 8, bound="positive", resume="safe"),
    )


@dataclass(frozen=True)
class ProfileSection:
    """``[profile]``: trace steps ``steps = [first, last]`` with ``torch.profiler`` (one trace per
    rank in ``<run_dir>/profile``, for Perfetto or TensorBoard), a CUDA memory snapshot on GPUs
    and a table of compute against each collective's time per step; off (and free) by
    default. ``meshtrain train --profile`` traces steps 3 to 5."""

    steps: tuple[int, ...] = field(
        default=(),
        metadata=about("the first and last step traced", [3, 5], shown="none", resume="safe"),
    )
    memory: bool = field(
        default=True,
        metadata=about("a CUDA memory snapshot of the traced steps (GPUs)", True, resume="safe"),
    )


@dataclass(frozen=True)
class FreeForm:
    """A section whose keys are the user's (mesh axes, rule regexes), checked by its own
    function in :mod:`meshtrain.recipes.schema`; what its keys and values are, for the docs."""

    key: str
    value: str
    default: str
    doc: str
    resume: Resume


#: Every top-level section, in the order messages and the docs list them: its dataclass, or
#: what its free-form keys are.
RECIPE_SECTIONS: dict[str, type | FreeForm] = {
    "model": ModelSection,
    "mesh": FreeForm(
        "an axis name",
        "integer ≥ 1, or -1",
        "—",
        "axes in order, as `mt.make_mesh` takes them; one may be -1",
        "safe",
    ),
    "parallel": ParallelSection,
    "rules": FreeForm(
        "a regex",
        "spec string",
        "the model's default rules",
        "explicit rules, in order (below)",
        "safe",
    ),
    "train": TrainSection,
    "lora": LoRASection,
    "data": DataSection,
    "checkpoint": CheckpointSection,
    "logging": LoggingSection,
    "eval": EvalSection,
    "profile": ProfileSection,
}


def _subsections(name: str, section: type | FreeForm) -> list[tuple[str, type]]:
    """``(name, dataclass)`` of a section's tables of their own (``parallel.pipeline``)."""
    if isinstance(section, FreeForm):
        return []
    return [
        (f"{name}.{field.name}", field.metadata["subsection"])
        for field in dataclasses.fields(section)
        if field.metadata.get("subsection") is not None
    ]


#: Section name → its dataclass, nested tables included (``parallel.pipeline``).
SECTION_TYPES: dict[str, type | FreeForm] = {
    qualified: section_type
    for name, section in RECIPE_SECTIONS.items()
    for qualified, section_type in [(name, section), *_subsections(name, section)]
}
#: Every section a recipe may have, nested tables after their parent.
SECTION_NAMES: tuple[str, ...] = tuple(SECTION_TYPES)
TOP_SECTIONS: tuple[str, ...] = tuple(RECIPE_SECTIONS)


def resume_rule(key: str) -> Resume | None:
    """The :data:`Resume` rule of a dotted recipe key (``None``: no such key). A key a section
    takes from a model config (``model.dim``) has the rule of the field that names the config.

    Example:
        >>> resume_rule("eval.every"), resume_rule("train.batch_size"), resume_rule("model.dim")
        ('safe', 'refuse', 'refuse')
    """
    section, _, name = key.rpartition(".")
    while section and section not in SECTION_TYPES:  # a free-form key with dots
        section, _, _ = section.rpartition(".")
    section_type = SECTION_TYPES.get(section or key)
    if isinstance(section_type, FreeForm):
        return section_type.resume
    if section_type is None:
        return None
    fields = dataclasses.fields(section_type)
    for item in fields:
        if (item.metadata["toml"] or item.name) == name:
            return typing.cast(Resume, item.metadata["resume"])
    expanded = {item.metadata["resume"] for item in fields if item.metadata.get("keys_from")}
    return typing.cast(Resume, expanded.pop()) if len(expanded) == 1 else None
