"""Plan options: what the user asks of a plan, validated before anything is inferred.

Example:
    >>> PlanOptions(zero=2, precision="bf16").param_dtype
    'bfloat16'
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Literal

from meshtrain.spec.errors import PlanError

Precision = Literal["fp32", "bf16", "fp16"]
Checkpointing = Literal["none", "full", "selective"]
CompileScope = Literal["auto", "block", "model"]
_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
_OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd": 1, "sgd_nomomentum": 0}


@dataclass(frozen=True)
class PlanOptions:
    """Data-parallel stage, offload, precision and the optimizer the memory model assumes.

    ``batch_size`` (sequences per micro-batch per data-parallel rank) and ``seq_len`` are optional:
    given, they size the activation collectives and check sequence-parallel divisibility.

    ``zero``: 0 = DDP (replicated parameters, gradient all-reduce); 1 = optimizer states sharded
    (parameters and gradients stay whole between micro-batches, gradients reduce-scattered once per
    step); 2 = gradients sharded too (parameters kept gathered from forward to backward); 3 =
    parameters sharded as well (gathered per unit in forward and again in backward).
    """

    zero: int = 3
    offload: bool = False
    precision: Precision = "fp32"
    reduce_precision: Precision = "fp32"
    optimizer: str = "adamw"
    loss_parallel: bool = True
    microbatches: int = 1
    batch_size: int | None = None
    seq_len: int | None = None
    activation_checkpointing: Checkpointing = "none"
    checkpoint_every: int = 1
    compile: bool = False
    compile_backend: str = "inductor"
    compile_fullgraph: bool = False
    compile_scope: CompileScope = "auto"

    def __post_init__(self) -> None:
        if isinstance(self.zero, bool) or self.zero not in (0, 1, 2, 3):
            raise PlanError(
                f"zero={self.zero!r} is out of range: use 0 (DDP), 1 (optimizer states sharded), "
                "2 (gradients too) or 3 (parameters too)."
            )
        for name in ("precision", "reduce_precision"):
            value = getattr(self, name)
            if value not in _DTYPES:
                raise PlanError(f"{name}={value!r} is not one of {sorted(_DTYPES)}.")
        if self.optimizer not in _OPTIMIZER_STATES:
            raise PlanError(
                f"optimizer={self.optimizer!r} is unknown to the memory model; use one of "
                f"{sorted(_OPTIMIZER_STATES)} (the number of fp32 states per parameter it keeps)."
            )
        for name, meaning in (
            ("microbatches", "gradient accumulation steps per optimizer step"),
            ("batch_size", "sequences per micro-batch on each data-parallel rank"),
            ("seq_len", "tokens per sequence"),
            ("checkpoint_every", "checkpoint every k-th block"),
        ):
            value = getattr(self, name)
            if value is None and name != "microbatches":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PlanError(f"{name}={value!r} must be a positive integer ({meaning}).")
        if self.activation_checkpointing not in ("none", "full", "selective"):
            raise PlanError(
                f"activation_checkpointing={self.activation_checkpointing!r} is not one of "
                "'none', 'full' (recompute each block), 'selective' (keep matmul and attention "
                "outputs, recompute the rest) or {'every': k} (full recompute of every k-th block)."
            )
        if self.compile_scope not in ("auto", "block", "model"):
            raise PlanError(
                f"compile scope={self.compile_scope!r} is not one of 'auto', 'block' (each "
                "repeated block and the loss) or 'model' (the whole model)."
            )
        if not isinstance(self.compile_backend, str) or not self.compile_backend:
            raise PlanError(
                f"compile backend={self.compile_backend!r} must name a torch.compile backend "
                "('inductor', 'aot_eager', ...)."
            )
        if self.offload and self.zero == 0:
            raise PlanError(
                "offload=True needs sharded data parallelism (zero ≥ 1): FSDP2's CPU offload keeps "
                "each rank's shard on the host. Use zero=3 with offload."
            )

    def checkpointed_blocks(self, blocks: Sequence[str]) -> tuple[str, ...]:
        """The blocks whose activations are recomputed: all, or the k-th, 2k-th, … of them.

        Example:
            >>> PlanOptions(activation_checkpointing="full", checkpoint_every=2).checkpointed_blocks(
            ...     ["b0", "b1", "b2", "b3"])
            ('b1', 'b3')
        """
        if self.activation_checkpointing == "none":
            return ()
        every = self.checkpoint_every
        return tuple(fqn for position, fqn in enumerate(blocks, start=1) if position % every == 0)

    @property
    def param_dtype(self) -> str:
        """The dtype parameters are computed in (the master copy stays fp32)."""
        return _DTYPES[self.precision]

    @property
    def reduce_dtype(self) -> str:
        """The dtype gradients are reduced in."""
        return _DTYPES[self.reduce_precision]

    @property
    def optimizer_states(self) -> int:
        """fp32 optimizer tensors kept per parameter element (Adam: 2, SGD with momentum: 1)."""
        return _OPTIMIZER_STATES[self.optimizer]

    def to_json(self) -> dict[str, object]:
        """Plain-data form for ``Plan.to_json``."""
        return asdict(self)
