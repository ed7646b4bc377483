"""The harness catches real parallelism bugs (tier 2: gloo ranks).

Each fault is planted only here, on every rank, for one run (a context manager passed as
``rank_context``); the library itself is never changed. Every fault must give an
``EquivalenceError`` whose report names the right step, quantity and tensor.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import zoo
from torch import nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel

import meshtrain as mt
from meshtrain.models import default_rules
from meshtrain.testing.harness import EquivalenceReport, assert_equivalent
from meshtrain.testing.strategies import DebugLlama

pytestmark = pytest.mark.spmd


@contextlib.contextmanager
def missing_reduction_on_one_axis() -> Iterator[None]:
    """HSDP whose gradients are reduced over the shard axis only, not the replicate axis."""
    from meshtrain.lower.data import parallel as data_parallel

    original = data_parallel.fully_shard

    def shard_axis_only(module: nn.Module, *, mesh: Any, **kwargs: Any) -> Any:
        if mesh.ndim > 1:
            mesh = mesh[mesh.mesh_dim_names[-1]]
        return original(module, mesh=mesh, **kwargs)

    with mock.patch.object(data_parallel, "fully_shard", shard_axis_only):
        yield


@contextlib.contextmanager
def gradients_averaged_twice() -> Iterator[None]:
    """FSDP averages over data-parallel ranks although the loss is already divided by the
    global token count."""
    from torch.distributed.fsdp import FSDPModule

    original = FSDPModule.set_gradient_divide_factor

    def average(self: FSDPModule, factor: float) -> None:
        original(self, factor * dist.get_world_size())  # one more division by the ranks

    with mock.patch.object(FSDPModule, "set_gradient_divide_factor", average):
        yield


class _WrongDimColwise(ColwiseParallel):
    """Column-wise, but square weights are cut along dim 1 and the slice labelled dim 0."""

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: Any) -> None:
        for param_name, param in list(module.named_parameters()):
            if param.ndim == 2 and param.shape[0] == param.shape[1]:
                local = distribute_tensor(param.detach(), device_mesh, [Shard(1)]).to_local()
                sharded = DTensor.from_local(local.t().contiguous(), device_mesh, [Shard(0)])
            else:
                sharded = distribute_tensor(param.detach(), device_mesh, [Shard(0)])
            module.register_parameter(param_name, nn.Parameter(sharded))


@contextlib.contextmanager
def wrong_shard_dim_in_colwise() -> Iterator[None]:
    from meshtrain.lower.tensor import parallel as tensor_parallel

    with mock.patch.object(tensor_parallel, "ColwiseParallel", _WrongDimColwise):
        yield


@contextlib.contextmanager
def microbatch_losses_not_rescaled() -> Iterator[None]:
    """Each pipeline micro-batch's loss is its own mean, not a share of the step's tokens."""
    from meshtrain.train import step

    def own_mean(self: Any, output: torch.Tensor, target: torch.Tensor) -> Any:
        return self.loss_fn(output, target) / target.numel() * self.scale

    with mock.patch.object(step._ScheduleLoss, "__call__", own_mean):
        yield


@contextlib.contextmanager
def stage_skips_a_layer() -> Iterator[None]:
    """The second pipeline stage drops its first block."""
    from meshtrain.lower import pipeline

    original = pipeline._prune

    def prune_one_more(body: nn.Module, stage: Any, plan: Any) -> Any:
        if stage.index == 1:  # the stage forgets its first block: its parameters go missing
            first = next(m for m in stage.modules if m.startswith("layers."))
            stage = dataclasses.replace(
                stage, modules=tuple(m for m in stage.modules if m != first)
            )
        return original(body, stage, plan)

    with mock.patch.object(pipeline, "_prune", prune_one_more):
        yield


@contextlib.contextmanager
def clipping_by_local_norm() -> Iterator[None]:
    """The train step clips by this rank's shard norm instead of the global one."""
    from meshtrain.train import step

    def local_norm(parameters: Any, *, plan: Any = None, names: Any = None) -> torch.Tensor:
        squares = torch.zeros((), dtype=torch.float64)
        for param in parameters:
            if param.grad is not None:
                grad = param.grad
                local = grad.to_local() if isinstance(grad, DTensor) else grad
                squares = squares + local.double().pow(2).sum()
        return squares.sqrt().float()

    with mock.patch.object(step, "global_grad_norm", local_norm):
        yield


@contextlib.contextmanager
def batch_norm_running_variance_biased() -> Iterator[None]:
    """Data-parallel BatchNorm updates its running variance with the biased batch variance
    (one device uses the unbiased one): only the buffer differs, not the step's gradients."""
    from meshtrain.lower.data import batch_norm

    original = batch_norm._update_running

    def biased(module: nn.Module, mean: torch.Tensor, var: torch.Tensor, n: float) -> None:
        original(module, mean, var * (n - 1.0) / n, n)  # undo the unbiasing

    with mock.patch.object(batch_norm, "_update_running", biased):
        yield


@contextlib.contextmanager
def pipeline_norm_from_one_stage() -> Iterator[None]:
    """The train step measures a pipelined plan's gradient norm over this stage's parameters only
    (the squares not summed over the pipeline axis), and clips by it."""
    from meshtrain.train import step

    def one_stage(self: Any, params: list[Any], named: Any) -> float:
        norm = float(step.global_grad_norm(params))  # no plan: no sum over the stages
        if self.max_norm is not None and math.isfinite(norm):
            step.scale_grads_(params, norm, self.max_norm)
        return norm

    with mock.patch.object(step.TrainStep, "_grad_norm", one_stage):
        yield


def tiny_image_batches(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """8 random 2×2 RGB images and their labels: 32 values per BatchNorm channel, so the biased
    variance is 1/31 off the unbiased one (at 16×16 it is 1/2047, still caught, at 2.6× the
    bound: the contract's rounding allowance grows with the elements summed)."""
    generator = torch.Generator().manual_seed(300 + step)
    images = torch.randn(8, 3, 2, 2, generator=generator)
    return images, torch.randint(0, 10, (8,), generator=generator)


PIPELINE = {
    "rules": default_rules(),
    "zero": 2,
    "pipeline": mt.Pipeline(schedule="GPipe", microbatches=2),
}
FAULTS = {
    # name: (fault, mesh, plan options, extra harness kwargs, and the quantity and tensor that
    # must be reported far outside the bound at step 1 ("" where every gradient is wrong)
    "missing-reduction-on-one-axis": (
        missing_reduction_on_one_axis,
        {"rep": 2, "dp": 2, "tp": 1},
        {"rules": default_rules(fsdp=("rep", "dp"))},
        {},
        "grad",
        "",
    ),
    "gradients-averaged-twice": (
        gradients_averaged_twice,
        {"dp": 2, "tp": 1},
        {"rules": default_rules(), "grad_reduction": "sum"},
        {},
        "grad",
        "",
    ),
    "wrong-shard-dim-in-colwise": (
        wrong_shard_dim_in_colwise,
        {"dp": 1, "tp": 2},
        {"rules": default_rules()},
        {},
        "grad",
        "layers.0.attention.w",
    ),
    "microbatch-losses-not-rescaled": (
        microbatch_losses_not_rescaled,
        {"pp": 2, "dp": 1, "tp": 1},
        PIPELINE,
        {},
        "loss",
        "<global>",
    ),
    "stage-skips-a-layer": (
        stage_skips_a_layer,
        {"pp": 2, "dp": 1, "tp": 1},
        PIPELINE,
        {},
        "missing",
        "layers.2.",
    ),
    "clipping-by-local-norm": (
        clipping_by_local_norm,
        {"dp": 2, "tp": 1},
        {"rules": default_rules()},
        {"max_norm": 0.1},
        "grad norm",
        "<global>",
    ),
    "batch-norm-running-variance-biased": (
        batch_norm_running_variance_biased,
        {"dp": 2},
        {"rules": zoo.REPLICATED, "zero": 3},
        {"model": zoo.cnn, "batches": tiny_image_batches},
        "buffer",
        "blocks.1.norm.running_var",
    ),
    "pipeline-norm-from-one-stage": (
        pipeline_norm_from_one_stage,
        {"pp": 2, "dp": 1, "tp": 1},
        PIPELINE,
        {},
        "grad norm",
        "<global>",
    ),
}


@pytest.mark.parametrize("name", list(FAULTS))
def test_planted_fault_is_caught_with_a_readable_report(name: str) -> None:
    fault, mesh, options, extra, quantity, tensor = FAULTS[name]
    extra = dict(extra)
    model = extra.pop("model", DebugLlama(4))
    # Without the fault the same run is within its contract ...
    clean = assert_equivalent(model, mesh, options, steps=1, **extra)
    assert clean.passed
    # ... with it, the harness stops at step 1 and names what diverged.
    with pytest.raises(mt.EquivalenceError) as caught:
        assert_equivalent(model, mesh, options, steps=1, rank_context=fault, **extra)
    report: EquivalenceReport = caught.value.report  # type: ignore[attr-defined]
    first = report.first_divergence
    assert first is not None and first.step == 1, report.format()
    # far outside the contract, not a borderline case
    assert any(
        c.step == 1 and c.quantity == quantity and c.fqn.startswith(tensor) and c.ratio > 100
        for c in report.failures
    ), report.format()
    text = str(caught.value)
    for part in (
        "does NOT train like one device",
        "first divergence: step 1",
        "plan JSON: {",
        f"replay: assert_equivalent({model!r}",
    ):
        assert part in text, text


def test_report_lists_the_contract_and_worst_tensors() -> None:
    report = assert_equivalent(
        DebugLlama(2), {"dp": 2, "tp": 2}, {"rules": default_rules()}, optimizer="adamw"
    )
    text = report.format()
    assert "trains like one device" in text and "reduction-order" in text, text
    assert "data-parallel gradient and loss sum (2 ways" in text, text
    assert "tensor-parallel partial products (2 ways" in text, text


class RunningMeanLM(nn.Module):
    """A token model with a hand-written statistic: a buffer tracking the running mean of its
    embeddings, updated from whatever batch its forward sees — under data parallelism each
    rank's own share, so the buffer drifts from one device's (a model bug the harness must
    report, though every gradient matches)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.head = nn.Linear(16, 32)
        self.register_buffer("running_mean", torch.zeros(16))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(tokens)
        if self.training:
            with torch.no_grad():
                self.running_mean.mul_(0.9).add_(hidden.mean(dim=(0, 1)), alpha=0.1)
        return self.head(hidden)


@pytest.mark.filterwarnings("ignore:.*FSDP2-wrapped module .* returned a view tensor")
def test_a_buffer_updated_from_each_ranks_local_batch_is_reported() -> None:
    """The planner refuses this model under data parallelism (the abstract run finds the
    buffer written from the batch); with that refusal kept as a note, the harness still
    reports the buffer, and only the buffer."""
    from meshtrain.plan.proof.run import refusals_as_notes

    rules = mt.Rules({r".*": mt.P()}, fsdp="dp")
    # one rank sees the whole batch: the buffer is one device's
    assert assert_equivalent(RunningMeanLM, {"dp": 1}, rules, steps=1).passed
    with pytest.raises(mt.PlanError, match="buffer 'running_mean' is written from the batch"):
        assert_equivalent(RunningMeanLM, {"dp": 2}, rules, steps=1)
    with refusals_as_notes(), pytest.raises(mt.EquivalenceError) as caught:
        assert_equivalent(RunningMeanLM, {"dp": 2}, rules, steps=1, rank_context=refusals_as_notes)
    report: EquivalenceReport = caught.value.report  # type: ignore[attr-defined]
    first = report.first_divergence
    assert first is not None and (first.step, first.quantity, first.fqn) == (
        1,
        "buffer",
        "running_mean",
    ), report.format()
    assert first.ratio > 100, report.format()
    # every gradient, parameter and optimizer state still matches: only the buffer tells
    assert {c.quantity for c in report.failures} == {"buffer"}, report.format()
