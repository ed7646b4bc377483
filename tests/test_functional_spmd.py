"""mt.constrain and mt.shard_map: no-ops on one device, exact layouts under a plan (gloo ranks)."""

from __future__ import annotations

import pytest
import torch
from helpers import full, mesh_for
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.tensor import DTensor, Replicate

import meshtrain as mt
from meshtrain import P, Rules, SpecError
from meshtrain.testing.comms import CollectiveCounter
from meshtrain.testing.runner import get_pool


class Block(nn.Module):
    """A pre-norm residual MLP block whose forward calls the primitives (same code everywhere)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.mlp = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = mt.constrain(h, ("batch", "seq", "embed"))  # the layout the plan gives it: a no-op
        return h + self.mlp(self.norm(h))


class Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(32, 16)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(16, 32, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def rules(sequence_parallel: bool) -> Rules:
    logical = [("batch", "dp"), ("seq", "tp" if sequence_parallel else None), ("embed", None)]
    return Rules(
        {
            r"blocks\.\d+\.mlp\.0\.(weight|bias)": P("tp"),
            r"blocks\.\d+\.mlp\.2\.weight": P(None, "tp"),
            r"head\.weight": P("tp"),
            r".*": P(),
        },
        logical=logical,
        fsdp="dp",
    )


def test_one_device_calls_are_no_ops_and_check_ranks() -> None:
    x = torch.randn(2, 4, 8)
    assert mt.constrain(x, P(None, "tp")) is x
    assert mt.constrain(x, ("batch", "seq", "embed")) is x
    with pytest.raises(SpecError, match=r"4 entries but the tensor \(shape 2×4×8\) has 3 dims"):
        mt.constrain(x, P(None, None, None, "tp"))
    doubled = mt.shard_map(lambda t, u: t * u, in_specs=(P(None, "tp"), P()), out_specs=P())(x, 2)
    assert torch.equal(doubled, 2 * x)
    model = Toy()
    assert torch.equal(
        model(torch.zeros(1, 4, dtype=torch.long)), Toy()(torch.zeros(1, 4, dtype=torch.long))
    )


def test_in_specs_must_be_a_prefix_of_the_arguments() -> None:
    fn = mt.shard_map(lambda a, b: a + b, in_specs=(P(), P(), P()), out_specs=P())
    with pytest.raises(SpecError, match=r"in_specs=.* is not a pytree prefix of the arguments"):
        fn(torch.ones(2), torch.ones(2))


def same_code_trains_like_one_device(sequence_parallel: bool) -> dict[str, float]:
    """Forward and backward of a model that calls constrain, planned vs one process."""
    mesh = mesh_for((("dp", 1), ("tp", 2)))
    model, reference = Toy(), Toy()
    plan = mt.plan(model, mesh, rules(sequence_parallel))
    assert plan.sequence_parallel == sequence_parallel
    mt.apply(plan, model)
    tokens = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(1))
    with mt.loss_parallel(plan):
        loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
        loss.backward()
    ref_loss = torch.nn.functional.cross_entropy(reference(tokens).flatten(0, 1), tokens.flatten())
    ref_loss.backward()
    ref_grads = {fqn: p.grad for fqn, p in reference.named_parameters()}
    worst = 0.0
    for fqn, param in model.named_parameters():
        grad = full(param.grad)
        worst = max(worst, float((grad - ref_grads[fqn]).abs().max()))
    full_loss = full(loss).detach()
    return {"loss": abs(full_loss.item() - ref_loss.detach().item()), "grads": worst}


@pytest.mark.spmd
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_model_code_with_constrain_trains_like_one_device(sequence_parallel: bool) -> None:
    for result in get_pool(2).run(same_code_trains_like_one_device, sequence_parallel):
        assert result["loss"] <= 1e-6 and result["grads"] <= 1e-6, result


class Probe(nn.Module):
    """Runs the primitives inside a planned forward and reports what they did."""

    def __init__(self, toy: Toy) -> None:
        super().__init__()
        self.toy = toy
        self.report: dict[str, object] = {}

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.toy.embed(tokens)  # the stream: sequence shards under SP, else replicated
        if is_fake(h):  # the plan-time shape proof runs this forward on fake tensors: no report
            return self.toy.head(self.toy.blocks[0](h))
        counter = CollectiveCounter(mesh_for((("dp", 1), ("tp", 2))))
        with counter:
            seq_sharded = mt.constrain(h, P(None, "tp"))
            replicated = mt.constrain(seq_sharded, P())
        self.report["kinds"] = (type(seq_sharded).__name__, replicated.placements)
        self.report["counts"] = dict(counter.counts)
        self.report["replicated"] = replicated.to_local().clone()
        doubled = mt.shard_map(lambda t: 2 * t, in_specs=P(None, "tp"), out_specs=P(None, "tp"))(
            seq_sharded
        )
        self.report["doubled"] = mt.constrain(doubled, P()).to_local().clone()
        try:
            mt.shard_map(lambda t: t, in_specs=P("tp"), out_specs=P("tp"))(seq_sharded)
            self.report["mismatch"] = ""
        except SpecError as err:
            self.report["mismatch"] = str(err)
        return self.toy.head(self.toy.blocks[0](h))


def primitives_under_a_plan(sequence_parallel: bool) -> dict[str, object]:
    mesh = mesh_for((("dp", 1), ("tp", 2)))
    toy = Toy()
    full = toy.embed(torch.arange(16).view(2, 8)).detach()
    probe = Probe(toy)
    base = rules(sequence_parallel)
    probe_rules = Rules(
        [(f"toy\\.{pattern}", spec) for pattern, spec in base.patterns],
        logical=base.logical,
        fsdp="dp",
    )
    mt.apply(mt.plan(probe, mesh, probe_rules), probe)
    probe(torch.arange(16).view(2, 8))
    report = dict(probe.report)
    report["replicated_ok"] = torch.equal(report.pop("replicated"), full)  # type: ignore[arg-type]
    report["doubled_ok"] = torch.equal(report.pop("doubled"), 2 * full)  # type: ignore[arg-type]
    # Inside a pair parent activations are rank-local (its input is plain without sequence
    # parallelism, a DTensor's local tensor with it): both primitives refuse plain ones.
    inside = []
    for call in (
        lambda x: mt.constrain(x, P()),
        lambda x: mt.shard_map(lambda t: t, in_specs=P(), out_specs=P())(x),
    ):
        handle = probe.toy.blocks[0].mlp.register_forward_pre_hook(
            lambda _m, args, call=call: call(
                args[0].to_local() if isinstance(args[0], DTensor) else args[0]
            )
        )
        try:
            probe(torch.arange(16).view(2, 8))
            inside.append("")
        except SpecError as err:
            inside.append(str(err))
        finally:
            handle.remove()
    report["inside"] = inside
    return report


@pytest.mark.spmd
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_constrain_and_shard_map_under_a_plan(sequence_parallel: bool) -> None:
    for report in get_pool(2).run(primitives_under_a_plan, sequence_parallel):
        # Under SP the stream already is P(None, 'tp'): constrain asserts and returns it as is.
        kind = "Tensor" if sequence_parallel else "DTensor"
        assert report["kinds"] == (kind, (Replicate(),))
        # Sharding a replicated value is a local slice; back to replicated, one all-gather.
        assert report["counts"] == {("all_gather", "tp"): 1}
        assert report["replicated_ok"] and report["doubled_ok"]
        assert "is laid out as (Shard(dim=1),) but in_specs says P('tp')" in report["mismatch"]
        assert "shard_map does not redistribute" in report["mismatch"]
        constrain_error, shard_map_error = report["inside"]
        assert "runs inside 'toy.blocks.0.mlp'" in constrain_error
        assert "tensor inside 'toy.blocks.0.mlp'" in shard_map_error
