"""A user's own PyTorch loop, unchanged, on every flat plan (real gloo ranks, first tier): the loop
one writes for DDP — forward, loss on the rank's slice of the batch, backward,
``torch.nn.utils.clip_grad_norm_``, ``torch.nn.utils.get_total_norm``, a ``torch.optim``
optimizer, a ``torch.optim.lr_scheduler`` — against the same loop run the ordinary way in one
process on the whole batch, on a Hugging Face Llama and on a plain ``nn.Module``; the same under
``torch.autocast``; and DCP's ``get_state_dict``/``set_state_dict`` round trip.

Tensor-parallel plans used to leave the parameters they do not shard as plain tensors (FSDP2 then
puts them on the data-parallel mesh only), and PyTorch's clipping failed with ``All operands in
aten.stack.default must have the same mesh``; every parameter now lives on one mesh
(:mod:`meshtrain.lower.tensor.replicated`).
"""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import Any

import lora_models
import proof_models
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import zoo
from helpers import ResidualMLPClassifier, classifier_batches, full
from torch import nn

import meshtrain as mt
from meshtrain import P, Rules
from meshtrain.testing.contract import EPS_FP32, ROUNDING_FACTOR, Contract, contract_for
from meshtrain.testing.rounding import rounding_bound
from meshtrain.train.loss import data_parallel_rank

pytestmark = pytest.mark.spmd

STEPS = 2
MAX_NORM = 0.05  # below every case's gradient norm: clipping scales every step
LR, MOMENTUM, WEIGHT_DECAY, GAMMA = 0.5, 0.9, 0.01, 0.5


def classifier_rules(fsdp: str | tuple[str, ...] = "dp") -> Rules:
    """Megatron pairs in each residual block of :class:`ResidualMLPClassifier` (the first Linear
    column-wise, the second row-wise); the stem, norms and head replicated."""
    return Rules(
        {
            r"blocks\.\d+\.1\.(weight|bias)": P("tp"),
            r"blocks\.\d+\.3\.weight": P(None, "tp"),
            r".*": P(),
        },
        fsdp=fsdp,
    )


def hf_tp_rules(sequence_parallel: bool = False) -> Rules:
    return zoo.hf_rules(zoo.llama(), sequence_parallel=sequence_parallel)


# name: (model, mesh axes, rules, plan options)
CASES: dict[str, tuple[str, dict[str, int], Any, dict[str, Any]]] = {
    "ddp": ("mlp", {"dp": 2}, lambda: zoo.REPLICATED, {"zero": 0}),
    "zero1": ("mlp", {"dp": 2}, lambda: zoo.REPLICATED, {"zero": 1}),
    "zero2": ("llama", {"dp": 2}, lambda: zoo.REPLICATED, {"zero": 2}),
    "zero3": ("llama", {"dp": 2}, lambda: zoo.REPLICATED, {"zero": 3}),
    "tp": ("llama", {"tp": 2}, lambda: zoo.without_data_axes(hf_tp_rules()), {}),
    "tp-sp": ("llama", {"tp": 2}, lambda: zoo.without_data_axes(hf_tp_rules(True)), {}),
    "mlp-tp": ("mlp", {"tp": 2}, lambda: classifier_rules(fsdp=()), {}),
    "hsdp": ("llama", {"rep": 2, "dp": 2}, lambda: Rules({r".*": P()}, fsdp=("rep", "dp")), {}),
    "ddp-tp": ("mlp", {"dp": 2, "tp": 2}, lambda: classifier_rules(), {"zero": 0}),
    "fsdp-tp": ("llama", {"dp": 2, "tp": 2}, lambda: hf_tp_rules(), {"zero": 3}),
    "fsdp-tp-sp": ("llama", {"dp": 2, "tp": 2}, lambda: hf_tp_rules(True), {"zero": 3}),
    "lora-fsdp-tp": ("lora", {"dp": 2, "tp": 2}, lambda: hf_tp_rules(), {"zero": 3}),
    # a tied head through F.linear on the embedding's weight (read outside its module)
    "tied-reader-fsdp-tp": (
        "tied",
        {"dp": 2, "tp": 2},
        lambda: proof_models.MLP_RULES,
        {"zero": 3},
    ),
}


def _model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "mlp":
        return ResidualMLPClassifier()
    if kind == "tied":
        return proof_models.tied_mlp()
    return lora_models.hf_llama_lora() if kind == "lora" else zoo.llama()


def _batch(kind: str, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    if kind == "tied":
        return proof_models.token_batches(step)
    return classifier_batches(step) if kind == "mlp" else zoo.token_batches(step)


def _loss(output: Any, targets: torch.Tensor) -> torch.Tensor:
    logits = output if isinstance(output, torch.Tensor) else output.logits  # an HF ModelOutput
    return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten())


def _train(
    model: nn.Module, kind: str, rows: slice | None, autocast: bool
) -> tuple[list[list[float]], torch.optim.Optimizer]:
    """The loop a user writes: returns per step (loss, norm, total norm, lr) and the optimizer."""
    params = [p for p in model.parameters() if p.requires_grad]
    # SGD with momentum: an update proportional to the gradient (Adam's normalisation would turn
    # an order-of-summation difference in a near-zero gradient into a whole step)
    optimizer = torch.optim.SGD(params, lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=GAMMA)
    record = []
    for step in range(STEPS):
        inputs, targets = _batch(kind, step)
        if rows is not None:
            inputs, targets = inputs[rows], targets[rows]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = _loss(model(inputs), targets)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        total = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        record.append([float(loss.detach()), float(full(norm)), float(full(total))])
    return record, optimizer


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def loop_contract(plan: mt.Plan, autocast: bool) -> Contract:
    """The plan's contract; under ``torch.autocast`` (bf16) the same plan's contract in bf16:
    the user's autocast rounds where meshtrain's bf16 policy would."""
    if not autocast:
        return contract_for(plan)
    options = dataclasses.replace(plan.options, precision="bf16")
    return contract_for(dataclasses.replace(plan, options=options))


def param_bound(tolerance: float, largest: float) -> float:
    """The largest parameter difference after :data:`STEPS` steps of the loop's SGD: each step's
    clipped gradient differs by at most ``2 · tolerance · MAX_NORM`` per element (its own and the
    norm's relative error; no element of a gradient clipped to ``MAX_NORM`` exceeds it), which
    momentum carries forward and weight decay scales; plus one rounding of ``largest`` per
    step on either side (0 under a bitwise contract: equal)."""
    if tolerance == 0.0:
        return 0.0
    delta, buffer, bound = 2 * tolerance * MAX_NORM, 0.0, 0.0
    for step in range(STEPS):
        lr = LR * GAMMA**step
        buffer = MOMENTUM * buffer + delta + WEIGHT_DECAY * bound
        bound += lr * buffer
    return bound + 2 * STEPS * EPS_FP32 * largest


def _ratio(error: float, bound: float) -> float:
    return error / bound if bound else (0.0 if error == 0.0 else math.inf)


def user_loop(name: str, autocast: bool = False) -> dict[str, float]:
    """On every rank: the loop under the plan of :data:`CASES` ``name`` (each data-parallel rank
    on its rows) against the loop in one process on the whole batch; the worst ratios of the
    loss (averaged over data-parallel ranks), the clipped norm, ``get_total_norm`` after
    clipping and the parameters after the last step to their bounds (1: at the bound).

    In fp32 a scalar's bound is the contract's ``tolerance`` relative to the one-process value
    and the parameters' :func:`param_bound`. Under ``torch.autocast`` the one-process loop's own
    bf16 error is measured, as the harness measures its reference's: the same loop runs once
    more in fp32 (no autocast) from the same initialisation, and each bound gains
    :func:`~meshtrain.testing.rounding.rounding_bound`'s low-precision part (4 × the larger of
    that own error and one bf16 rounding of the value; for the parameters, 4 × their own
    error). ``tolerance``: the contract's fp32 per-step relative bound."""
    kind, axes, rules, options = CASES[name]
    model = _model(kind)
    reference = copy.deepcopy(model)
    twin = copy.deepcopy(model) if autocast else None
    plan = mt.plan(model, mt.make_mesh(axes), rules(), **options)
    applied = mt.apply(plan, model)
    index, ranks = data_parallel_rank(plan)
    per_rank = 8 // ranks
    record, _ = _train(applied, kind, slice(index * per_rank, (index + 1) * per_rank), autocast)
    ref_record, _ = _train(reference, kind, None, autocast)
    twin_record = _train(twin, kind, None, False)[0] if twin is not None else ref_record
    contract = loop_contract(plan, autocast)
    tolerance, unit = contract.tolerance, contract.unit
    worst = {"loss": 0.0, "norm": 0.0, "total": 0.0, "params": 0.0}
    for values, ref_values, twin_values in zip(record, ref_record, twin_record):
        mean = torch.tensor(values[0], dtype=torch.float64)
        dist.all_reduce(mean)
        values = [float(mean) / dist.get_world_size(), *values[1:]]
        for quantity, value, ref, exact in zip(worst, values, ref_values, twin_values):
            bound = rounding_bound(tolerance, unit, abs(ref), abs(ref - exact))
            worst[quantity] = max(worst[quantity], _ratio(abs(value - ref), bound))
    ref_params = dict(reference.named_parameters())
    twin_params = dict(twin.named_parameters()) if twin is not None else ref_params
    for fqn, param in applied.named_parameters():
        ref = ref_params[fqn].detach()
        error = float((full(param.detach()) - ref).abs().max())
        own = float((twin_params[fqn].detach() - ref).abs().max())
        bound = param_bound(tolerance, float(ref.abs().max())) + ROUNDING_FACTOR * own
        worst["params"] = max(worst["params"], _ratio(error, bound))
    worst["tolerance"] = tolerance
    worst["clipped"] = float(min(r[1] for r in ref_record) > MAX_NORM)
    worst["clipped to"] = max(r[2] for r in record)
    worst["clip bound"] = MAX_NORM * (1 + 2 * tolerance + 2 * EPS_FP32 + 2 * ROUNDING_FACTOR * unit)
    return worst


def user_loops(names: list[str], autocast: bool = False) -> dict[str, dict[str, float]]:
    """:func:`user_loop` for several plans in one call to the ranks."""
    return {name: user_loop(name, autocast) for name in names}


def _worst(results: list[dict[str, dict[str, float]]], name: str) -> dict[str, float]:
    return {key: max(r[name][key] for r in results) for key in results[0][name]}


def _world(name: str) -> int:
    return math.prod(CASES[name][1].values())


@pytest.mark.filterwarnings("ignore:.*FSDP2-wrapped module .* returned a view tensor")
@pytest.mark.parametrize("world", [2, 4])
def test_a_users_loop_trains_like_one_process(world: int) -> None:
    """fp32: every step's loss, clipped norm and total norm within the plan's contract of the
    one-process loop (bitwise where the contract is), the parameters after the last step within
    what that contract allows through the SGD updates; clipping acted on every step."""
    from meshtrain.testing.runner import get_pool

    names = [name for name in CASES if _world(name) == world]
    results = get_pool(world).run(user_loops, names, _timeout_s=600.0)
    for name in names:
        worst = _worst(results, name)
        assert_within_contract(name, worst)
        print(name, {key: f"{value:.2g}" for key, value in worst.items()})


def assert_within_contract(name: str, worst: dict[str, float]) -> None:
    """Each ratio of :func:`user_loop` at most 1 (under a bitwise contract: equal), and clipping
    acted on every step."""
    assert worst["clipped"] == 1.0, (name, worst)
    assert worst["clipped to"] <= worst["clip bound"], (name, worst)
    for quantity in ("loss", "norm", "total", "params"):
        assert worst[quantity] <= 1.0, (name, worst)


# ------------------------------------------------- a pipeline's last stage: the model's own output


class TupleLM(nn.Module):
    """A plain language model that returns ``(logits, hidden)``, as many hand-written models do."""

    def __init__(self, vocab: int = 128, dim: int = 32, n_blocks: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, 2 * dim), nn.Tanh(), nn.Linear(2 * dim, dim))
            for _ in range(n_blocks)
        )
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.embed(tokens)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h), h


def logits_loss(output: Any, targets: torch.Tensor) -> torch.Tensor:
    """A summed loss written as the docs show for a Hugging Face model: ``output.logits``."""
    return F.cross_entropy(output.logits.flatten(0, 1), targets.flatten(), reduction="sum")


def first_loss(output: tuple[torch.Tensor, torch.Tensor], targets: torch.Tensor) -> torch.Tensor:
    """A summed loss on the first element of the model's tuple."""
    logits, _hidden = output
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")


PIPELINED = {"hf-llama": (zoo.llama, logits_loss), "tuple": (TupleLM, first_loss)}


def pipelined_loss(name: str) -> dict[str, float]:
    """On each rank of a 2-stage pipeline: one step of :data:`PIPELINED` ``name`` through
    ``forward_backward`` with a ``loss_fn`` that reads the model's own output type, against the
    model in one process; the loss's and the local gradients' worst relative errors."""
    from meshtrain.train import Batch, forward_backward

    factory, loss_fn = PIPELINED[name]
    torch.manual_seed(0)
    model = factory()
    reference = copy.deepcopy(model)
    plan = mt.plan(
        model, mt.make_mesh(pp=2), Rules({r".*": P()}), pipeline=mt.Pipeline(microbatches=2)
    )
    pipelined = mt.apply(plan, model)
    inputs, targets = zoo.token_batches(0)
    loss, _tokens = forward_backward(plan, pipelined, Batch(inputs, targets), loss_fn)
    ref_loss = loss_fn(reference(inputs), targets) / targets.numel()
    ref_loss.backward()
    ref_grads = {fqn: p.grad for fqn, p in reference.named_parameters()}
    worst = {"loss": _rel(loss, float(ref_loss.detach())), "grads": 0.0, "compared": 0.0}
    worst["tolerance"] = contract_for(plan).tolerance  # two micro-batches: reduction order
    for fqn, param in pipelined.named_parameters():
        assert param.grad is not None, fqn
        ref = ref_grads[fqn]
        error = (full(param.grad) - ref).abs().max() / ref.abs().max().clamp_min(1e-30)
        worst["grads"] = max(worst["grads"], float(error))
        worst["compared"] += 1
    return worst


@pytest.mark.parametrize("name", list(PIPELINED))
def test_a_pipelines_last_stage_hands_loss_fn_the_models_own_output(name: str) -> None:
    """Under ``Pipeline`` the loss function receives what the model returns on one device (a
    ``ModelOutput`` with ``.logits``, a tuple), and the step trains like one device."""
    from meshtrain.testing.runner import get_pool

    results = get_pool(2).run(pipelined_loss, name)
    for worst in results:
        assert worst["compared"] > 0, worst  # every stage holds parameters, each compared
        assert worst["loss"] <= worst["tolerance"], worst
        assert worst["grads"] <= worst["tolerance"], worst
    print(name, results)


# ------------------------------------------------------------------- autocast, DCP, a planted bug

AUTOCAST = ["ddp-tp", "fsdp-tp", "fsdp-tp-sp"]


@pytest.mark.filterwarnings("ignore:.*FSDP2-wrapped module .* returned a view tensor")
def test_a_users_loop_under_autocast_trains_like_one_process() -> None:
    """``torch.autocast`` (bf16 on CPU) around the forward and loss, on both sides: the
    differences are bf16 roundings of matmuls on a slice of the batch, within the plan's
    contract in bf16 (:func:`loop_contract`)."""
    from meshtrain.testing.runner import get_pool

    results = get_pool(4).run(user_loops, AUTOCAST, autocast=True)
    for name in AUTOCAST:
        worst = _worst(results, name)
        assert_within_contract(name, worst)
        print(name, "autocast", {key: f"{value:.2g}" for key, value in worst.items()})


def dcp_round_trip(name: str) -> dict[str, float]:
    """On every rank: two steps of the loop under plan ``name``, then DCP's ``get_state_dict``
    (model and optimizer), ``set_state_dict`` into a freshly planned copy whose weights differ,
    and ``get_state_dict`` again: the largest difference between the two state dicts' values,
    their key sets' difference, and the loaded model's next-step loss against the original's."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    kind, axes, rules, options = CASES[name]
    trained = mt.apply(mt.plan(_model(kind), mt.make_mesh(axes), rules(), **options), _model(kind))
    _, optimizer = _train(trained, kind, None, autocast=False)
    model_state, optim_state = get_state_dict(trained, optimizer)
    fresh = _model(kind)
    with torch.no_grad():
        for param in fresh.parameters():
            param.add_(1.0)
    loaded = mt.apply(mt.plan(fresh, mt.make_mesh(axes), rules(), **options), fresh)
    params = [p for p in loaded.parameters() if p.requires_grad]
    loaded_optimizer = torch.optim.SGD(params, lr=0.5, momentum=0.9, weight_decay=0.01)
    set_state_dict(
        loaded, loaded_optimizer, model_state_dict=model_state, optim_state_dict=optim_state
    )
    again_model, again_optim = get_state_dict(loaded, loaded_optimizer)
    flat = {**model_state, **{f"optim.{k}": v for k, v in _flatten(optim_state).items()}}
    again = {**again_model, **{f"optim.{k}": v for k, v in _flatten(again_optim).items()}}
    worst = {"keys differ": float(len(set(flat) ^ set(again))), "values": 0.0, "tensors": 0.0}
    for key, value in flat.items():
        if isinstance(value, torch.Tensor):
            worst["values"] = max(
                worst["values"], float((full(value) - full(again[key])).abs().max())
            )
            worst["tensors"] += 1
    inputs, targets = _batch(kind, 2)
    worst["next loss"] = abs(
        float(_loss(loaded(inputs), targets).detach())
        - float(_loss(trained(inputs), targets).detach())
    )
    return worst


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out.update(_flatten(value, f"{prefix}{key}."))
        return out
    if isinstance(tree, list):
        return _flatten(dict(enumerate(tree)), prefix)
    return {prefix: tree}


@pytest.mark.filterwarnings("ignore:.*FSDP2-wrapped module .* returned a view tensor")
@pytest.mark.parametrize("name", ["fsdp-tp", "ddp-tp"])
def test_dcp_get_and_set_state_dict_round_trip(name: str) -> None:
    from meshtrain.testing.runner import get_pool

    for worst in get_pool(4).run(dcp_round_trip, name):
        assert worst["tensors"] > 0, worst
        assert worst["keys differ"] == 0.0, worst
        assert worst["values"] == 0.0, worst
        assert worst["next loss"] == 0.0, worst


def planted_partial_gradient(name: str) -> dict[str, float]:
    """:func:`user_loop` with a planted lowering bug: the replicated parameters' local gradients
    marked as partial sums over tp (so they are summed over the tensor-parallel ranks)."""
    from unittest import mock

    from torch.distributed.tensor import DTensor, Partial

    from meshtrain.lower.tensor import replicated

    def to_local(self: Any, module: nn.Module, args: Any) -> None:
        frame = []
        for owner, name_ in self.slots:
            param = owner._parameters.get(name_)
            if isinstance(param, DTensor):
                frame.append((owner, name_, param))
                owner._parameters[name_] = param.to_local(grad_placements=(Partial(),))
        self.saved.append(frame)

    with mock.patch.object(replicated.LocalParameters, "to_local", to_local):
        return user_loop(name)


@pytest.mark.filterwarnings("ignore:.*FSDP2-wrapped module .* returned a view tensor")
def test_a_planted_partial_gradient_is_caught() -> None:
    from meshtrain.testing.runner import get_pool

    worst = _worst([{"x": w} for w in get_pool(4).run(planted_partial_gradient, "fsdp-tp")], "x")
    # the contract check the clean loops pass fails: the norm (96× its bound when measured) and
    # the parameters (254×)
    assert worst["norm"] > 10.0 and worst["params"] > 10.0, worst
    print("planted partial gradient", {key: f"{value:.2g}" for key, value in worst.items()})


def loop_without_one_mesh(name: str) -> str:
    """:func:`user_loop` with the replicated parameters left plain (the lowering before every
    parameter shared one mesh): what PyTorch's clipping raises."""
    from unittest import mock

    with mock.patch("meshtrain.lower.flat.replicate_whole_parameters"):
        try:
            user_loop(name)
        except RuntimeError as error:
            return str(error)
    return ""


@pytest.mark.filterwarnings("ignore:.*FSDP2-wrapped module .* returned a view tensor")
def test_without_one_mesh_torch_clipping_fails() -> None:
    """The bug this lowering fixes, planted back: parameters on the dp-only and the (dp, tp)
    mesh, and ``torch.nn.utils.clip_grad_norm_`` refuses to stack their norms."""
    from meshtrain.testing.runner import get_pool

    for message in get_pool(4).run(loop_without_one_mesh, "fsdp-tp"):
        assert "must have the same mesh" in message, message
