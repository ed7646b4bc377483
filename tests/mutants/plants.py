"""The planted bugs of the mutation benchmark: each a context manager that patches one function
of meshtrain (or of the PyTorch code it lowers to) in the process that enters it — never a file
on disk. ``tests/mutants/site/sitecustomize.py`` enters one in every Python process (the test
process and each SPMD rank) when ``MESHTRAIN_MUTANT`` names it; the harness column enters it on
every rank through ``assert_equivalent(..., rank_context=...)``.

Kinds are those reported against Megatron-LM and DeepSpeed: dropped or doubled reductions, wrong
token counts, local clipping norms, wrong shard dims, micro-batch scaling, skipped ties, local
BatchNorm statistics, local log-sum-exp maxima, unreduced adapters, shard offsets, per-rank seeds.
The ``neutral_*`` ones are numerically neutral rewrites that must not be flagged.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import math
from collections.abc import Iterator
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from torch import nn

# ---------------------------------------------------------------- reductions


@contextlib.contextmanager
def sp_norm_grad_not_reduced() -> Iterator[None]:
    """Sequence-parallel norms' partial gradients are never all-reduced over tp (no FSDP2)."""
    tensor_parallel = importlib.import_module("meshtrain.lower.tensor.parallel")

    original = tensor_parallel.PartialGradSync.__init__

    def adapters_only(self: Any, fqns: tuple[str, ...] = ()) -> None:
        original(self, tuple(f for f in fqns if "lora_" in f))

    with mock.patch.object(tensor_parallel.PartialGradSync, "__init__", adapters_only):
        yield


@contextlib.contextmanager
def adapter_grad_not_reduced() -> Iterator[None]:
    """A tensor-parallel LoRA Linear's replicated adapter keeps its partial gradient."""
    tensor_parallel = importlib.import_module("meshtrain.lower.tensor.parallel")

    original = tensor_parallel.PartialGradSync.__init__

    def norms_only(self: Any, fqns: tuple[str, ...] = ()) -> None:
        original(self, tuple(f for f in fqns if "lora_" not in f))

    with mock.patch.object(tensor_parallel.PartialGradSync, "__init__", norms_only):
        yield


@contextlib.contextmanager
def partial_grad_not_reduced() -> Iterator[None]:
    """The plan's partial gradients (a replicated parameter meeting tp-sharded activations) are
    left as each rank computed them: the lowering's replication on shards is skipped."""
    with mock.patch("meshtrain.lower.tensor.parallel._replicate_on_shards"):
        yield


@contextlib.contextmanager
def gathered_output_left_sharded() -> Iterator[None]:
    """``colwise_gathered`` lowered as plain column-wise: its output stays sharded."""
    tensor_parallel = importlib.import_module("meshtrain.lower.tensor.parallel")
    ir = importlib.import_module("meshtrain.plan.ir")
    plain = tensor_parallel.LOWERINGS[ir.TPStyle.COLWISE]
    with mock.patch.dict(tensor_parallel.LOWERINGS, {ir.TPStyle.COLWISE_GATHERED: plain}):
        yield


@contextlib.contextmanager
def replicated_grad_summed_over_tp() -> Iterator[None]:
    """The whole parameters' local tensors hand back their gradients as partial sums over tp, so
    every tensor-parallel rank's (complete) gradient is summed once per rank."""
    replicated = importlib.import_module("meshtrain.lower.tensor.replicated")
    from torch.distributed.tensor import DTensor, Partial

    def to_local(self: Any, module: nn.Module, args: Any) -> None:
        frame = []
        for owner, name in self.slots:
            param = owner._parameters.get(name)
            if isinstance(param, DTensor):
                frame.append((owner, name, param))
                owner._parameters[name] = param.to_local(grad_placements=(Partial(),))
        self.saved.append(frame)

    with mock.patch.object(replicated.LocalParameters, "to_local", to_local):
        yield


@contextlib.contextmanager
def dp_gradient_divided_twice() -> Iterator[None]:
    """The loss is not multiplied back by the data-parallel size before FSDP2's mean."""
    step = importlib.import_module("meshtrain.train.step")

    with mock.patch.object(step, "backward_factor", lambda plan: 1.0):
        yield


@contextlib.contextmanager
def dp_division_missing() -> Iterator[None]:
    """FSDP2 sums gradients over data-parallel ranks where the loss expects their mean."""
    from torch.distributed.fsdp import FSDPModule

    data_parallel = importlib.import_module("meshtrain.lower.data.parallel")
    flat = importlib.import_module("meshtrain.lower.flat")

    original = data_parallel.apply_data_parallel

    def summing(plan: Any, model: nn.Module) -> None:
        original(plan, model)
        for module in model.modules():
            if isinstance(module, FSDPModule):  # plain sums (gloo has no PREMUL_SUM)
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)

    with (
        mock.patch.object(data_parallel, "apply_data_parallel", summing),
        mock.patch.object(flat, "apply_data_parallel", summing),
    ):
        yield


@contextlib.contextmanager
def hsdp_reduces_one_axis() -> Iterator[None]:
    """HSDP reduces gradients over the shard axis only, not the replicate axis."""
    data_parallel = importlib.import_module("meshtrain.lower.data.parallel")

    original = data_parallel.fully_shard

    def shard_axis_only(module: nn.Module, *, mesh: Any, **kwargs: Any) -> Any:
        if mesh.ndim > 1:
            mesh = mesh[mesh.mesh_dim_names[-1]]
        return original(module, mesh=mesh, **kwargs)

    with mock.patch.object(data_parallel, "fully_shard", shard_axis_only):
        yield


@contextlib.contextmanager
def last_microbatch_not_reduced() -> Iterator[None]:
    """Gradient accumulation never marks the last micro-batch: zero 0/1 never synchronise."""
    import meshtrain

    data_parallel = importlib.import_module("meshtrain.lower.data.parallel")
    step = importlib.import_module("meshtrain.train.step")

    original = data_parallel.micro_batch

    def never_last(plan: Any, model: nn.Module, *, last: bool) -> Any:
        return original(plan, model, last=False)

    with (
        mock.patch.object(data_parallel, "micro_batch", never_last),
        mock.patch.object(step, "micro_batch", never_last),
        mock.patch.object(meshtrain, "micro_batch", never_last),
    ):
        yield


# ---------------------------------------------------------------- loss and token counts


@contextlib.contextmanager
def local_token_count() -> Iterator[None]:
    """The loss is divided by this rank's loss tokens instead of the global count."""
    loss = importlib.import_module("meshtrain.train.loss")

    def local_only(self: Any, plan: Any, local: int) -> None:
        self._pending = None
        self._value = torch.tensor(float(local))

    with mock.patch.object(loss.StepTokens, "__init__", local_only):
        yield


@contextlib.contextmanager
def fp16_backward_from_scale_times_ranks() -> Iterator[None]:
    """Under the data-parallel mean each rank's fp16 backward starts from the loss scale times
    the ranks and is unscaled by the scale alone (the code before the fix): the same gradients
    when nothing overflows, but a plan overflows ranks× sooner than one device."""
    step = importlib.import_module("meshtrain.train.step")
    scaler = importlib.import_module("meshtrain.train.scaler")
    forward_backward, unscale = step.forward_backward, scaler.LossScaler.unscale_

    def scaled_up(plan: Any, model: Any, batch: Any, loss_fn: Any, *, loss_scale: float) -> Any:
        factor = step.backward_factor(plan) if loss_scale != 1.0 else 1.0
        return forward_backward(plan, model, batch, loss_fn, loss_scale=loss_scale * factor)

    def by_the_scale(self: Any, parameters: Any, scale: float | None = None) -> bool:
        return unscale(self, parameters)

    with (
        mock.patch.object(step, "forward_backward", scaled_up),
        mock.patch.object(scaler.LossScaler, "unscale_", by_the_scale),
    ):
        yield


@contextlib.contextmanager
def moe_counts_last_micro_batch() -> Iterator[None]:
    """meshtrain's MoE routers keep only the last forward's counts even inside a train step:
    statistics of the last micro-batch under accumulation or a pipeline."""
    moe_experts = importlib.import_module("meshtrain.models.moe_experts")

    def no_step(self: Any) -> None:
        self.counting_step = False

    with mock.patch.object(moe_experts.Router, "begin_step", no_step):
        yield


@contextlib.contextmanager
def moe_counts_evaluation_forwards() -> Iterator[None]:
    """meshtrain's MoE routers count an evaluation's forwards too: a step's ``tokens_per_expert``
    and the loss-free balancing bias then depend on how often the run evaluates."""
    moe_experts = importlib.import_module("meshtrain.models.moe_experts")
    original = moe_experts.Router._count

    def counting_always(self: Any, top_k_index: torch.Tensor) -> None:
        training = self.training
        self.training = True
        try:
            original(self, top_k_index)
        finally:
            self.training = training

    with mock.patch.object(moe_experts.Router, "_count", counting_always):
        yield


@contextlib.contextmanager
def kv_cache_positions_restart() -> Iterator[None]:
    """Generation's cached steps give the new token position 0 instead of its place in the
    text: its rotary embedding is the first token's."""
    generation = importlib.import_module("meshtrain.recipes.generation")
    original = generation._DecoderCache.logits

    def restarted(self: Any, context: torch.Tensor) -> torch.Tensor:
        arange = torch.arange

        def from_zero(start: int, end: int | None = None, **kwargs: Any) -> torch.Tensor:
            return arange(end - start, **kwargs) if end is not None else arange(start, **kwargs)

        with mock.patch.object(generation.torch, "arange", from_zero):
            return original(self, context)

    with mock.patch.object(generation._DecoderCache, "logits", restarted):
        yield


@contextlib.contextmanager
def lookalike_runs_on_shared_fakes() -> Iterator[None]:
    """The plan-time proof lets a look-alike block that must run (its representative changed
    its input's shape) run on its representative's fake tensors, with no hooks inside it,
    instead of starting again with its own: what it meets is not seen, or is named after the
    representative's parameters."""
    modules = importlib.import_module("meshtrain.plan.proof.modules")

    def pass_through(self: Any, forward: Any, representative: str, fqn: str) -> Any:
        rank = self.rank

        def run(*args: Any, **kwargs: Any) -> Any:
            if representative in rank.kept_shard and args and isinstance(args[0], torch.Tensor):
                rank.copies[fqn] = representative
                return args[0]
            return forward(*args, **kwargs)

        return run

    with mock.patch.object(modules.ModuleWatch, "_pass_through", pass_through):
        yield


@contextlib.contextmanager
def accumulation_mean_per_microbatch() -> Iterator[None]:
    """Each accumulated micro-batch's loss is its own mean: the step's gradient is
    ``microbatches`` times too large."""
    step = importlib.import_module("meshtrain.train.step")

    def own_mean(
        plan: Any,
        model: Any,
        inputs: Any,
        targets: Any,
        loss_fn: Any,
        tokens: Any,
        loss_scale: float,
    ) -> torch.Tensor:
        summed = torch.zeros((), dtype=torch.float32)
        for i, (x, y) in enumerate(zip(inputs, targets)):
            with step.micro_batch(plan, model, last=i == len(inputs) - 1), step.loss_parallel(plan):
                out = loss_fn(model(x), y) / (tokens.value / len(inputs))
                (out * loss_scale).backward()
            summed += step.plain_loss(out) / len(inputs)
        return summed

    with mock.patch.object(step, "_accumulate", own_mean):
        yield


@contextlib.contextmanager
def pipeline_microbatch_not_rescaled() -> Iterator[None]:
    """Each pipeline micro-batch's loss is its own mean, not a share of the step's tokens."""
    step = importlib.import_module("meshtrain.train.step")

    def own_mean(self: Any, output: torch.Tensor, target: torch.Tensor) -> Any:
        return self.loss_fn(output, target) / target.numel() * self.scale

    with mock.patch.object(step._ScheduleLoss, "__call__", own_mean):
        yield


@contextlib.contextmanager
def loss_not_summed_over_data_ranks() -> Iterator[None]:
    """The reported step loss is this data-parallel rank's share only."""
    loss = importlib.import_module("meshtrain.train.loss")
    step = importlib.import_module("meshtrain.train.step")

    def pipeline_only(plan: Any, value: torch.Tensor) -> torch.Tensor:
        if plan.pipeline is not None:
            group = loss.group_over(plan, (plan.pipeline.axis,))
            if group is not None:
                dist.all_reduce(value, group=group)
        return value

    with (
        mock.patch.object(loss, "reduce_loss", pipeline_only),
        mock.patch.object(step, "reduce_loss", pipeline_only),
    ):
        yield


@contextlib.contextmanager
def loss_not_summed_over_stages() -> Iterator[None]:
    """A pipelined step's loss is reduced over data ranks only: stages but the last report 0."""
    loss = importlib.import_module("meshtrain.train.loss")

    with mock.patch.object(loss, "loss_axes", lambda plan: plan.data_axes):
        yield


@contextlib.contextmanager
def batch_shard_offset() -> Iterator[None]:
    """Every data-parallel rank takes the first slice of the global batch."""
    harness = importlib.import_module("meshtrain.testing.harness")
    loss = importlib.import_module("meshtrain.train.loss")

    original = loss.data_parallel_rank

    def first_slice(plan: Any) -> tuple[int, int]:
        return 0, original(plan)[1]

    with (
        mock.patch.object(loss, "data_parallel_rank", first_slice),
        mock.patch.object(harness, "data_parallel_rank", first_slice),
    ):
        yield


@contextlib.contextmanager
def logsumexp_local_max() -> Iterator[None]:
    """Loss-parallel cross-entropy shifts each vocabulary shard by its own maximum (the max
    all-reduce dropped), so the shards' exponentials are summed on different scales."""
    from torch.distributed._functional_collectives import all_reduce
    from torch.distributed.tensor.parallel import loss as tp_loss

    def local_max(x: Any, dim: int, half_to_float: bool, mesh: Any, mesh_dim: int) -> Any:
        x = x.float()
        shifted = x - torch.amax(x, dim, keepdim=True)
        total = all_reduce(torch.exp(shifted).sum(dim, keepdim=True), "sum", (mesh, mesh_dim))
        return shifted - torch.log(total)

    with mock.patch.object(tp_loss, "_log_softmax", local_max):
        yield


@contextlib.contextmanager
def vocab_mask_off_by_one() -> Iterator[None]:
    """The vocab-parallel mask (embedding lookups and loss-parallel targets, DTensor's
    ``_MaskPartial``) ends one id early: each shard's last row counts as outside it, so no rank
    looks that id up and its loss target reads row 0 of the shard."""
    from torch.distributed.tensor.placement_types import _MaskPartial

    def off_by_one(tensor: Any, offset: Any, size: Any) -> tuple[Any, Any]:
        mask = (tensor < offset) | (tensor >= offset + size - 1)
        masked = tensor.clone() - offset
        masked[mask] = 0
        return mask, masked

    with mock.patch.object(_MaskPartial, "_mask_tensor", staticmethod(off_by_one)):
        yield


# ---------------------------------------------------------------- clipping


@contextlib.contextmanager
def clip_norm_from_local_shards() -> Iterator[None]:
    """Clipping uses this rank's shard norm instead of the global one."""
    from torch.distributed.tensor import DTensor

    clip = importlib.import_module("meshtrain.train.clip")
    step = importlib.import_module("meshtrain.train.step")

    def local_norm(parameters: Any, *, plan: Any = None, names: Any = None) -> torch.Tensor:
        squares = torch.zeros((), dtype=torch.float64)
        for param in parameters:
            if param.grad is not None:
                grad = param.grad
                local = grad.to_local() if isinstance(grad, DTensor) else grad
                squares = squares + local.double().pow(2).sum()
        return squares.sqrt().float()

    with (
        mock.patch.object(clip, "global_grad_norm", local_norm),
        mock.patch.object(step, "global_grad_norm", local_norm),
    ):
        yield


@contextlib.contextmanager
def pipeline_norm_from_one_stage() -> Iterator[None]:
    """A pipelined step's gradient norm covers this stage's parameters only."""
    step = importlib.import_module("meshtrain.train.step")

    def one_stage(self: Any, params: list[Any], named: Any) -> float:
        norm = float(step.global_grad_norm(params))  # no plan: no sum over the stages
        if self.max_norm is not None and math.isfinite(norm):
            step.scale_grads_(params, norm, self.max_norm)
        return norm

    with mock.patch.object(step.TrainStep, "_grad_norm", one_stage):
        yield


def _patch_scale(scale_fn: Any) -> Any:
    clip = importlib.import_module("meshtrain.train.clip")
    step = importlib.import_module("meshtrain.train.step")

    @torch.no_grad()
    def scale_grads_(parameters: Any, norm: float, max_norm: float) -> None:
        scale = scale_fn(norm, max_norm)
        for param in parameters:
            if param.grad is not None and scale is not None:
                param.grad.mul_(scale)

    return contextlib.ExitStack(), [
        mock.patch.object(clip, "scale_grads_", scale_grads_),
        mock.patch.object(step, "scale_grads_", scale_grads_),
    ]


@contextlib.contextmanager
def _scaled(scale_fn: Any) -> Iterator[None]:
    stack, patches = _patch_scale(scale_fn)
    with stack:
        for patch in patches:
            stack.enter_context(patch)
        yield


@contextlib.contextmanager
def clipping_skipped() -> Iterator[None]:
    """Gradients are never scaled down, whatever their norm."""
    with _scaled(lambda norm, max_norm: None):
        yield


@contextlib.contextmanager
def clipping_scales_up() -> Iterator[None]:
    """The clip factor lacks its ``min(1, ...)``: small gradients are scaled up to max_norm."""
    with _scaled(lambda norm, max_norm: max_norm / (norm + 1e-6)):
        yield


# ---------------------------------------------------------------- tensor parallel lowering


@contextlib.contextmanager
def colwise_wrong_shard_dim() -> Iterator[None]:
    """Column-wise, but square weights are cut along dim 1 and the slice labelled dim 0."""
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel

    tensor_parallel = importlib.import_module("meshtrain.lower.tensor.parallel")

    class WrongDimColwise(ColwiseParallel):
        def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: Any) -> None:
            for param_name, param in list(module.named_parameters()):
                if param.ndim == 2 and param.shape[0] == param.shape[1]:
                    local = distribute_tensor(param.detach(), device_mesh, [Shard(1)]).to_local()
                    sharded = DTensor.from_local(local.t().contiguous(), device_mesh, [Shard(0)])
                else:
                    sharded = distribute_tensor(param.detach(), device_mesh, [Shard(0)])
                module.register_parameter(param_name, nn.Parameter(sharded))

    with mock.patch.object(tensor_parallel, "ColwiseParallel", WrongDimColwise):
        yield


@contextlib.contextmanager
def tie_skipped() -> Iterator[None]:
    """Tied weights are not re-tied after tensor parallelism: embedding and head train apart."""
    tensor_parallel = importlib.import_module("meshtrain.lower.tensor.parallel")

    with mock.patch.object(tensor_parallel, "retie", lambda plan, model: None):
        yield


@contextlib.contextmanager
def frozen_weights_unfrozen() -> Iterator[None]:
    """Frozen parameters are not frozen again after tensor parallelism wraps them."""
    tensor_parallel = importlib.import_module("meshtrain.lower.tensor.parallel")

    with mock.patch.object(tensor_parallel, "refreeze", lambda plan, model: None):
        yield


# ---------------------------------------------------------------- pipelines


@contextlib.contextmanager
def stage_skips_a_layer() -> Iterator[None]:
    """The second pipeline stage drops its first block."""
    pipeline = importlib.import_module("meshtrain.lower.pipeline")

    original = pipeline._prune

    def prune_one_more(body: nn.Module, stage: Any, plan: Any) -> Any:
        if stage.index == 1:
            first = next(m for m in stage.modules if m.startswith("layers."))
            stage = dataclasses.replace(
                stage, modules=tuple(m for m in stage.modules if m != first)
            )
        return original(body, stage, plan)

    with mock.patch.object(pipeline, "_prune", prune_one_more):
        yield


@contextlib.contextmanager
def stub_forgets_the_removed_module() -> Iterator[None]:
    """A later stage's stub keeps nothing of the module it replaced, so a forward that reads an
    attribute of it on every stage (ViT's patch embedding's weight dtype) fails there."""
    pipeline = importlib.import_module("meshtrain.lower.pipeline")
    original = pipeline._Stub.__init__

    def forgetful(self: Any, runner: Any, where: str, removed: Any = None) -> None:
        original(self, runner, where, None)

    with mock.patch.object(pipeline._Stub, "__init__", forgetful):
        yield


# ---------------------------------------------------------------- BatchNorm


@contextlib.contextmanager
def batch_norm_variance_from_local_mean() -> Iterator[None]:
    """Synchronised BatchNorm centres each rank's batch on its own mean before summing squares."""
    batch_norm = importlib.import_module("meshtrain.lower.data.batch_norm")

    def local_mean(module: Any, local_forward: Any, group: Any, x: torch.Tensor) -> torch.Tensor:
        if not (module.training or module.running_mean is None):
            return local_forward(x)
        dims = [0, *range(2, x.dim())]
        count = torch.tensor(float(x.numel() // x.shape[1]))
        stacked = batch_norm._summed(torch.cat([x.float().sum(dims), count.reshape(1)]), group)
        n = stacked[-1]
        mean = stacked[:-1] / n
        centred_local = x.float() - x.float().mean(dims, keepdim=True)  # the bug
        var = batch_norm._summed(centred_local.pow(2).sum(dims), group) / n
        if module.training and module.track_running_stats:
            batch_norm._update_running(module, mean.detach(), var.detach(), float(n.detach()))
        centred = x.float() - batch_norm._channels(mean, x)
        y = centred / torch.sqrt(batch_norm._channels(var, x) + module.eps)
        if module.affine:
            y = y * batch_norm._channels(module.weight, x) + batch_norm._channels(module.bias, x)
        return y.to(x.dtype)

    with mock.patch.object(batch_norm, "_forward", local_mean):
        yield


@contextlib.contextmanager
def batch_norm_running_variance_biased() -> Iterator[None]:
    """The running variance is updated with the biased batch variance."""
    batch_norm = importlib.import_module("meshtrain.lower.data.batch_norm")

    original = batch_norm._update_running

    def biased(module: nn.Module, mean: torch.Tensor, var: torch.Tensor, n: float) -> None:
        original(module, mean, var * (n - 1.0) / n, n)

    with mock.patch.object(batch_norm, "_update_running", biased):
        yield


@contextlib.contextmanager
def batch_norm_not_synchronised() -> Iterator[None]:
    """BatchNorms are left computing statistics over each rank's local batch."""
    flat = importlib.import_module("meshtrain.lower.flat")

    with mock.patch.object(flat, "sync_batch_norms", lambda plan, model: None):
        yield


# ---------------------------------------------------------------- what the proof found


@contextlib.contextmanager
def batch_buffer_not_averaged() -> Iterator[None]:
    """Buffers written from the batch (``batch_buffers="average"``) left as each rank wrote
    them."""
    flat = importlib.import_module("meshtrain.lower.flat")

    with mock.patch.object(flat, "average_batch_buffers", lambda plan, model: None):
        yield


@contextlib.contextmanager
def batch_buffer_summed() -> Iterator[None]:
    """Buffers written from the batch summed over the data ranks, not averaged."""
    batch_buffers = importlib.import_module("meshtrain.lower.data.batch_buffers")

    def summed(
        group: Any, owner: nn.Module, name: str, module: nn.Module, args: Any, output: Any
    ) -> None:
        with torch.no_grad():
            dist.all_reduce(owner._buffers[name], group=group)

    with mock.patch.object(batch_buffers, "_average", summed):
        yield


@contextlib.contextmanager
def reader_not_hooked() -> Iterator[None]:
    """Replicated parameters read outside their module reach the reader as DTensors."""
    replicated = importlib.import_module("meshtrain.lower.tensor.replicated")

    with mock.patch.object(replicated, "_hook_readers", lambda model, readers: None):
        yield


@contextlib.contextmanager
def fresh_output_not_copied() -> Iterator[None]:
    """Styled outputs the forward updates in place stay ``to_local`` views."""
    flat = importlib.import_module("meshtrain.lower.flat")

    with mock.patch.object(flat, "fresh_outputs", lambda plan, model: None):
        yield


@contextlib.contextmanager
def tail_input_not_gathered() -> Iterator[None]:
    """The model's tail under sequence parallelism computes on its rank's sequence shard."""
    tensor_parallel = importlib.import_module("meshtrain.lower.tensor.parallel")
    ir = importlib.import_module("meshtrain.plan.ir")
    from torch.distributed.tensor import Shard

    def local(style: Any, context: Any) -> Any:
        return tensor_parallel._PrepareActivation(
            style.fqn, style.argument, Shard(1), Shard(1), local=True
        )

    with mock.patch.dict(tensor_parallel.LOWERINGS, {ir.TPStyle.SEQUENCE_GATHERED_TAIL: local}):
        yield


# ---------------------------------------------------------------- initialisation


@contextlib.contextmanager
def per_rank_init_seed() -> Iterator[None]:
    """Meta-device initialisation seeds each parameter with the rank mixed in."""
    materialise = importlib.import_module("meshtrain.lower.materialise")

    original = materialise._seeded

    def with_rank(seed: int, fqn: str) -> Any:
        return original(seed + (dist.get_rank() if dist.is_initialized() else 0), fqn)

    with mock.patch.object(materialise, "_seeded", with_rank):
        yield


@contextlib.contextmanager
def resharding_offset() -> Iterator[None]:
    """Materialising a sharded parameter copies the next rank's shard (an offset of one)."""
    from torch.distributed.tensor import DTensor

    materialise = importlib.import_module("meshtrain.lower.materialise")

    original = materialise._copy_shard

    def shifted(tensor: torch.Tensor, full: torch.Tensor) -> None:
        sharded = isinstance(tensor, DTensor) and any(p.is_shard() for p in tensor.placements)
        if sharded:
            dim = next(p.dim for p in tensor.placements if p.is_shard())  # type: ignore[attr-defined]
            full = full.roll(tensor.to_local().shape[dim], dims=dim)
        original(tensor, full)

    with mock.patch.object(materialise, "_copy_shard", shifted):
        yield


# ---------------------------------------------------------------- numerically neutral rewrites


@contextlib.contextmanager
def neutral_recompute_everything() -> Iterator[None]:
    """Selective checkpointing recomputes the matmuls too (slower, the same numbers)."""
    from torch.utils.checkpoint import CheckpointPolicy

    compute = importlib.import_module("meshtrain.lower.compute")

    with mock.patch.object(
        compute, "_keep_matmuls", lambda ctx, op, *a, **k: CheckpointPolicy.PREFER_RECOMPUTE
    ):
        yield


@contextlib.contextmanager
def neutral_sync_every_microbatch() -> Iterator[None]:
    """Gradients are reduced after every micro-batch instead of once (more traffic, a sum of
    reduced sums: the same value up to reduction order)."""
    import meshtrain

    data_parallel = importlib.import_module("meshtrain.lower.data.parallel")
    step = importlib.import_module("meshtrain.train.step")

    original = data_parallel.micro_batch

    def always_last(plan: Any, model: nn.Module, *, last: bool) -> Any:
        return original(plan, model, last=True)

    with (
        mock.patch.object(data_parallel, "micro_batch", always_last),
        mock.patch.object(step, "micro_batch", always_last),
        mock.patch.object(meshtrain, "micro_batch", always_last),
    ):
        yield


@contextlib.contextmanager
def neutral_clip_skips_unit_scale() -> Iterator[None]:
    """Clipping skips the multiply when the factor is exactly 1."""

    def factor(norm: float, max_norm: float) -> float | None:
        scale = min(1.0, max_norm / (norm + 1e-6))
        return None if scale == 1.0 else scale

    with _scaled(factor):
        yield


@contextlib.contextmanager
def neutral_token_count_waited_at_once() -> Iterator[None]:
    """The global token count is waited for when the step starts (less overlap, same value)."""
    loss = importlib.import_module("meshtrain.train.loss")

    original = loss.StepTokens.__init__

    def eager(self: Any, plan: Any, local: int) -> None:
        original(self, plan, local)
        self.value  # noqa: B018

    with mock.patch.object(loss.StepTokens, "__init__", eager):
        yield


# ---------------------------------------------------------------- context parallelism


@contextlib.contextmanager
def context_chunk_off_by_one() -> Iterator[None]:
    """Every sequence chunk but the first starts one position early (its true positions, and so
    the tokens a context-parallel rank takes and the positions its masks use, off by one)."""
    layout = importlib.import_module("meshtrain.lower.context.layout")

    def early(index: int, size: int) -> torch.Tensor:
        start = index * size - (1 if index else 0)
        return torch.arange(start, start + size)

    with mock.patch.object(layout, "_chunk", early):
        yield


@contextlib.contextmanager
def context_merge_without_max() -> Iterator[None]:
    """The online-softmax merge weighs each block by ``exp(lse)`` itself, without subtracting
    the larger log-sum-exp first: exact algebra, but ``exp`` overflows once logits pass ~88."""
    blocks = importlib.import_module("meshtrain.lower.context.attention_blocks")

    def unshifted(out_a: Any, lse_a: Any, out_b: Any, lse_b: Any) -> tuple[Any, Any]:
        w_a, w_b = torch.exp(lse_a), torch.exp(lse_b)
        total = w_a + w_b
        safe = torch.where(total == 0, torch.ones_like(total), total)
        return (w_a[..., None] * out_a + w_b[..., None] * out_b) / safe[..., None], torch.log(total)

    with mock.patch.object(blocks, "merge", unshifted):
        yield


@contextlib.contextmanager
def context_blocks_in_wrong_order() -> Iterator[None]:
    """The ring masks each arriving block with the chunk positions of the rank ahead instead of
    the rank behind (the keys travel forward): the causal mask applied in the wrong chunk order
    (the same rank when cp = 2, so only cp > 2 shows it)."""
    ring = importlib.import_module("meshtrain.lower.context.ring_attention")
    with mock.patch.object(ring, "_source", lambda rank, step, cp: (rank + step) % cp):
        yield


# ---------------------------------------------------------------- expert parallelism


@contextlib.contextmanager
def experts_permuted_across_ranks() -> Iterator[None]:
    """Each expert rank keeps the next rank's experts (the weights rolled by one rank's share
    before the split), while tokens still travel to the rank that should hold their expert."""
    ep = importlib.import_module("meshtrain.lower.experts.parallel")
    original = ep.distribute_tensor

    def rolled(tensor: torch.Tensor, mesh: Any, placements: Any, **kwargs: Any) -> Any:
        shifted = torch.roll(tensor, -(tensor.shape[0] // mesh.size()), 0)
        return original(shifted, mesh, placements, **kwargs)

    with mock.patch.object(ep, "distribute_tensor", rolled):
        yield


@contextlib.contextmanager
def expert_combine_weight_dropped() -> Iterator[None]:
    """Each token's last expert output is combined with weight 1 instead of its router weight."""
    ep = importlib.import_module("meshtrain.lower.experts.parallel")
    original = ep.ExpertDispatch.__call__

    def unweighted(self: Any, hidden: Any, index: Any, weights: torch.Tensor) -> Any:
        dropped = torch.cat([weights[:, :-1], torch.ones_like(weights[:, -1:])], dim=1)
        return original(self, hidden, index, dropped)

    with mock.patch.object(ep.ExpertDispatch, "__call__", unweighted):
        yield


@contextlib.contextmanager
def expert_grad_not_rescaled() -> Iterator[None]:
    """Expert gradients left as the all-to-all's backward sums them over the expert ranks (no
    1/ep under the data-parallel mean): divided by the data ranks only, ep times too large."""
    ep = importlib.import_module("meshtrain.lower.experts.parallel")
    with mock.patch.object(ep, "expert_grad_scale", lambda plan: 1.0):
        yield


# ---------------------------------------------------------------- optimizer-state offload


@contextlib.contextmanager
def offload_order() -> Iterator[None]:
    """Optimizer-state offload empties the groups once, before its per-parameter loop, and
    appends each parameter in turn: every parameter's update steps all earlier ones again."""
    offload = importlib.import_module("meshtrain.train.offload")

    @torch.no_grad()
    def step(self: Any, closure: Any = None) -> Any:
        groups = [group["params"] for group in self.param_groups]
        try:
            for group in self.param_groups:
                group["params"] = []
            for index, params in enumerate(groups):
                for param in params:
                    if param.grad is None:
                        continue
                    self.param_groups[index]["params"].append(param)
                    offload._move(self.state[param], offload._device(param))
                    super(offload._HostStates, self).step()
                    offload._move(self.state[param], self._host)
        finally:
            for group, params in zip(self.param_groups, groups):
                group["params"] = params
        return None

    with mock.patch.object(offload._HostStates, "step", step):
        yield


@contextlib.contextmanager
def moe_block_input_grad_summed() -> Iterator[None]:
    """A MoE block run on the whole sequence under sequence parallelism treats its gathered
    input's gradient as partial sums (reduce-scattered), though every tensor-parallel rank holds
    the same whole gradient: the block's input gradient comes back multiplied by tp."""
    tensor_parallel = importlib.import_module("meshtrain.lower.tensor.parallel")
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    def summed(self: Any, module: nn.Module, device_mesh: Any) -> nn.Module:
        def gather(_module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
            local = DTensor.from_local(args[0], device_mesh, (Shard(1),), run_check=False)
            whole = local.redistribute(placements=(Replicate(),))
            return (whole.to_local(grad_placements=(Partial(),)), *args[1:])

        module.register_forward_pre_hook(gather)
        module.register_forward_hook(lambda m, a, out: self._slice(device_mesh, m, a, out))
        return module

    with mock.patch.object(tensor_parallel._GatherSequence, "_apply", summed):
        yield


@contextlib.contextmanager
def balance_counts_per_rank() -> Iterator[None]:
    """The MoE balance statistics (tokens per expert, router probability sums) left per rank:
    no count reducer installed, so each rank's balance loss sees only its own tokens."""
    flat = importlib.import_module("meshtrain.lower.flat")
    with mock.patch.object(flat, "install_count_reducer", lambda plan, model: None):
        yield


@contextlib.contextmanager
def experts_split_contiguously() -> Iterator[None]:
    """Tensor parallelism inside the experts splits ``gate_up_proj`` in contiguous blocks
    (``Shard(1)``) instead of each packed half alike: with tp 2 one rank holds every gate row
    and the other every up row, and each forms ``act(gate) · up`` from the wrong rows."""
    expert_tensor = importlib.import_module("meshtrain.lower.experts.tensor")
    expert_parallel = importlib.import_module("meshtrain.lower.experts.parallel")
    from torch.distributed.tensor import Shard

    def contiguous(name: str) -> Any:
        return Shard(1) if name == "gate_up_proj" else Shard(2)

    with (
        mock.patch.object(expert_tensor, "tensor_placement", contiguous),
        mock.patch.object(expert_parallel, "tensor_placement", contiguous),
    ):
        yield


@contextlib.contextmanager
def experts_input_grad_not_summed() -> Iterator[None]:
    """Tensor parallelism inside the experts leaves the experts' input gradient a partial sum
    (each rank's part of the intermediate features only) instead of all-reducing it."""
    expert_tensor = importlib.import_module("meshtrain.lower.experts.tensor")
    expert_parallel = importlib.import_module("meshtrain.lower.experts.parallel")

    def unsummed(tensor: torch.Tensor, group: Any) -> torch.Tensor:
        return tensor

    with (
        mock.patch.object(expert_tensor, "sum_backward", unsummed),
        mock.patch.object(expert_parallel, "sum_backward", unsummed),
    ):
        yield


@contextlib.contextmanager
def experts_not_reduced_over_context() -> Iterator[None]:
    """Beside context parallelism the experts' FSDP spans the data axes only, so their gradients
    miss the other context ranks' tokens (the non-expert weights still reduce over cp)."""
    data_parallel = importlib.import_module("meshtrain.lower.data.parallel")
    groups = importlib.import_module("meshtrain.lower.groups")

    def data_only(plan: Any) -> Any:
        axes = plan.data_axes
        return groups.mesh_over(plan, axes) if axes else None

    with mock.patch.object(data_parallel, "_experts_mesh", data_only):
        yield


@contextlib.contextmanager
def context_documents_from_local_chunks() -> Iterator[None]:
    """Under context parallelism each rank reads its tokens' document ids from its own chunks'
    positions alone (no gather of the whole sequences): ids disagree across ranks, so keys on
    other ranks are matched to the wrong documents."""
    context_parallel = importlib.import_module("meshtrain.lower.context.parallel")
    packing = importlib.import_module("meshtrain.spec.packing")

    def local(self: Any, positions: torch.Tensor) -> torch.Tensor:
        return packing.document_ids(positions.to(torch.int64))

    with mock.patch.object(context_parallel.ContextGroup, "documents", local):
        yield


@contextlib.contextmanager
def checkpoint_replays_buffer_updates() -> Iterator[None]:
    """Activation checkpointing without the buffer replay: backward's recomputation updates a
    BatchNorm's running statistics a second time."""
    compute = importlib.import_module("meshtrain.lower.compute")

    def nothing(modules: Any) -> tuple[Any, Any]:
        return contextlib.nullcontext(), contextlib.nullcontext()

    with mock.patch.object(compute, "_replayed_buffers", nothing):
        yield
