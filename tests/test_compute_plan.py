"""Planning of checkpointing, compile and precision; the traced activation memory (tier 1)."""

from __future__ import annotations

import pytest
import torch
from helpers import StackedMLP
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import meshtrain as mt
from meshtrain import P, PlanError, Rules
from meshtrain.models import LlamaConfig, build_llama, default_rules
from meshtrain.plan import Plan
from meshtrain.plan.memory.activations import trace_activations
from meshtrain.train import LossScaler

LLAMA = build_llama(LlamaConfig.preset("debug", n_layers=8), device="meta")
BLOCKS = tuple(f"layers.{i}" for i in range(8))


def mesh(**axes: int) -> mt.Mesh:
    world = 1
    for size in axes.values():
        world *= size
    return mt.make_mesh({"dp": 1, "tp": 1, **axes}, world_size=world, abstract=True)


def planned(dp: int = 2, tp: int = 1, **options: object) -> Plan:
    return mt.plan(LLAMA, mesh(dp=dp, tp=tp), default_rules(), **options)  # type: ignore[arg-type]


# --- activation checkpointing ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "mode", "count"),
    [
        ("none", "none", 0),
        ("full", "full", 8),
        ("selective", "selective", 8),
        ({"every": 2}, "full", 4),
        ({"every": 3, "mode": "selective"}, "selective", 2),
    ],
)
def test_checkpointing_modes_pick_blocks(value: object, mode: str, count: int) -> None:
    plan = planned(activation_checkpointing=value)
    assert plan.options.activation_checkpointing == mode
    assert len(plan.checkpointed) == count and set(plan.checkpointed) <= set(BLOCKS)
    if isinstance(value, dict):  # the k-th, 2k-th, … block (torchtitan's convention)
        assert plan.checkpointed[0] == f"layers.{value['every'] - 1}"


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ("sometimes", "is not one of 'none', 'full'"),
        ({"every": 0}, "checkpoint_every=0 must be a positive integer"),
        ({"each": 2}, "unknown keys \\['each'\\]"),
        ({"every": 2, "mode": "none"}, "must be 'full' or 'selective'"),
    ],
)
def test_bad_checkpointing_is_a_plan_error(value: object, match: str) -> None:
    with pytest.raises(PlanError, match=match):
        planned(activation_checkpointing=value)


def test_activation_memory_follows_the_mode() -> None:
    sized = {"batch_size": 2, "seq_len": 64}
    none, full, selective = (
        planned(activation_checkpointing=mode, **sized).memory.activations
        for mode in ("none", "full", "selective")
    )
    every2 = planned(activation_checkpointing={"every": 2}, **sized).memory.activations
    assert 0 < full < selective < none and full < every2 < none
    plan = planned(**sized)
    assert dict(plan.activation_estimates) == {"none": none, "full": full, "selective": selective}
    assert "activations per rank per micro-batch by mode: none" in plan.explain()
    assert planned().memory.activations == 0  # no batch_size/seq_len: not estimated


@settings(max_examples=15, deadline=None)
@given(n_blocks=st.integers(1, 6), every=st.integers(1, 4))
def test_checkpointing_every_k_never_beats_every_block(n_blocks: int, every: int) -> None:
    model = StackedMLP(n_blocks=n_blocks)
    blocks = tuple(f"blocks.{i}" for i in range(n_blocks))
    profile = trace_activations(model, blocks, batch_size=2, seq_len=8)
    chosen = blocks[every - 1 :: every]
    assert profile.peak("full", blocks) <= profile.peak("full", chosen) <= profile.peak("none", ())


def _measured_saved_bytes(model: nn.Module, blocks: tuple[str, ...], tokens: torch.Tensor) -> dict:
    """Bytes autograd really saves per block (real CPU tensors, each storage once), parameters'
    and buffers' own storages left out (the memory model counts those as parameters/buffers)."""
    owner: list[str | None] = [None]
    weights = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    saved: dict[int, tuple[int, str | None]] = {}
    modules = dict(model.named_modules())
    handles = []

    def leave(module: nn.Module, args: object, output: object) -> None:
        owner.pop()

    for fqn in blocks:
        handles.append(modules[fqn].register_forward_pre_hook(lambda m, a, f=fqn: owner.append(f)))
        handles.append(modules[fqn].register_forward_hook(leave))

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() in weights:
            return t
        saved.setdefault(t.untyped_storage().data_ptr(), (t.untyped_storage().nbytes(), owner[-1]))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens)
    for handle in handles:
        handle.remove()
    totals: dict[str | None, int] = {}
    for size, fqn in saved.values():
        totals[fqn] = totals.get(fqn, 0) + size
    return totals


@pytest.mark.parametrize("kind", ["llama", "mlp"])
def test_traced_activations_equal_what_autograd_saves(kind: str) -> None:
    if kind == "llama":
        model: nn.Module = build_llama(LlamaConfig.debug(), seed=0)
        blocks, vocab = ("layers.0", "layers.1"), 256
    else:
        torch.manual_seed(0)
        model, blocks, vocab = StackedMLP(), tuple(f"blocks.{i}" for i in range(4)), 64
    profile = trace_activations(model, blocks, batch_size=3, seq_len=32)
    measured = _measured_saved_bytes(model, blocks, torch.randint(0, vocab, (3, 32)))
    for block in profile.blocks:
        assert block.saved.tp + block.saved.rest == measured[block.fqn] > 0
    assert profile.other.rest == measured[None]


def test_repeated_blocks_are_traced_once_with_the_same_result(monkeypatch) -> None:
    from meshtrain.plan.memory import activations

    model = build_llama(LlamaConfig.preset("debug", n_layers=4), device="meta")
    blocks = tuple(f"layers.{i}" for i in range(4))
    tp_modules = [f"{block}.{part}" for block in blocks for part in ("attention", "feed_forward")]
    kwargs = {"batch_size": 2, "seq_len": 16, "tp_modules": tp_modules, "tp_size": 2}
    once = trace_activations(model, blocks, **kwargs)
    monkeypatch.setattr(activations, "_skip_repeated_blocks", lambda *args: lambda: None)
    activations._PROFILES.clear()  # trace again, every block
    every = trace_activations(model, blocks, **kwargs)
    assert once == every
    assert once.blocks[0].saved.tp > 0 and once.blocks[0].gathered_inputs > 0
    assert not any("forward" in vars(module) for module in model.modules())  # restored


def test_tensor_parallel_divides_activations() -> None:
    sized = {"batch_size": 2, "seq_len": 64}
    alone = planned(dp=1, **sized).memory.activations
    tp = planned(dp=1, tp=2, **sized).memory.activations
    rules = default_rules(sequence_parallel=True)
    sp = mt.plan(LLAMA, mesh(tp=2), rules, **sized).memory.activations  # type: ignore[arg-type]
    assert sp < tp < alone


def test_a_forward_that_cannot_be_traced_is_noted_not_fatal() -> None:
    class TakesFloats(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([nn.Linear(4, 4)])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if not x.is_floating_point():
                raise TypeError("expects float features, not token ids")
            return self.blocks[0](x)

    plan = mt.plan(
        TakesFloats(), mesh(dp=2), Rules({r".*": P()}, fsdp="dp"), batch_size=2, seq_len=4
    )
    assert plan.memory.activations == 0
    assert any(
        "activation memory not estimated" in note and "expects float features" in note
        for note in plan.notes
    )


# --- torch.compile ------------------------------------------------------------------------------


def test_compile_scope_is_chosen_per_plan() -> None:
    assert planned(compile=True).compile_scope == "block"
    assert planned(dp=1, tp=2, compile=True).compile_scope == "model"
    assert planned(compile=False).compile_scope is None
    plan = planned(compile={"backend": "aot_eager", "scope": "model"})
    assert plan.compile_scope == "model" and plan.options.compile_backend == "aot_eager"
    assert "torch.compile: the whole model" in plan.explain()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"dp": 2, "tp": 2, "compile": True}, "Mixing fake modes"),
        ({"dp": 1, "tp": 2, "compile": {"scope": "block"}}, "'_local_tensor'"),
        ({"compile": {"scope": "model", "fullgraph": True}}, "marked as skipped"),
        ({"compile": {"scope": "layer"}}, "compile scope='layer' is not one of"),
        ({"compile": {"mode": "max-autotune"}}, "unknown keys \\['mode'\\]"),
        ({"compile": "yes"}, "must be True, False or a dict"),
    ],
)
def test_compile_combinations_torch_cannot_lower_are_plan_errors(kwargs: dict, match: str) -> None:
    with pytest.raises(PlanError, match=match):
        planned(**kwargs)


# --- precision ----------------------------------------------------------------------------------


def test_low_precision_needs_a_data_axis_beyond_one_device() -> None:
    with pytest.raises(PlanError, match="no data axis larger than 1"):
        planned(dp=1, tp=2, precision="bf16")
    one_device = planned(dp=1, precision="bf16")
    assert one_device.cast_axes == ("dp",) and one_device.units  # FSDP2 carries the policy
    assert planned(dp=1).cast_axes == ()
    assert "fp16 needs dynamic loss scaling" in planned(precision="fp16").explain()


def test_compute_policies_round_trip_through_json() -> None:
    plan = planned(
        activation_checkpointing={"every": 2, "mode": "selective"},
        compile={"backend": "aot_eager"},
        precision="bf16",
        batch_size=2,
        seq_len=32,
    )
    assert Plan.from_json(plan.to_json()) == plan


def test_loss_scaler_backs_off_and_grows() -> None:
    scaler = LossScaler(init_scale=8.0, growth_interval=2)
    param = nn.Parameter(torch.ones(2))
    param.grad = torch.tensor([8.0, float("inf")])
    assert not scaler.unscale_([param])
    scaler.update()
    assert scaler.scale_value == 4.0 and scaler.skipped_steps == 1
    for _ in range(2):
        param.grad = torch.tensor([4.0, 8.0])
        assert scaler.unscale_([param])
        assert torch.equal(param.grad, torch.tensor([1.0, 2.0]))
        scaler.update()
    assert scaler.scale_value == 8.0
    restored = LossScaler()
    restored.load_state_dict(scaler.state_dict())
    assert restored.state_dict() == scaler.state_dict()
    with pytest.raises(PlanError, match="before unscale_"):
        scaler.update()
