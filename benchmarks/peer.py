"""torchtitan's Llama debug model under its own ``parallelize_llama`` and under a meshtrain plan.

The peer comparison, in one run on the same 4 gloo ranks: every rank builds torchtitan's Llama-3
``debugmodel`` (dim 256, 6 layers, 16 heads, vocab 2,048) twice from one full starting state —
one copy parallelized by torchtitan (``parallelize_llama``, as its trainer calls it), the other by
``mt.apply(mt.plan(model, mesh, rules), model)`` with regex rules on torchtitan's parameter names that
ask for the same layout. Both train with AdamW on the same batches with the same loss (summed over
tokens, divided by the global token count, as torchtitan's trainer does) and no clipping.

Reported per configuration:
- whether the losses agree: the first steps' global losses of both, and of one process training
  the full model on the global batch (rank 0, untimed);
- step times, interleaved and timed between barriers, their ratio (meshtrain / torchtitan) with
  the round-by-round median and quartiles (4 ranks share 2 cores here);
- the collectives of one step, counted on both, against meshtrain's plan.

torchtitan is not a meshtrain dependency: install it beside the project (the ``bench`` extra:
``pip install -c constraints/cpu.txt -e '.[bench]'``) to run this. On CPU four things need handling,
all done here and none of them a change to what torchtitan computes: its ``triton`` import, its
device type hard-wired to CUDA, FSDP2's ``PREMUL_SUM`` (gloo rejects it: plain sums, divide factor 1, the
loss is already divided by the global token count), and its FlexAttention (no CPU backward:
``ScaledDotProductAttention``, causal, instead). Its fused QKV projection is unfused
(``fuse_qkv=False``) so both sides load one starting state through parameter names.

Usage::

    python benchmarks/peer.py --rounds 20 --out benchmarks/results/peer.json
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import types
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from provenance import provenance
from timing import cpu_line, interleaved, round_by_round, summarise
from torch import nn

import meshtrain as mt
from meshtrain import P, Rules
from meshtrain.lower import device_mesh
from meshtrain.testing.comms import CollectiveCounter
from meshtrain.testing.runner import get_pool

BATCH, SEQ = 8, 128  # sequences per data-parallel rank per step, tokens per sequence
LOSS_STEPS = 3  # steps whose losses are compared (before timing)
SETUPS: dict[str, dict[str, Any]] = {
    "fsdp": {"mesh": {"dp": 4}, "tp": 1, "sequence_parallel": False},
    "fsdp_tp": {"mesh": {"dp": 2, "tp": 2}, "tp": 2, "sequence_parallel": False},
    "fsdp_tp_sp": {"mesh": {"dp": 2, "tp": 2}, "tp": 2, "sequence_parallel": True},
}
#: torchtitan's tensor-parallel layout written as meshtrain specs on its parameter names
TP_SPECS = {
    r"tok_embeddings\.weight": P("tp", None),
    r"layers\.\d+\.attention\.qkv_linear\.w[qkv]\.weight": P("tp", None),
    r"layers\.\d+\.attention\.wo\.weight": P(None, "tp"),
    r"layers\.\d+\.feed_forward\.w[13]\.weight": P("tp", None),
    r"layers\.\d+\.feed_forward\.w2\.weight": P(None, "tp"),
    r"lm_head\.weight": P("tp", None),
    r".*": P(),
}


def _rules(setup: str) -> Rules:
    options = SETUPS[setup]
    if options["tp"] == 1:
        return Rules({r".*": P()}, fsdp="dp")
    logical = (("seq", "tp"),) if options["sequence_parallel"] else ()
    return Rules(TP_SPECS, logical=logical, fsdp="dp")


def _on_cpu() -> None:
    """torchtitan picks its device type at import (CUDA when none is found); point it at the CPU
    where it is read by name."""
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.distributed.utils as distributed_utils
    import torchtitan.tools.utils as tool_utils

    for module in (tool_utils, distributed_utils):
        module.device_type, module.device_module = "cpu", torch.cpu  # type: ignore[attr-defined]
    parallel_dims.device_type = "cpu"  # type: ignore[attr-defined]


def _config(setup: str) -> tuple[Any, Any]:
    """torchtitan's debug model config (unfused QKV, SDPA attention) and its parallelism config."""
    from torchtitan.config import ParallelismConfig
    from torchtitan.models.common import compute_ffn_hidden_dim
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import _build_llama3_layers, llama3_configs

    config = llama3_configs["debugmodel"](attn_backend="flex")
    attention = config.layers[0].attention
    config.layers = _build_llama3_layers(
        fuse_qkv=False,
        n_layers=len(config.layers),
        dim=config.dim,
        n_heads=attention.n_heads,
        hidden_dim=compute_ffn_hidden_dim(config.dim, multiple_of=256),
        rope=attention.rope,
        attn_backend="flex",
    )
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    options = SETUPS[setup]
    parallelism = ParallelismConfig(
        data_parallel_shard_degree=options["mesh"]["dp"],
        tensor_parallel_degree=options["tp"],
        enable_sequence_parallel=options["sequence_parallel"],
        spmd_backend="partial_dtensor",
    )
    config.update_from_config(config=types.SimpleNamespace(parallelism=parallelism))
    return config, parallelism


def _torchtitan(config: Any, parallelism: Any, full: nn.Module) -> tuple[nn.Module, Any]:
    """The model as torchtitan's trainer builds it (meta, parallelize_llama, to_empty, init),
    then loaded with ``full``'s parameters."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor, distribute_tensor
    from torchtitan.config import CompileConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.llama3 import parallelize_llama

    dims = ParallelDims.from_config(parallelism, dist.get_world_size())
    dims.build_mesh()
    with torch.device("meta"):
        model = config.build()
    model = parallelize_llama(
        model,
        parallel_dims=dims,
        training=TrainingConfig(mixed_precision_param="float32"),
        parallelism=parallelism,
        compile_config=CompileConfig(),
        ac_config=None,
        dump_folder="",
    )
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights()
        source = dict(full.named_parameters())
        for fqn, param in model.named_parameters():
            value = source[fqn].detach()
            if isinstance(param, DTensor):
                value = distribute_tensor(value, param.device_mesh, param.placements).to_local()
                param.to_local().copy_(value)
            else:
                param.copy_(value)
    for module in model.modules():
        if isinstance(module, FSDPModule):  # plain sums: the loss is divided by global tokens
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return model, dims


def _standard_embedding(model: nn.Module) -> None:
    """torchtitan's ``Embedding.forward`` unwraps a DTensor weight to its local shard and does its
    own vocab-parallel lookup (it is parallelized by torchtitan's module protocol, not by a
    ``ParallelStyle``), so PyTorch's ``RowwiseParallel`` cannot run through it: give the meshtrain
    copy ``nn.Embedding``'s forward, the same lookup on DTensors."""
    model.tok_embeddings.__class__ = nn.Embedding


def _batch(step: int, dp_rank: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + dp_rank)
    tokens = torch.randint(0, vocab, (BATCH, SEQ + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def _global(loss: torch.Tensor, group: Any) -> float:
    """The step's global loss from this rank's share (already divided by the global tokens)."""
    value = loss.detach()
    value = value.full_tensor() if hasattr(value, "full_tensor") else value
    value = value.clone()
    dist.all_reduce(value, group=group)
    return float(value)


def measure(setup: str, rounds: int) -> dict[str, Any]:
    """Runs on every rank: build both, compare the first steps' losses, then time and count."""
    _on_cpu()
    from torch.distributed.tensor.parallel import loss_parallel

    config, parallelism = _config(setup)
    torch.manual_seed(0)
    full = config.build()
    with torch.no_grad():
        full.init_weights()
    titan, dims = _torchtitan(config, parallelism, copy.deepcopy(full))
    mesh = mt.make_mesh(dict(SETUPS[setup]["mesh"]))
    dp_size = mesh.size("dp")
    global_tokens = BATCH * SEQ * dp_size
    plan = mt.plan(
        full,
        mesh,
        _rules(setup),
        zero=3,
        grad_reduction="sum",
        global_batch=BATCH * dp_size,
        seq_len=SEQ,
    )
    ours = copy.deepcopy(full)
    if SETUPS[setup]["tp"] > 1:
        _standard_embedding(ours)
    ours = mt.apply(plan, ours)
    dp_rank = mesh.coordinates(dist.get_rank())["dp"]
    dp_group = device_mesh(mesh).get_group("dp")
    vocab = config.vocab_size
    optimizers = {
        "meshtrain": torch.optim.AdamW(ours.parameters(), lr=1e-3),
        "torchtitan": torch.optim.AdamW(titan.parameters(), lr=1e-3),
    }

    def meshtrain_step(index: int) -> torch.Tensor:
        inputs, targets = _batch(index, dp_rank, vocab)
        with mt.micro_batch(plan, ours, last=True), mt.loss_parallel(plan):
            logits = ours(inputs)
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
            (loss := loss / global_tokens).backward()
        optimizers["meshtrain"].step()
        optimizers["meshtrain"].zero_grad()
        return loss

    def torchtitan_step(index: int) -> torch.Tensor:
        inputs, targets = _batch(index, dp_rank, vocab)
        context = loss_parallel if dims.tp_enabled else contextlib.nullcontext
        with context():
            logits = titan(inputs)
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
            (loss := loss / global_tokens).backward()
        optimizers["torchtitan"].step()
        optimizers["torchtitan"].zero_grad()
        return loss

    steps = {"meshtrain": meshtrain_step, "torchtitan": torchtitan_step}
    losses = {
        name: [_global(step(index), dp_group) for index in range(LOSS_STEPS)]
        for name, step in steps.items()
    }
    if dist.get_rank() == 0:
        losses["one process"] = _one_process(full, dp_size, vocab)
    dist.barrier()
    times = interleaved(steps, rounds, warmup=0)
    groups = {"dp": dims.get_mesh("fsdp").get_group()}
    if dims.tp_enabled:
        groups["tp"] = dims.get_mesh("tp").get_group()
    counts = {}
    for name, step in steps.items():
        with CollectiveCounter(mesh, groups) as counter:
            step(LOSS_STEPS + rounds)
        counts[name] = {
            f"{kind}@{axis}": [n, counter.bytes[(kind, axis)]]
            for (kind, axis), n in sorted(counter.counts.items())
        }
    counts["plan"] = {
        f"{kind}@{axis}": list(row)
        for (kind, axis), row in sorted(plan.collective_totals().items())
    }
    return {"losses": losses, "times": times, "counts": counts}


def _one_process(model: nn.Module, dp_size: int, vocab: int) -> list[float]:
    """The full model trained on the global batch in this process: the losses both must match."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for index in range(LOSS_STEPS):
        batches = [_batch(index, rank, vocab) for rank in range(dp_size)]
        inputs = torch.cat([b[0] for b in batches])
        targets = torch.cat([b[1] for b in batches])
        loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--setups", nargs="*", default=list(SETUPS))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    try:
        import torchtitan  # noqa: F401
    except ImportError as error:
        raise SystemExit(
            f"torchtitan is not installed ({error}); install it beside meshtrain with the bench "
            "extra: pip install -c constraints/cpu.txt -e '.[bench]'"
        ) from error
    from importlib.metadata import version

    results: dict[str, Any] = {}
    for setup in args.setups:
        per_rank = get_pool(4).run(measure, setup, args.rounds, _timeout_s=1800)
        losses = per_rank[0]["losses"]
        reference = losses["one process"]
        results[setup] = {
            "mesh": SETUPS[setup]["mesh"],
            "sequence_parallel": SETUPS[setup]["sequence_parallel"],
            **summarise([r["times"] for r in per_rank], "meshtrain", "torchtitan"),
            "losses": losses,
            "worst_loss_rel_diff": {
                name: max(abs(a - b) / abs(b) for a, b in zip(values, reference))
                for name, values in losses.items()
                if name != "one process"
            },
            "collectives": per_rank[0]["counts"],
        }
        print(_table(setup, results[setup]), flush=True)
    record = {
        **provenance(),
        "torchtitan": version("torchtitan"),
        "ranks": "4 CPU gloo ranks",
        "model": "torchtitan llama3 debugmodel (dim 256, 6 layers, vocab 2048), fuse_qkv=False, SDPA",
        "batch_per_dp_rank": BATCH,
        "seq_len": SEQ,
        "rounds": args.rounds,
        "results": results,
    }
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=1) + "\n")


def _table(setup: str, result: dict[str, Any]) -> str:
    m = result["median_step_s"]
    losses = result["losses"]
    lines = [
        f"{setup} {result['mesh']}{' +SP' if result['sequence_parallel'] else ''}: meshtrain "
        f"{m['meshtrain'] * 1e3:.1f} ms, torchtitan {m['torchtitan'] * 1e3:.1f} ms, ratio "
        f"{result['ratio']:.3f} ({round_by_round(result['paired_ratio'])})",
        "  " + cpu_line(result, {"meshtrain": "meshtrain", "torchtitan": "torchtitan"}),
        "  losses, step by step: "
        + "; ".join(
            f"{name} " + " ".join(f"{v:.6f}" for v in values) for name, values in losses.items()
        ),
        "  worst relative difference from one process: "
        + ", ".join(f"{k} {v:.1e}" for k, v in result["worst_loss_rel_diff"].items()),
        f"  {'collective@axis':<22} {'plan':>16} {'meshtrain':>16} {'torchtitan':>16}  (count/bytes)",
    ]
    c = result["collectives"]
    for key in sorted(set(c["plan"]) | set(c["meshtrain"]) | set(c["torchtitan"])):
        cells = [c[name].get(key) for name in ("plan", "meshtrain", "torchtitan")]
        shown = [f"{v[0]}/{v[1]:,}" if v else "-" for v in cells]
        lines.append(f"  {key:<22} {shown[0]:>16} {shown[1]:>16} {shown[2]:>16}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
