"""``assert_equivalent``: a plan trains like one device, step by step, within its contract.

Every rank of a pool of real gloo ranks builds the model from the same seed, keeps a deep copy as
the single-device reference, applies the plan to the original and trains both on the same global
batches with the same optimizer: the reference on the whole batch, the plan on its data-parallel
slice through the runtime's own train step (:func:`~meshtrain.train.make_train_step`: its
micro-batches or pipeline, loss scaling, gradient norm, clipping and non-finite guard). The loss,
the global gradient norm (the step's own) and every gradient (before clipping) are compared with
the contract's relative bound, and whether each side skipped the step; after each optimizer step
every parameter and optimizer state against the element-wise bound the update rule gives
(:mod:`meshtrain.testing.updates`), and every buffer (running statistics, counters) against the
contract's bound (exactly where it is bitwise or not floating-point). The plan's parameters,
states and buffers are then copied into the reference, so every step starts from the same point
and the first diverging step is exact.

Example (a model defined at module level, so ranks can import it)::

    report = mt.testing.assert_equivalent(
        MyModel, {"dp": 2, "tp": 2}, {"rules": rules, "zero": 3}, steps=3, optimizer="adamw"
    )
    print(report.format())
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import json
import math
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from meshtrain.errors import EquivalenceError, PlanError
from meshtrain.lower import apply, device_mesh, full_tensor, one_device_reference
from meshtrain.lower.context.parallel import positions_keyword
from meshtrain.plan.api import plan as make_plan
from meshtrain.plan.ir import Plan
from meshtrain.spec.mesh import Mesh, make_mesh
from meshtrain.spec.rules import Rules
from meshtrain.testing.contract import ROUNDING_FACTOR, Contract, contract_for
from meshtrain.testing.progress import StepLines, relayed
from meshtrain.testing.rounding import (
    FLIP_FACTOR,
    ExactTwin,
    FlipAllowance,
    FlipTopk,
    OwnRounding,
    RecordTopk,
    TopkCall,
    rounding_bound,
)
from meshtrain.testing.runner import SPMDTaskError, get_pool
from meshtrain.testing.updates import STATE_KEYS, UpdateRule, param_bound, state_bound, update_rule
from meshtrain.train.balance import after_optimizer_step
from meshtrain.train.batch import Batch as StepBatch
from meshtrain.train.loss import LossFn, data_parallel_rank, summed_cross_entropy
from meshtrain.train.offload import offload_states
from meshtrain.train.scaler import LossScaler
from meshtrain.train.state import TrainState
from meshtrain.train.step import TrainStep, make_train_step

#: ``(inputs, targets)``, or ``(inputs, targets, token_positions)`` for packed documents
#: (positions restarting at each document, passed to both models; see ``Batch.token_positions``)
Batch = tuple[torch.Tensor, torch.Tensor] | tuple[torch.Tensor, torch.Tensor, torch.Tensor]
OptimizerSpec = str | Callable[..., torch.optim.Optimizer]


@dataclass(frozen=True)
class TokenBatches:
    """Seeded random token batches: ``batches(step)`` → ``(inputs, targets)``, each
    ``[batch_size, seq_len]``, targets the inputs shifted by one.

    Example:
        >>> inputs, targets = TokenBatches(vocab_size=32, batch_size=4, seq_len=8)(0)
        >>> tuple(inputs.shape), bool((inputs[:, 1:] == targets[:, :-1]).all())
        ((4, 8), True)
    """

    vocab_size: int
    batch_size: int = 8
    seq_len: int = 16
    seed: int = 1234

    def __call__(self, step: int) -> Batch:
        generator = torch.Generator().manual_seed(self.seed + step)
        tokens = torch.randint(
            0, self.vocab_size, (self.batch_size, self.seq_len + 1), generator=generator
        )
        return tokens[:, :-1], tokens[:, 1:]


@dataclass(frozen=True)
class Comparison:
    """One compared quantity at one step: the worst element's error and the contract's verdict.

    ``ratio`` is the largest |difference| / bound over the tensor's elements (> 1 fails);
    ``rel_error`` is the largest |difference| over the reference's largest magnitude;
    ``own_error``, under a low-precision contract, the one-device reference's own largest error
    for the same quantity, measured against fp32 (:mod:`meshtrain.testing.rounding`): a plan far
    from one device while one device is close to fp32 is a bug, not rounding.
    """

    step: int
    quantity: str
    fqn: str
    abs_error: float
    rel_error: float
    ratio: float
    note: str = ""
    own_error: float | None = None

    @property
    def own_ratio(self) -> float | None:
        """``abs_error`` over the reference's own low-precision error (``None`` if unmeasured)."""
        if self.own_error is None:
            return None
        if self.own_error == 0.0:
            return 0.0 if self.abs_error == 0.0 else math.inf
        return self.abs_error / self.own_error

    @property
    def ok(self) -> bool:
        return self.ratio <= 1.0


@dataclass(frozen=True)
class EquivalenceReport:
    """Everything one ``assert_equivalent`` run compared, and how to replay it."""

    contract: Contract
    comparisons: tuple[Comparison, ...]
    losses: tuple[tuple[float, float], ...]
    clipped_steps: int
    plan_json: str
    replay: str
    unchecked: str = ""
    random_modules: tuple[str, ...] = ()

    @property
    def passed(self) -> bool:
        return all(c.ok for c in self.comparisons)

    @property
    def failures(self) -> tuple[Comparison, ...]:
        return tuple(c for c in self.comparisons if not c.ok)

    @property
    def first_divergence(self) -> Comparison | None:
        """The earliest failing comparison; within a step, in the order values are computed
        (loss, gradients, their norm, parameters, optimizer states), the worst first."""
        return min(self.failures, key=_divergence_order, default=None)

    def worst(self, quantity: str) -> float:
        """The largest relative error of one quantity ('loss', 'grad', 'param', ...) over all steps."""
        return max((c.rel_error for c in self.comparisons if c.quantity == quantity), default=0.0)

    def format(self, limit: int = 12) -> str:
        """The report: verdict, contract, first divergence, worst tensors, losses, replay."""
        plan = json.loads(self.plan_json)
        mesh = ", ".join(f"{axis}: {size}" for axis, size in plan["mesh"]["axes"])
        verdict = "trains like one device" if self.passed else "does NOT train like one device"
        lines = [f"plan on mesh {{{mesh}}} {verdict}.", f"contract: {self.contract.describe()}"]
        first = self.first_divergence
        if first is not None:
            lines.append(
                f"first divergence: step {first.step}, {first.quantity} {first.fqn!r}: max abs "
                f"error {first.abs_error:.2e}, rel {first.rel_error:.2e}, {_times(first.ratio)} "
                f"the bound{' (' + first.note + ')' if first.note else ''}"
            )
            if first.own_error is not None:
                lines.append(_own_verdict(first, self.contract.precision))
            shown = sorted(self.failures, key=_divergence_order)[:limit]
            lines.append(f"diverged: {len(self.failures)} comparisons; the first {len(shown)}:")
        else:
            shown = sorted(self.comparisons, key=lambda c: -c.ratio)[:limit]
            lines.append(f"closest to their bounds (of {len(self.comparisons)} comparisons):")
        own = self.contract.level == "approximate"
        header = (
            f"  {'step':>4}  {'quantity':<18} {'tensor':<36} {'abs err':>9} "
            f"{'rel err':>9} {'× bound':>9}"
        )
        lines.append(header + (f" {'own err':>9} {'× own':>9}" if own else ""))
        for c in shown:
            row = (
                f"  {c.step:>4}  {c.quantity:<18} {c.fqn:<36} {c.abs_error:>9.2e} "
                f"{c.rel_error:>9.2e} {_times(c.ratio):>9}"
            )
            if own:
                row += _own_columns(c)
            lines.append(row)
        lines.append(
            "losses (plan / one device): "
            + "; ".join(f"{i + 1}: {a:.6f} / {b:.6f}" for i, (a, b) in enumerate(self.losses))
        )
        lines.append(f"clipping triggered in {self.clipped_steps} of {len(self.losses)} steps")
        if self.unchecked:
            lines.append(self.unchecked)
        if self.random_modules and not self.passed:
            names = ", ".join(self.random_modules[:5])
            more = (
                f" and {len(self.random_modules) - 5} more" if len(self.random_modules) > 5 else ""
            )
            lines.append(
                f"likely cause: the model is not deterministic — dropout with p > 0 in {names}"
                f"{more} draws different masks on each rank than on one device. Set the "
                "dropout probabilities to 0 (e.g. the config's *_dropout / *_pdrop) to compare."
            )
        lines.append(f"replay: {self.replay}")
        if not self.passed:
            lines.append(f"plan JSON: {self.plan_json}")
        return "\n".join(lines)


_QUANTITY_ORDER = ("missing", "loss", "overflow skip", "grad", "grad norm", "param")


def _divergence_order(comparison: Comparison) -> tuple[int, int, float]:
    quantity = comparison.quantity
    rank = _QUANTITY_ORDER.index(quantity) if quantity in _QUANTITY_ORDER else len(_QUANTITY_ORDER)
    return comparison.step, rank, -comparison.ratio


def _times(ratio: float) -> str:
    return "inf×" if math.isinf(ratio) else f"{ratio:.2f}×"


def _own_columns(comparison: Comparison) -> str:
    """The reference's own low-precision error and the plan's error over it (or dashes)."""
    ratio = comparison.own_ratio
    if comparison.own_error is None or ratio is None:
        return f" {'—':>9} {'—':>9}"
    return f" {comparison.own_error:>9.2e} {_times(ratio):>9}"


def _own_verdict(comparison: Comparison, precision: str) -> str:
    """One line that tells a bug from rounding: how far the plan is from one device, against how
    far one device itself is from fp32 on the same tensor."""
    ratio = comparison.own_ratio or 0.0
    reading = (
        "the plan is far from one device while one device is close to fp32: a bug, not rounding"
        if ratio > 10 * ROUNDING_FACTOR
        else f"within {10 * ROUNDING_FACTOR:g}× of one device's own {precision} error: rounding "
        "heavier than the contract allows, or a small bug"
    )
    return (
        f"one device's own {precision} error on it (against fp32): "
        f"{comparison.own_error:.2e}; the plan's error is {_times(ratio)} that — {reading}"
    )


@dataclass(frozen=True)
class _Config:
    model_fn: Callable[[], nn.Module]
    mesh_axes: tuple[tuple[str, int], ...]
    plan_kwargs: dict[str, Any]
    batches: Callable[[int], Batch] | tuple[Batch, ...]
    steps: int
    optimizer: OptimizerSpec
    loss_fn: LossFn
    max_norm: float | None
    seed: int
    contract: Contract
    rank_context: Callable[[], contextlib.AbstractContextManager[Any]] | None = None
    progress: StepLines | None = None  # where rank 0 says each step compared


@dataclass
class _RankResult:
    comparisons: list[Comparison] = field(default_factory=list)
    losses: list[tuple[float, float]] = field(default_factory=list)
    clipped_steps: int = 0
    held: set[str] = field(default_factory=set)
    reference_fqns: tuple[str, ...] = ()
    update: str = ""


def assert_equivalent(
    model_fn: Callable[[], nn.Module],
    mesh_shape: Mapping[str, int],
    rules_or_plan_options: Rules | Mapping[str, Any],
    *,
    batches: Callable[[int], Batch] | Sequence[Batch] | None = None,
    steps: int = 3,
    optimizer: OptimizerSpec = "sgd",
    loss_fn: LossFn = summed_cross_entropy,
    max_norm: float | None = 1.0,
    seed: int = 0,
    contract: Contract | None = None,
    rank_context: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
    timeout_s: float = 600.0,
    progress: Callable[[str], None] | None = None,
) -> EquivalenceReport:
    """Train ``model_fn()`` under the plan and on one device; raise unless they agree.

    ``model_fn`` builds the model (module level, so ranks can import it; seeded with ``seed``
    before the call on every rank). ``mesh_shape`` names the axes and sizes (their product is the
    number of gloo ranks). ``rules_or_plan_options`` is a :class:`~meshtrain.Rules`, or a mapping
    of ``mt.plan`` keyword arguments with the rules under ``"rules"``. ``batches`` gives the
    global batch of each step (``step -> (inputs, targets)`` or a sequence; a third tensor,
    per-token positions restarting at each packed document, is passed to both models); by default
    :class:`TokenBatches` over the model's first embedding. ``loss_fn(output, targets)`` returns
    a *summed* loss; both runs divide it by the global target count. ``optimizer`` is 'sgd'
    (lr 0.1, momentum 0.9), 'adam', 'adamw' (lr 1e-3) or a picklable ``params -> Optimizer``.
    ``max_norm`` clips by the global norm (``None``: no clipping). ``rank_context`` is entered
    on every rank around the whole run (e.g. to set flags). The plan is built first in this
    process on an abstract mesh, so a bad plan raises its ``PlanError`` before any rank starts.
    ``progress`` (e.g. ``print``) is given a line as the plan is made, the ranks start and each
    step is compared.

    Returns the :class:`EquivalenceReport`; raises :class:`~meshtrain.EquivalenceError` (with
    ``.report``) when any comparison exceeds its bound.
    """
    plan_kwargs = _plan_kwargs(rules_or_plan_options)
    mesh_axes = tuple((str(axis), int(size)) for axis, size in mesh_shape.items())
    world = math.prod(size for _, size in mesh_axes)
    with torch.random.fork_rng(devices=[]):  # the caller's random state is left alone
        torch.manual_seed(seed)
        probe = model_fn()
    resolved = _resolve_batches(batches, probe)
    first = resolved[0] if isinstance(resolved, tuple) else resolved(0)
    plan_kwargs.setdefault("example_inputs", first[0])  # the plan-time proof runs on it
    began = time.monotonic()
    abstract = make_plan(
        probe, make_mesh(dict(mesh_axes), world_size=world, abstract=True), **plan_kwargs
    )
    if progress is not None:
        progress(f"plan made and proven on {world} abstract ranks in {_since(began)}")
    random_modules = random_in_training(probe)
    _check_batch(abstract, first)
    config = _Config(
        model_fn=model_fn,
        mesh_axes=mesh_axes,
        plan_kwargs=plan_kwargs,
        batches=resolved,
        steps=steps,
        optimizer=optimizer,
        loss_fn=loss_fn,
        max_norm=max_norm,
        seed=seed,
        contract=contract or contract_for(abstract, statistics_size=_per_channel(first[0])),
        rank_context=rank_context,
    )
    try:
        results = _run_ranks(config, world, timeout_s, progress)
    except SPMDTaskError as error:
        _raise_refusal(error)
        raise
    report = dataclasses.replace(_merge(config, abstract, results), random_modules=random_modules)
    if not report.passed:
        failure = EquivalenceError(report.format())
        failure.report = report
        raise failure
    return report


def _run_ranks(
    config: _Config, world: int, timeout_s: float, progress: Callable[[str], None] | None
) -> list[_RankResult]:
    pool = get_pool(world)
    if progress is None:
        return pool.run(_run_rank, config, _timeout_s=timeout_s)
    began = time.monotonic()
    pool.start()
    progress(f"{world} CPU ranks (gloo) ready in {_since(began)}")
    progress(f"training {config.steps} step(s) under the plan and on one device")
    with tempfile.TemporaryDirectory(prefix="meshtrain-check-") as scratch:
        lines = StepLines(str(Path(scratch) / "steps.txt"))
        config = dataclasses.replace(config, progress=lines)
        return relayed(
            lambda: pool.run(_run_rank, config, _timeout_s=timeout_s), progress, lines.path
        )


def _since(began: float) -> str:
    return f"{time.monotonic() - began:.1f} s"


def random_in_training(model: nn.Module) -> tuple[str, ...]:
    """Modules that draw random numbers in training mode: ``nn.Dropout`` with ``p > 0``, and
    modules with a float ``*dropout*``/``*pdrop*`` attribute above 0 (Hugging Face attention
    applies its dropout functionally).

    Example:
        >>> random_in_training(nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.1)))
        ('1',)
    """
    found = []
    for fqn, module in model.named_modules():
        if isinstance(module, nn.modules.dropout._DropoutNd):
            if module.p > 0:
                found.append(fqn)
            continue
        for name, value in vars(module).items():
            if ("dropout" in name or "pdrop" in name) and isinstance(value, float) and value > 0:
                found.append(fqn)
                break
    return tuple(found)


def _raise_refusal(error: SPMDTaskError) -> None:
    """A plan refused on the ranks (a check that needs the first forward, such as the pairing
    of column- and row-wise Linears) is a ``PlanError`` here too, not a crashed run."""
    kinds = {text.split(":", 1)[0] for text in error.failures.values()}
    if len(kinds) == 1 and kinds <= {"PlanError", "SpecError", "RuleError"}:
        rank = min(error.failures)
        message = error.failures[rank].split("\nTraceback", 1)[0].split(": ", 1)[1]
        raise PlanError(f"{message} (raised on every failing rank at the first forward)")


def _per_channel(inputs: torch.Tensor) -> int:
    """Elements per channel of a batch (``[N, C, ...]``: N × the rest; ``[N]``: N)."""
    return inputs.numel() // inputs.shape[1] if inputs.dim() >= 2 else inputs.numel()


def _plan_kwargs(rules_or_options: Rules | Mapping[str, Any]) -> dict[str, Any]:
    if isinstance(rules_or_options, Rules):
        return {"rules": rules_or_options}
    kwargs = dict(rules_or_options)
    if not isinstance(kwargs.get("rules"), Rules):
        raise PlanError(
            "assert_equivalent needs the rules: pass a meshtrain.Rules, or a mapping of mt.plan "
            f"options with a Rules under 'rules' (got keys {sorted(kwargs)})."
        )
    return kwargs


def _resolve_batches(
    batches: Callable[[int], Batch] | Sequence[Batch] | None, model: nn.Module
) -> Callable[[int], Batch] | tuple[Batch, ...]:
    if batches is None:
        embedding = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
        if embedding is None:
            raise PlanError(
                f"{type(model).__name__} has no nn.Embedding to draw token batches for: pass "
                "batches=step -> (inputs, targets) (or a list of such pairs)."
            )
        return TokenBatches(embedding.num_embeddings)
    return batches if callable(batches) else tuple(batches)


def _check_batch(plan: Plan, batch: Batch) -> None:
    data = math.prod(plan.mesh.size(axis) for axis in plan.batch_axes)
    micro = plan.pipeline.microbatches if plan.pipeline else plan.options.microbatches
    rows = int(batch[0].shape[0])
    if rows % (data * micro) or int(batch[1].shape[0]) != rows:
        raise PlanError(
            f"a global batch of {rows} rows (targets {int(batch[1].shape[0])}) does not split "
            f"into {data} data-parallel ranks × {micro} micro-batches on mesh {plan.mesh}: give "
            f"batches whose dim 0 is a multiple of {data * micro}."
        )


def _batch(config: _Config, step: int) -> Batch:
    if isinstance(config.batches, tuple):
        return config.batches[step % len(config.batches)]
    return config.batches(step)


# ----------------------------------------------------------------------------- rank side


@functools.cache
def _mesh(axes: tuple[tuple[str, int], ...]) -> Mesh:
    return make_mesh(dict(axes))


def _run_rank(config: _Config) -> _RankResult:
    # Each comparison compiles as a fresh training process would: a pool rank keeps torch's
    # compile caches across tasks, and one plan's cached graphs have made AOT autograd's
    # partitioner fail on the next plan's ("Node tangents_2 was invalid, but is output": a
    # compiled LoopedBFS pipeline with tensor parallelism after other compiled plans).
    torch._dynamo.reset()
    context = config.rank_context() if config.rank_context else contextlib.nullcontext()
    with context:
        return _Run(config).train()


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The reference's storage: a one-rank DTensor's local tensor is the whole tensor."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _optimizer(spec: OptimizerSpec, params: Iterator[nn.Parameter]) -> torch.optim.Optimizer:
    if callable(spec):
        return spec(params)
    if spec == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    if spec == "adam":
        return torch.optim.Adam(params, lr=1e-3)
    if spec == "adamw":
        return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)
    raise PlanError(f"optimizer={spec!r}: use 'sgd', 'adam', 'adamw' or a params -> Optimizer.")


@dataclass(frozen=True)
class _ObservedStep(TrainStep):
    """The runtime's train step, unchanged but for one look: ``observe()`` sees the unscaled,
    unclipped gradients just before the step measures their norm (a step whose gradients are
    not finite measures none, and is compared as a skipped step)."""

    observe: Callable[[], None] = lambda: None

    @classmethod
    def of(cls, step: TrainStep, observe: Callable[[], None]) -> _ObservedStep:
        values = {f.name: getattr(step, f.name) for f in dataclasses.fields(step)}
        return cls(**values, observe=observe)

    def _grad_norm(self, params: list[Any], named: Mapping[str, Any]) -> float:
        self.observe()
        return super()._grad_norm(params, named)


@torch.no_grad()
def _reference_clip(params: list[torch.nn.Parameter], max_norm: float) -> float:
    """One device's global gradient norm and clipping, written here rather than taken from
    meshtrain's clip (a bug there would change both sides alike and pass): the squares summed in
    fp64 in parameter order, the gradients scaled by ``min(1, max_norm / (norm + 1e-6))``.

        >>> p = torch.nn.Parameter(torch.zeros(2)); p.grad = torch.tensor([3.0, 4.0])
        >>> _reference_clip([p], 1.0), [round(g, 4) for g in p.grad.tolist()]
        (5.0, [0.6, 0.8])
    """
    grads = [param.grad for param in params if param.grad is not None]
    total = torch.zeros((), dtype=torch.float64)
    for grad in grads:
        total = total + full_tensor(grad).detach().double().pow(2).sum().cpu()
    norm = float(total.sqrt().float())
    scale = min(1.0, max_norm / (norm + 1e-6))
    for grad in grads:
        grad.mul_(scale)
    return norm


def _largest_difference(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    """The largest element of ``|a − b|`` (whole tensors; 0 where either is missing)."""
    if a is None or b is None:
        return 0.0
    a, b = full_tensor(a).detach().double(), full_tensor(b).detach().double()
    if a.shape != b.shape or not a.numel():
        return 0.0
    return float((a - b).abs().max())


def _grad_values(grads: Mapping[str, torch.Tensor | None]) -> list[torch.Tensor]:
    return [full_tensor(g).detach() for g in grads.values() if g is not None]


def _norm(tensors: Iterable[torch.Tensor]) -> float:
    return math.sqrt(sum(float(t.double().pow(2).sum()) for t in tensors))


@contextlib.contextmanager
def _same_draws(state: torch.Tensor) -> Iterator[None]:
    """Run with the CPU generator at ``state`` (where the reference's forward started: a rerun
    of it draws the same dropout masks), the caller's random state restored after."""
    with torch.random.fork_rng(devices=[]):
        torch.set_rng_state(state)
        yield


def _replay_value(value: Any) -> str:
    """``repr`` of a plan argument for the replay line, a tensor by its shape and dtype (an
    ``example_inputs`` batch would print every token).

    >>> _replay_value(torch.zeros(8, 16, dtype=torch.long))
    '<tensor 8×16 int64>'
    """
    if isinstance(value, torch.Tensor):
        return (
            f"<tensor {'×'.join(map(str, value.shape))} {str(value.dtype).removeprefix('torch.')}>"
        )
    if isinstance(value, (tuple, list)) and any(isinstance(v, torch.Tensor) for v in value):
        return f"({', '.join(_replay_value(v) for v in value)})"
    return repr(value)


def _named_buffers(model: Any) -> dict[str, torch.Tensor]:
    """Every local buffer by FQN (a pipeline's: its stage modules', under full-model FQNs)."""
    modules = model.modules if isinstance(getattr(model, "modules", None), list) else [model]
    return {fqn: buffer for module in modules for fqn, buffer in module.named_buffers()}


class _Run:
    """One rank's run: the plan and the reference side by side."""

    def __init__(self, config: _Config) -> None:
        self.config = config
        self.contract = config.contract
        self.mesh = _mesh(config.mesh_axes)
        torch.manual_seed(config.seed)
        model = config.model_fn()
        self.plan = make_plan(model, self.mesh, **config.plan_kwargs)
        self.reference = one_device_reference(copy.deepcopy(model), self.plan)
        # the reference's own low-precision error is measured against this fp32 twin
        self.twin = ExactTwin(copy.deepcopy(model)) if self.contract.unit else None
        self.own = OwnRounding()
        self.flips = FlipAllowance()
        self.low_choices: list[TopkCall] = []
        self._ref_draws = torch.get_rng_state()
        self.applied = apply(self.plan, model)
        self.named = dict(self.applied.named_parameters())
        self.ref_named = dict(self.reference.named_parameters())
        self.optimizer = _optimizer(config.optimizer, iter(self.named.values()))
        if self.plan.options.offload_optimizer:
            offload_states(self.optimizer)
        self.ref_optimizer = _optimizer(config.optimizer, iter(self.ref_named.values()))
        self.rule: UpdateRule = update_rule(self.ref_optimizer)
        fp16 = self.plan.options.precision == "fp16"
        self.ref_scaler: LossScaler | None = LossScaler() if fp16 else None
        runtime_step = make_train_step(
            self.plan,
            config.loss_fn,
            self.optimizer,
            max_norm=config.max_norm,
            scaler=LossScaler() if fp16 else None,
        )
        self.train_step = _ObservedStep.of(runtime_step, self._compare_grads)
        self.state = TrainState.create(self.applied, self.optimizer)
        self.data_index, self.data_ranks = data_parallel_rank(self.plan)
        self.result = _RankResult(reference_fqns=tuple(self.ref_named))
        self.plan_largest = 0.0  # the plan's largest (unscaled) gradient this step
        self.step = 0

    # ---------------------------------------------------------------- one step

    def train(self) -> _RankResult:
        for step in range(1, self.config.steps + 1):
            self.step = step
            inputs, targets, *rest = _batch(self.config, step - 1)
            positions = rest[0] if rest else None
            ref_loss, ref_finite = self._reference_backward(inputs, targets, positions)
            ref_largest = self._gradient_scale() if ref_finite else math.inf
            self.own = self._measure_own(ref_loss, ref_finite, inputs, targets, positions)
            loss, norm, finite = self._plan_step(inputs, targets, positions)
            self._compare_scalar(step, "loss", loss, ref_loss, self.own.loss, self.flips.loss)
            ref_norm, ref_grads, old_states = self._reference_clip_and_capture()
            ref_finite = ref_finite and math.isfinite(ref_loss) and math.isfinite(ref_norm)
            if ref_finite and finite:
                self._compare_scalar(
                    step, "grad norm", norm, ref_norm, self.own.grad_norm, self.flips.grad_norm
                )
            elif finite != ref_finite:
                self._compare_overflow(step, finite, ref_finite, ref_largest)
            if ref_finite:
                self.ref_optimizer.step()
                after_optimizer_step(self.reference)  # as the train step: MoE bias balancing
            if self.ref_scaler is not None:
                self.ref_scaler.update()
            self.ref_optimizer.zero_grad()
            if finite and ref_finite:
                self._compare_update(step, ref_grads, old_states)
            self._compare_buffers(step)
            self._resync()
            self.result.losses.append((loss, ref_loss))
            self._say_step(step, loss, ref_loss)
        self.result.held = set(self.named)
        self.result.update = self.rule.kind if self.rule.kind != "none" else self.rule.name
        return self.result

    def _say_step(self, step: int, loss: float, ref_loss: float) -> None:
        if self.config.progress is None or dist.get_rank() != 0:
            return
        compared = [c for c in self.result.comparisons if c.step == step]
        worst = max(compared, key=lambda c: c.ratio, default=None)
        closest = "" if worst is None else f" (closest: {worst.fqn} {worst.quantity} at "
        self.config.progress.say(
            f"step {step}/{self.config.steps}: loss {loss:.6f} under the plan, {ref_loss:.6f} on "
            f"one device; {len(compared)} comparisons{closest}"
            + ("" if worst is None else f"{worst.ratio:.2f}× its bound)")
        )

    def _reference_backward(
        self, inputs: torch.Tensor, targets: torch.Tensor, positions: torch.Tensor | None
    ) -> tuple[float, bool]:
        scale = self.ref_scaler.scale_value if self.ref_scaler else 1.0
        keywords = {} if positions is None else {positions_keyword(self.reference): positions}
        recorder = RecordTopk() if self.twin is not None else contextlib.nullcontext()
        self._ref_draws = torch.get_rng_state()  # the twin and the flipped run draw the same
        with recorder:
            output = self.reference(inputs, **keywords)
        self.low_choices = recorder.calls if isinstance(recorder, RecordTopk) else []
        loss = self.config.loss_fn(output, targets) / targets.numel()
        (loss * scale).backward()
        finite = self.ref_scaler.unscale_(self.ref_named.values()) if self.ref_scaler else True
        self._ref_loss = float(full_tensor(loss.detach()))
        return self._ref_loss, bool(finite)

    def _compare_overflow(
        self, step: int, finite: bool, ref_finite: bool, ref_largest: float
    ) -> None:
        """A step that overflowed (fp16) on one side only. Which of two correct computations
        overflows near fp16's limit is decided by where partial sums are taken — each of the
        plan's ``w`` data-parallel ranks or micro-batches sums a share of the tokens, and a
        share may exceed the total — and by how they round. So it is no difference when the
        side that stepped came within a factor ``2w`` of the limit (its largest scaled gradient
        ≥ 65,504 / 2w); farther from it, it fails."""
        largest = self.plan_largest if finite else ref_largest
        scale = self.ref_scaler.scale_value if self.ref_scaler is not None else 1.0
        pipeline = self.plan.pipeline
        micro = pipeline.microbatches if pipeline is not None else self.plan.options.microbatches
        ways = self.data_ranks * max(micro or 1, 1)
        limit = float(torch.finfo(torch.float16).max) / (2 * ways)
        near = largest * scale >= limit
        note = (
            f"plan finite={finite}, one device finite={ref_finite}; the side that stepped had "
            f"scaled gradients up to {largest * scale:.4g}"
            + (f", within a factor {2 * ways} of fp16's limit: rounding" if near else "")
        )
        self._record(
            step,
            "overflow skip",
            "<all>",
            0.0 if near else 1.0,
            0.0 if near else 1.0,
            0.0 if near else math.inf,
            note=note,
        )

    def _measure_own(
        self,
        ref_loss: float,
        ref_finite: bool,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        positions: torch.Tensor | None,
    ) -> OwnRounding:
        """The reference's own low-precision error this step: the same step in fp32."""
        self.flips = FlipAllowance()
        if self.twin is None or not ref_finite:
            return OwnRounding()
        keywords = {} if positions is None else {positions_keyword(self.twin.model): positions}
        with _same_draws(self._ref_draws):
            own = self.twin.measure(
                ref_loss,
                self.ref_named,
                inputs,
                targets,
                self.config.loss_fn,
                keywords,
                self.low_choices,
                self.contract.unit,
            )
        if own.near_ties:
            self.flips = self._flip_allowance(own.near_ties, inputs, targets, positions)
        return own

    def _flip_allowance(
        self,
        rows: dict[int, torch.Tensor],
        inputs: torch.Tensor,
        targets: torch.Tensor,
        positions: torch.Tensor | None,
    ) -> FlipAllowance:
        """What choosing the other way at the step's near-ties (a token routed to the expert
        just below its k-th, where rounding can tip it) changes on one device: the reference
        run again from the same parameters with those choices flipped, its gradients and
        buffers set aside and restored after."""
        grads = {fqn: p.grad for fqn, p in self.ref_named.items()}
        buffers = _named_buffers(self.reference)
        kept = {fqn: b.detach().clone() for fqn, b in buffers.items()}
        for param in self.ref_named.values():
            param.grad = None
        scale = self.ref_scaler.scale_value if self.ref_scaler else 1.0
        keywords = {} if positions is None else {positions_keyword(self.reference): positions}
        with FlipTopk(rows), _same_draws(self._ref_draws):
            output = self.reference(inputs, **keywords)
        loss = self.config.loss_fn(output, targets) / targets.numel()
        (loss * scale).backward()
        flipped = {
            fqn: full_tensor(p.grad).detach() / scale
            for fqn, p in self.ref_named.items()
            if p.grad is not None
        }
        allowance = FlipAllowance(
            rows=sum(int(r.sum()) for r in rows.values()),
            loss=abs(float(full_tensor(loss.detach())) - self._ref_loss),
            grad_norm=abs(_norm(flipped.values()) - _norm(_grad_values(grads))),
            grads={fqn: _largest_difference(g, grads[fqn]) for fqn, g in flipped.items()},
            buffers={fqn: _largest_difference(b.detach(), kept[fqn]) for fqn, b in buffers.items()},
        )
        with torch.no_grad():
            for fqn, buffer in buffers.items():
                buffer.copy_(kept[fqn])
        for fqn, param in self.ref_named.items():
            param.grad = grads[fqn]
        return allowance

    def _plan_step(
        self, inputs: torch.Tensor, targets: torch.Tensor, positions: torch.Tensor | None
    ) -> tuple[float, float, bool]:
        """One step of the runtime's own ``TrainStep`` on this rank's slice: its loss, gradient
        norm and whether it stepped (its gradients are compared before its clipping, by
        :class:`_ObservedStep`)."""
        per_rank = inputs.shape[0] // self.data_ranks
        mine = slice(self.data_index * per_rank, (self.data_index + 1) * per_rank)
        batch = StepBatch(
            inputs[mine],
            targets[mine],
            token_positions=None if positions is None else positions[mine],
        )
        self.state, metrics = self.train_step(self.state, batch)
        return metrics["loss"], metrics["grad_norm"], not metrics["skipped"]

    # ---------------------------------------------------------------- comparisons

    def _record(
        self,
        step: int,
        quantity: str,
        fqn: str,
        abs_error: float,
        rel_error: float,
        ratio: float,
        note: str = "",
        own_error: float | None = None,
    ) -> None:
        self.result.comparisons.append(
            Comparison(step, quantity, fqn, abs_error, rel_error, ratio, note, own_error)
        )

    def _bound(
        self, scale: float, own_error: float, rounded: float | None = None, flip: float = 0.0
    ) -> float:
        """The contract's bound on a quantity of largest magnitude ``scale`` whose one-device
        low-precision error is ``own_error`` (:func:`~meshtrain.testing.rounding.rounding_bound`),
        plus ``FLIP_FACTOR`` × what flipping the step's near-ties changes (``flip``)."""
        bound = rounding_bound(
            self.contract.tolerance, self.contract.unit, scale, own_error, rounded
        )
        return bound + FLIP_FACTOR * flip

    @staticmethod
    def _ratio(abs_error: float, bound: float) -> float:
        if abs_error == 0.0:
            return 0.0
        return abs_error / bound if bound > 0.0 else math.inf

    def _own(self, own_error: float) -> float | None:
        """What the report shows as the reference's own error (``None`` when unmeasured)."""
        return own_error if self.twin is not None else None

    def _compare_scalar(
        self,
        step: int,
        quantity: str,
        value: float,
        reference: float,
        own_error: float = 0.0,
        flip: float = 0.0,
    ) -> None:
        abs_error = abs(value - reference)
        rel_error = abs_error / max(abs(reference), 1e-30)
        if not math.isfinite(value) and not math.isfinite(reference):
            abs_error = rel_error = 0.0
        ratio = self._ratio(abs_error, self._bound(abs(reference), own_error, flip=flip))
        self._record(
            step, quantity, "<global>", abs_error, rel_error, ratio, own_error=self._own(own_error)
        )

    def _compare_tensor(
        self,
        step: int,
        quantity: str,
        fqn: str,
        value: torch.Tensor,
        reference: torch.Tensor,
        floor: float = 0.0,
        own_error: float = 0.0,
        rounded: float | None = None,
        flip: float = 0.0,
    ) -> None:
        diff = (value.double() - reference.double()).abs()
        abs_error = float(diff.max()) if diff.numel() else 0.0
        own = float(reference.double().abs().max()) if reference.numel() else 0.0
        scale = self._scale(own, floor, own_error)
        rel_error = abs_error / max(scale, 1e-30)
        note = (
            "numerically zero: measured against the step's largest gradient" if scale != own else ""
        )
        ratio = self._ratio(abs_error, self._bound(scale, own_error, rounded, flip))
        if flip and not note:
            note = f"{self.flips.rows} near-tie choice(s) allowed to flip"
        self._record(step, quantity, fqn, abs_error, rel_error, ratio, note, self._own(own_error))

    def _scale(self, own: float, floor: float, own_error: float = 0.0) -> float:
        """What a tensor's errors are measured against: its own largest magnitude, or — for a
        tensor that is numerically zero at this step's scale — ``floor``, the step's largest
        gradient: its rounding errors come from the magnitudes summed, not from their vanishing
        sum. Numerically zero: below the contract's tolerance of ``floor`` (e.g. a key bias,
        whose true gradient is 0); under low precision also below one rounding (u) of
        ``floor``, or a value the reference's own low-precision error is half as large as —
        all rounding (a bias before a BatchNorm: its terms cancel exactly in exact arithmetic,
        so what is left depends on the kernel's order of operations, not on the bias)."""
        if own >= floor:
            return own
        unit = self.contract.unit
        zero = own < self.contract.tolerance * floor or own < unit * floor
        return floor if zero or (unit and own_error >= own / 2) else own

    def _compare_grads(self) -> None:
        step = self.step
        floor = self._gradient_scale()
        self.plan_largest = max(
            (
                float(full_tensor(p.grad).detach().abs().max())
                for p in self.named.values()
                if p.grad is not None and p.grad.numel()
            ),
            default=0.0,
        )
        for fqn, param in self.named.items():
            reference = self.ref_named[fqn].grad
            if param.grad is None or reference is None:
                if (param.grad is None) != (reference is None):
                    self._record(
                        step,
                        "grad",
                        fqn,
                        math.inf,
                        math.inf,
                        math.inf,
                        note="gradient present on one side only",
                    )
                continue
            value, ref = full_tensor(param.grad).detach(), full_tensor(reference).detach()
            self._compare_tensor(
                step,
                "grad",
                fqn,
                value,
                ref,
                floor,
                self.own.grads.get(fqn, 0.0),
                flip=self.flips.grads.get(fqn, 0.0),
            )

    def _grad_bound(self, fqn: str, ref: torch.Tensor, floor: float) -> float:
        """A gradient's bound: the contract's reduction-order part of its scale, plus under low
        precision a multiple of the reference's own measured error of it."""
        own = float(ref.abs().max()) if ref.numel() else 0.0
        own_error = self.own.grads.get(fqn, 0.0)
        flip = self.flips.grads.get(fqn, 0.0)
        return self._bound(self._scale(own, floor, own_error), own_error, flip=flip)

    def _gradient_scale(self) -> float:
        """The largest gradient element of the one-device model this step."""
        grads = [p.grad for p in self.ref_named.values() if p.grad is not None]
        return max(
            (float(full_tensor(g).detach().abs().max()) for g in grads if g.numel()), default=0.0
        )

    def _reference_clip_and_capture(
        self,
    ) -> tuple[float, dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
        """The one-device gradient norm and clipping; its clipped gradients and the optimizer
        states before its step (what the update bounds start from)."""
        ref_params = list(self.ref_named.values())
        max_norm = self.config.max_norm if self.config.max_norm is not None else math.inf
        ref_norm = _reference_clip(ref_params, max_norm)
        self.result.clipped_steps += int(ref_norm > max_norm)
        grads = {
            fqn: full_tensor(p.grad).detach().clone()
            for fqn, p in self.ref_named.items()
            if p.grad is not None
        }
        states = {
            fqn: {
                key: full_tensor(value).detach().clone()
                for key, value in self.ref_optimizer.state.get(p, {}).items()
                if isinstance(value, torch.Tensor) and key in STATE_KEYS[self.rule.kind]
            }
            for fqn, p in self.ref_named.items()
        }
        return ref_norm, grads, states

    def _compare_update(
        self,
        step: int,
        ref_grads: dict[str, torch.Tensor],
        old_states: dict[str, dict[str, torch.Tensor]],
    ) -> None:
        if self.rule.kind == "none":
            return
        bitwise = self.contract.level == "bitwise"
        floor = max((float(g.abs().max()) for g in ref_grads.values() if g.numel()), default=0.0)
        for fqn, param in self.named.items():
            if fqn not in ref_grads:
                continue
            ref_param = self.ref_named[fqn]
            grad = ref_grads[fqn]
            # The clipped gradient carries the gradient's and the norm's relative error.
            delta = 2 * self._grad_bound(fqn, grad, floor)
            new_ref = full_tensor(ref_param.detach())
            bound = (
                None
                if bitwise
                else param_bound(
                    self.rule, grad, delta, old_states[fqn], self._step_count(ref_param), new_ref
                )
            )
            self._compare_elementwise(
                step, "param", fqn, full_tensor(param.detach()), new_ref, bound
            )
            state, ref_state = self.optimizer.state[param], self.ref_optimizer.state[ref_param]
            for key in STATE_KEYS[self.rule.kind]:
                value, reference = state.get(key), ref_state.get(key)
                if not isinstance(reference, torch.Tensor) or not isinstance(value, torch.Tensor):
                    continue
                reference = full_tensor(reference)
                bound = None if bitwise else state_bound(self.rule, key, grad, delta, reference)
                self._compare_elementwise(step, key, fqn, full_tensor(value), reference, bound)

    def _compare_buffers(self, step: int) -> None:
        """Every buffer the plan holds (running statistics, counters) against the one-device
        model's after the step: floating-point ones within the contract's relative bound (exact
        under a bitwise contract), the others exactly."""
        reference = _named_buffers(self.reference)
        for fqn, buffer in _named_buffers(self.applied).items():
            if fqn not in reference:
                continue
            value, ref = full_tensor(buffer).detach(), full_tensor(reference[fqn]).detach()
            if value.shape != ref.shape:
                self._record(
                    step,
                    "buffer",
                    fqn,
                    math.inf,
                    math.inf,
                    math.inf,
                    note=f"shape {tuple(value.shape)} vs {tuple(ref.shape)}",
                )
            elif ref.is_floating_point() and self.contract.level != "bitwise":
                # running statistics are fp32 arithmetic on low-precision activations: their
                # rounding is what the twin measures, not one rounding of the statistic
                own = self.twin.buffer_error(fqn, ref) if self.twin is not None else 0.0
                self._compare_tensor(
                    step,
                    "buffer",
                    fqn,
                    value,
                    ref,
                    own_error=own,
                    rounded=0.0,
                    flip=self.flips.buffers.get(fqn, 0.0),
                )
            else:  # exactly, but for what flipping the step's near-ties changes (counts)
                same = torch.equal(value, ref.to(value.dtype))
                error = 0.0 if same else self._exact_error(value, ref)
                allowed = FLIP_FACTOR * self.flips.buffers.get(fqn, 0.0)
                ratio = 0.0 if same else error / allowed if allowed else math.inf
                self._record(step, "buffer", fqn, error, error, ratio)

    @staticmethod
    def _exact_error(value: torch.Tensor, reference: torch.Tensor) -> float:
        if value.is_complex() or reference.is_complex() or value.dtype == torch.bool:
            return math.inf
        return float((value.double() - reference.double()).abs().max()) if value.numel() else 0.0

    def _step_count(self, ref_param: torch.Tensor) -> int:
        value = self.ref_optimizer.state[ref_param].get("step", 1)
        return int(value.item() if isinstance(value, torch.Tensor) else value)

    def _compare_elementwise(
        self,
        step: int,
        quantity: str,
        fqn: str,
        value: torch.Tensor,
        reference: torch.Tensor,
        bound: torch.Tensor | None,
    ) -> None:
        diff = (value.double() - reference.double()).abs()
        abs_error = float(diff.max()) if diff.numel() else 0.0
        scale = float(reference.double().abs().max()) if reference.numel() else 0.0
        rel_error = abs_error / max(scale, 1e-30)
        if bound is None:
            ratio = 0.0 if abs_error == 0.0 else math.inf
        else:
            over = diff / bound.double().clamp_min(1e-300)
            ratio = float(torch.where(diff == 0, 0.0, over).max()) if diff.numel() else 0.0
        self._record(step, quantity, fqn, abs_error, rel_error, ratio)

    # ---------------------------------------------------------------- re-sync

    @torch.no_grad()
    def _resync(self) -> None:
        """Copy the plan's parameters, optimizer states and buffers into the reference (every
        stage's, gathered over the pipeline axis), so the next step starts from the same point."""
        mine = {
            fqn: (
                full_tensor(param.detach()).clone(),
                {
                    key: full_tensor(value).clone()
                    for key, value in self.optimizer.state.get(param, {}).items()
                    if isinstance(value, torch.Tensor)
                },
            )
            for fqn, param in self.named.items()
        }
        buffers = {
            fqn: full_tensor(buffer.detach()).clone()
            for fqn, buffer in _named_buffers(self.applied).items()
        }
        gathered = [(mine, buffers)]
        if self.plan.pipeline is not None:
            group = device_mesh(self.mesh).get_group(self.plan.pipeline.axis)
            gathered = [({}, {}) for _ in range(dist.get_world_size(group))]
            dist.all_gather_object(gathered, (mine, buffers), group=group)
        ref_buffers = _named_buffers(self.reference)
        for values, stage_buffers in gathered:
            for fqn, buffer in stage_buffers.items():
                if fqn in ref_buffers:
                    _local(ref_buffers[fqn]).copy_(buffer)
            for fqn, (value, states) in values.items():
                ref_param = self.ref_named.get(fqn)
                if ref_param is None:
                    continue
                _local(ref_param.detach()).copy_(value)
                self._take_state(ref_param, states)
        if self.twin is not None:
            self.twin.take(self.ref_named, ref_buffers)
        if self.ref_scaler is not None and self.train_step.scaler is not None:
            self.ref_scaler.load_state_dict(self.train_step.scaler.state_dict())

    def _take_state(self, ref_param: torch.Tensor, states: dict[str, torch.Tensor]) -> None:
        """The reference's optimizer state for ``ref_param`` becomes the plan's: copied where
        both have it, created where only the plan has it, dropped where the plan has none (a
        step one side skipped — an fp16 overflow on one side only — leaves them apart)."""
        if not states:
            self.ref_optimizer.state.pop(ref_param, None)
            return
        ref_state = self.ref_optimizer.state[ref_param]
        for key, state in states.items():
            if not isinstance(ref_state.get(key), torch.Tensor):
                shaped = state.shape == ref_param.shape
                ref_state[key] = torch.zeros_like(ref_param) if shaped else state.clone()
            _local(ref_state[key]).copy_(state)


# ----------------------------------------------------------------------------- merge


def _merge(config: _Config, plan: Plan, results: list[_RankResult]) -> EquivalenceReport:
    worst: dict[tuple[int, str, str], Comparison] = {}
    for result in results:
        for comparison in result.comparisons:
            key = (comparison.step, comparison.quantity, comparison.fqn)
            if key not in worst or comparison.ratio > worst[key].ratio:
                worst[key] = comparison
    held = set().union(*(r.held for r in results))
    for fqn in results[0].reference_fqns:
        if fqn not in held:
            worst[(1, "missing", fqn)] = Comparison(
                1,
                "missing",
                fqn,
                math.inf,
                math.inf,
                math.inf,
                note="no rank holds this parameter of the one-device model",
            )
    comparisons = tuple(sorted(worst.values(), key=lambda c: (c.step, c.quantity, c.fqn)))
    update = results[0].update
    unchecked = (
        ""
        if update in ("sgd", "adam")
        else f"parameters and optimizer states not bounded: no update model for {update} "
        "(loss, gradient norm and gradients are checked at every step)"
    )
    options = "".join(
        f", {k!r}: {_replay_value(v)}" for k, v in config.plan_kwargs.items() if k != "rules"
    )
    replay = (
        f"assert_equivalent({config.model_fn!r}, {dict(config.mesh_axes)}, "
        f"{{'rules': <rules>{options}}}, steps={config.steps}, optimizer={config.optimizer!r}, "
        f"seed={config.seed})"
    )
    return EquivalenceReport(
        contract=config.contract,
        comparisons=comparisons,
        losses=tuple(results[0].losses),
        clipped_steps=max(r.clipped_steps for r in results),
        plan_json=plan.to_json(),
        replay=replay,
        unchecked=unchecked,
    )


__all__ = [
    "Comparison",
    "EquivalenceReport",
    "TokenBatches",
    "assert_equivalent",
    "summed_cross_entropy",
]
