"""Step time of a mixture of experts on 4 gloo ranks: meshtrain's expert-parallel plans against
the same model with its experts sharded like any weight, against transformers' own Qwen3-MoE on
the same weights, and beside torchtitan's MoE where it runs on CPU.

One run, one pool of 4 ranks, the same global batches everywhere; every rank builds
meshtrain's MoE (``MoEConfig``: dim 128, 2 layers, 8 experts of width 256, top-2, Qwen3-style
q/k norms, no shared expert, softmax routing, no balance loss) from one seed, and from the same
weights (``moe_to_hf``) transformers' ``Qwen3MoeForCausalLM``. Setups:

- ``ep4``: meshtrain's MoE, experts over ``ep`` (2 per rank, tokens dispatched by all-to-all),
  the rest FSDP over ``ep`` (ZeRO-3);
- ``dp2_ep2``: the same over ``dp 2 × ep 2`` (experts FSDP over ``dp`` as torchtitan's efsdp);
- ``dp4``: the same model with the experts FSDP-sharded like any weight (no expert axis) — the
  baseline of every ratio;
- ``hf_eager`` / ``hf_grouped_mm``: transformers' Qwen3-MoE under a meshtrain ``dp 4`` plan with
  every weight ``P()`` (FSDP), its experts computed by its own loop over experts or by its
  ``grouped_mm`` implementation (``experts_implementation``);
- ``torchtitan``: torchtitan's Qwen3 MoE under its own expert parallelism (``ep 4``), when
  torchtitan is installed (the ``bench`` extra) and it runs; otherwise why not is recorded
  (``--no-torchtitan`` leaves it out).

Every step is one forward and backward of the summed next-token cross-entropy over the rank's
tokens divided by the global token count, with FSDP's gradients summed (``grad_reduction="sum"``),
so every setup's gradient is one device's on the global batch; then AdamW. The first steps'
global losses are compared with one process training meshtrain's MoE on the global batch (a plain
PyTorch loop, rank 0) and must agree within each plan's reduction-order contract
(``contract_for(plan).tolerance``, relative to the loss). Steps are interleaved (the order rotating
each round) and timed between barriers: the wall clock (the slowest rank) and CPU time summed over
the ranks. One more step of each is counted (``CollectiveCounter``): all-to-all bytes and every
other collective, beside the plan's own prediction.

Usage::

    python benchmarks/moe_parallel.py --rounds 20 --out benchmarks/results/moe_parallel.json

About two minutes at 20 rounds on 2 shared cores. On CPU, torchtitan needs what
``benchmarks/peer.py`` gives it (its device type pointed at the CPU, FlexAttention swapped for
SDPA, plain sums for FSDP's gradients on gloo) and one thing more: its SPMD backend set from its
parallelism config, as its trainer does (``set_spmd_backend``), or its token dispatcher looks for a
mesh context only the trainer opens.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import statistics
import traceback
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from provenance import provenance
from timing import interleaved, round_by_round, summarise
from torch import nn

import meshtrain as mt
from meshtrain import P, Rules
from meshtrain.models.moe import MoEConfig, build_moe
from meshtrain.models.moe import default_rules as moe_rules
from meshtrain.models.moe_hf import hf_config_from_moe, moe_to_hf
from meshtrain.testing.comms import CollectiveCounter
from meshtrain.testing.contract import contract_for
from meshtrain.testing.runner import get_pool
from meshtrain.train.loss import data_parallel_rank

logging.getLogger("transformers").setLevel(logging.ERROR)

WORLD = 4
BATCH, SEQ = 4, 64  # sequences per rank per step, tokens per sequence
LOSS_STEPS = 2  # steps whose losses are compared before timing
CONFIG = dict(
    dim=128,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    vocab_size=1024,
    n_experts=8,
    top_k=2,
    moe_inter=256,
    qk_norm=True,
    norm_eps=1e-6,
    max_seq_len=SEQ,
)
BASELINE = "dp4"
MESHTRAIN_SETUPS: dict[str, dict[str, Any]] = {
    "ep4": {
        "mesh": {"ep": 4},
        "model": "meshtrain",
        "rules": lambda: moe_rules(tp=None, fsdp=(), ep="ep"),
    },
    "dp2_ep2": {
        "mesh": {"dp": 2, "ep": 2},
        "model": "meshtrain",
        "rules": lambda: moe_rules(tp=None, fsdp="dp", ep="ep"),
    },
    "dp4": {
        "mesh": {"dp": 4},
        "model": "meshtrain",
        "rules": lambda: moe_rules(tp=None, fsdp="dp"),
    },
    "hf_eager": {
        "mesh": {"dp": 4},
        "model": "eager",
        "rules": lambda: Rules({".*": P()}, fsdp="dp"),
    },
    "hf_grouped_mm": {
        "mesh": {"dp": 4},
        "model": "grouped_mm",
        "rules": lambda: Rules({".*": P()}, fsdp="dp"),
    },
}
LABELS = {
    "ep4": "meshtrain MoE, ep 4",
    "dp2_ep2": "meshtrain MoE, dp 2 × ep 2",
    "dp4": "meshtrain MoE, dp 4 (experts FSDP-sharded)",
    "hf_eager": "transformers Qwen3-MoE eager loop, dp 4",
    "hf_grouped_mm": "transformers Qwen3-MoE grouped_mm, dp 4",
    "torchtitan": "torchtitan Qwen3 MoE, its ep 4",
}
Step = Callable[[int], torch.Tensor]


def moe_config() -> MoEConfig:
    return MoEConfig(**CONFIG)  # type: ignore[arg-type]


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: ``WORLD · BATCH`` sequences, inputs and next tokens."""
    generator = torch.Generator().manual_seed(5000 + step)
    tokens = torch.randint(0, CONFIG["vocab_size"], (WORLD * BATCH, SEQ + 1), generator=generator)  # type: ignore[call-overload]
    return tokens[:, :-1], tokens[:, 1:]


def hf_model(full: nn.Module, implementation: str) -> nn.Module:
    """transformers' Qwen3-MoE holding ``full``'s weights, its experts run by ``implementation``."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = moe_config()
    hf = {k: v for k, v in hf_config_from_moe(config).items() if k not in ("architectures",)}
    model = Qwen3MoeForCausalLM(
        Qwen3MoeConfig(**hf, use_cache=False, experts_implementation=implementation)
    )
    state = {
        name: tensor.detach().clone()
        for fqn, param in full.named_parameters()
        for name, tensor in moe_to_hf(config, fqn, param)
    }
    model.load_state_dict(state, strict=True)
    return model


def _logits(output: Any) -> torch.Tensor:
    return getattr(output, "logits", output)


def meshtrain_setup(name: str, full: nn.Module) -> tuple[Step, Any, dict[str, Any]]:
    """The step of one meshtrain plan (this rank's rows of each global batch), its plan, and the
    process groups to count collectives on."""
    setup = MESHTRAIN_SETUPS[name]
    model = copy.deepcopy(full) if setup["model"] == "meshtrain" else hf_model(full, setup["model"])
    mesh = mt.make_mesh(dict(setup["mesh"]))
    plan = mt.plan(
        model,
        mesh,
        setup["rules"](),
        zero=3,
        grad_reduction="sum",
        global_batch=WORLD * BATCH,
        seq_len=SEQ,
    )
    model = mt.apply(plan, model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    index, ranks = data_parallel_rank(plan)
    rows = slice(index * BATCH, (index + 1) * BATCH)
    assert ranks == WORLD, (name, ranks)

    def step(at: int) -> torch.Tensor:
        inputs, targets = batch(at)
        with mt.micro_batch(plan, model, last=True):
            logits = _logits(model(inputs[rows]))
            loss = F.cross_entropy(logits.flatten(0, 1), targets[rows].flatten(), reduction="sum")
            (loss := loss / (WORLD * BATCH * SEQ)).backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    return step, plan, {}


def _titan_on_cpu() -> None:
    """torchtitan picks its device type at import (CUDA when none is found); point it at the CPU
    where it is read by name (as benchmarks/peer.py does)."""
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.distributed.utils as distributed_utils
    import torchtitan.tools.utils as tool_utils

    for module in (tool_utils, distributed_utils):
        module.device_type, module.device_module = "cpu", torch.cpu  # type: ignore[attr-defined]
    parallel_dims.device_type = "cpu"  # type: ignore[attr-defined]


def _titan_config() -> tuple[Any, Any]:
    """torchtitan's Qwen3 MoE with meshtrain's shapes (unfused QKV, SDPA attention, untied
    embeddings, no load-balancing bias), and its parallelism: FSDP over 4, experts over ep 4."""
    from torchtitan.config import ParallelismConfig
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.qwen3 import Qwen3Model, _build_qwen3_moe_layers, _qwen3_norm

    c = moe_config()
    layers = _build_qwen3_moe_layers(
        fuse_qkv=False,
        n_layers=c.n_layers,
        dim=c.dim,
        n_heads=c.n_heads,
        n_kv_heads=c.n_kv_heads,
        head_dim=c.head_dim,
        moe_hidden_dim=c.moe_inter,
        num_experts=c.n_experts,
        top_k=c.top_k,
        attn_backend="flex",
        moe_comm_backend="standard",
        rope=CosSinRoPE.Config(dim=c.head_dim, max_seq_len=SEQ, theta=c.rope_theta),
    )
    for layer in layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
        layer.moe.load_balance_coeff = None
    config = Qwen3Model.Config(
        vocab_size=c.vocab_size,
        dim=c.dim,
        norm=_qwen3_norm(c.dim),
        layers=layers,
        tok_embeddings=Embedding.Config(num_embeddings=c.vocab_size, embedding_dim=c.dim),
        lm_head=Linear.Config(in_features=c.dim, out_features=c.vocab_size),
    )
    parallelism = ParallelismConfig(
        data_parallel_shard_degree=WORLD,
        expert_parallel_degree=WORLD,
        spmd_backend="partial_dtensor",
    )
    config.update_from_config(config=types.SimpleNamespace(parallelism=parallelism))
    return config, parallelism


def _titan_state(full: nn.Module) -> dict[str, torch.Tensor]:
    """``full``'s weights under torchtitan's Qwen3 names (through transformers' names, whose
    rotary layout torchtitan's CosSinRoPE shares)."""
    config = moe_config()
    hf = {
        name: tensor.detach()
        for fqn, param in full.named_parameters()
        for name, tensor in moe_to_hf(config, fqn, param)
    }
    names = {
        "model.embed_tokens.weight": "tok_embeddings.weight",
        "model.norm.weight": "norm.weight",
        "lm_head.weight": "lm_head.weight",
    }
    per_layer = {
        "self_attn.q_proj.weight": "attention.qkv_linear.wq.weight",
        "self_attn.k_proj.weight": "attention.qkv_linear.wk.weight",
        "self_attn.v_proj.weight": "attention.qkv_linear.wv.weight",
        "self_attn.o_proj.weight": "attention.wo.weight",
        "self_attn.q_norm.weight": "attention.q_norm.weight",
        "self_attn.k_norm.weight": "attention.k_norm.weight",
        "input_layernorm.weight": "attention_norm.weight",
        "post_attention_layernorm.weight": "ffn_norm.weight",
        "mlp.gate.weight": "moe.router.gate.weight",
        "mlp.experts.down_proj": "moe.routed_experts.inner_experts.w2_EDF",
    }
    state = {}
    for name, tensor in hf.items():
        if name in names:
            state[names[name]] = tensor
            continue
        _, _, layer, rest = name.split(".", 3)
        if rest == "mlp.experts.gate_up_proj":
            gate, up = tensor.chunk(2, dim=1)
            prefix = f"layers.{layer}.moe.routed_experts.inner_experts."
            state[prefix + "w1_EFD"], state[prefix + "w3_EFD"] = gate, up
        else:
            state[f"layers.{layer}.{per_layer[rest]}"] = tensor
    return state


def torchtitan_setup(full: nn.Module) -> tuple[Step, None, dict[str, Any]]:
    """torchtitan's Qwen3 MoE built as its trainer builds it (meta, parallelize_qwen3, to_empty,
    init), loaded with ``full``'s weights; its step on this rank's rows, and its groups."""
    _titan_on_cpu()
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor, distribute_tensor
    from torchtitan.config import CompileConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as titan_utils
    from torchtitan.models.qwen3 import parallelize_qwen3

    config, parallelism = _titan_config()
    titan_utils.set_spmd_backend(parallelism.spmd_backend)  # as torchtitan's trainer does
    dims = ParallelDims.from_config(parallelism, dist.get_world_size())
    dims.build_mesh()
    with torch.device("meta"):
        model = config.build()
    model = parallelize_qwen3(
        model,
        parallel_dims=dims,
        training=TrainingConfig(mixed_precision_param="float32"),
        parallelism=parallelism,
        compile_config=CompileConfig(),
        ac_config=None,
        dump_folder="",
    )
    model.to_empty(device="cpu")
    source = _titan_state(full)
    with torch.no_grad():
        model.init_weights()
        params = dict(model.named_parameters())
        if set(params) != set(source):
            raise RuntimeError(f"parameter names differ: {sorted(set(params) ^ set(source))}")
        for fqn, param in params.items():
            value = source[fqn]
            if isinstance(param, DTensor):
                value = distribute_tensor(value, param.device_mesh, param.placements).to_local()
                param.to_local().copy_(value)
            else:
                param.copy_(value)
    for module in model.modules():
        if isinstance(module, FSDPModule):  # gradients summed, as torchtitan's trainer
            module.set_gradient_divide_factor(1.0)  # does; plain sums on gloo (no PREMUL_SUM)
            module.set_force_sum_reduction_for_comms(True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rank = dist.get_rank()
    rows = slice(rank * BATCH, (rank + 1) * BATCH)

    def step(at: int) -> torch.Tensor:
        inputs, targets = batch(at)
        logits = model(inputs[rows])
        loss = F.cross_entropy(logits.flatten(0, 1), targets[rows].flatten(), reduction="sum")
        (loss := loss / (WORLD * BATCH * SEQ)).backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    groups = {"dp": dims.get_mesh("fsdp").get_group()}
    if dims.ep_enabled:
        groups["ep"] = dims.get_mesh("ep").get_group()
    return step, None, groups


def one_process(full: nn.Module) -> list[float]:
    """meshtrain's MoE trained on the global batch in this process by a plain PyTorch loop."""
    model = copy.deepcopy(full)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for index in range(LOSS_STEPS):
        inputs, targets = batch(index)
        loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def global_loss(loss: torch.Tensor) -> float:
    value = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
    value = value.clone()
    dist.all_reduce(value)
    return float(value)


def measure(names: list[str], rounds: int, titan: bool) -> dict[str, Any]:
    """Runs on every rank: build every setup, compare losses, time interleaved, count one step."""
    torch.manual_seed(0)
    full = build_moe(moe_config(), seed=0)
    steps: dict[str, Step] = {}
    plans: dict[str, Any] = {}
    groups: dict[str, dict[str, Any]] = {}
    for name in names:
        steps[name], plans[name], groups[name] = meshtrain_setup(name, full)
    losses = {
        name: [global_loss(step(i)) for i in range(LOSS_STEPS)] for name, step in steps.items()
    }
    failure = None
    if titan:
        try:
            step, plans["torchtitan"], groups["torchtitan"] = torchtitan_setup(full)
            losses["torchtitan"] = [global_loss(step(i)) for i in range(LOSS_STEPS)]
            steps["torchtitan"] = step
        except Exception as error:  # recorded as the reason it does not run, not hidden
            failure = "".join(traceback.format_exception_only(type(error), error)).strip()
            tail = traceback.format_exc().strip().splitlines()[-12:]
            failure += "\n" + "\n".join(tail)
    if dist.get_rank() == 0:
        losses["one process"] = one_process(full)
    dist.barrier()
    times = interleaved(steps, rounds, warmup=1)
    counts: dict[str, Any] = {}
    for name, step in steps.items():
        plan = plans[name]
        mesh = plan.mesh if plan is not None else mt.make_mesh({"dp": WORLD})
        with CollectiveCounter(mesh, groups[name]) as counter:
            step(LOSS_STEPS + rounds + 1)
        counts[name] = {
            f"{kind}@{axis}": [n, counter.bytes[(kind, axis)]]
            for (kind, axis), n in sorted(counter.counts.items())
        }
    predicted = {
        name: {
            f"{kind}@{axis}": list(row)
            for (kind, axis), row in sorted(plan.collective_totals().items())
        }
        for name, plan in plans.items()
        if plan is not None and name in MESHTRAIN_SETUPS
    }
    tolerance = {
        name: contract_for(plan).tolerance
        for name, plan in plans.items()
        if name in MESHTRAIN_SETUPS
    }
    if "torchtitan" in steps:  # its layout is ep4's: 4 batch ranks, experts over ep 4
        tolerance["torchtitan"] = tolerance.get("ep4", tolerance[BASELINE])
    return {
        "losses": losses,
        "times": times,
        "counts": counts,
        "plan": predicted,
        "tolerance": tolerance,
        "torchtitan_failure": failure,
    }


def check_losses(losses: dict[str, list[float]], tolerance: dict[str, float]) -> dict[str, float]:
    """Each setup's first steps' losses against one process: the worst relative difference; a
    setup of meshtrain's plans beyond its contract stops the benchmark."""
    reference = losses["one process"]
    worst = {}
    for name, values in losses.items():
        if name == "one process":
            continue
        worst[name] = max(abs(a - b) / abs(b) for a, b in zip(values, reference))
        bound = tolerance.get(name)
        if bound is not None and worst[name] > bound:
            raise SystemExit(
                f"{name}: losses {values} differ from one process {reference} by "
                f"{worst[name]:.2e} relative, beyond the plan's contract {bound:.2e}"
            )
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--setups", nargs="*", default=list(MESHTRAIN_SETUPS))
    parser.add_argument("--no-torchtitan", action="store_true", help="leave torchtitan's MoE out")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if BASELINE not in args.setups:
        raise SystemExit(f"--setups must include the baseline {BASELINE!r}")
    titan, absent = not args.no_torchtitan, None
    if titan:
        try:
            import torchtitan  # noqa: F401
        except ImportError as error:  # the bench extra is not installed: say so in the record
            titan, absent = (
                False,
                f"not installed ({error}); pip install -c constraints/cpu.txt -e '.[bench]'",
            )
    per_rank = get_pool(WORLD).run(measure, args.setups, args.rounds, titan, _timeout_s=3600)
    first = per_rank[0]
    names = list(first["times"]["wall"])
    tokens = WORLD * BATCH * SEQ
    summaries = {name: summarise([r["times"] for r in per_rank], name, BASELINE) for name in names}
    results = {
        name: {
            "label": LABELS[name],
            "step_s": _quartiles(
                [max(r["times"]["wall"][name][i] for r in per_rank) for i in range(args.rounds)]
            ),
            "cpu_step_s": _quartiles(
                [sum(r["times"]["cpu"][name][i] for r in per_rank) for i in range(args.rounds)]
            ),
            "tokens_per_s": tokens / summaries[name]["median_step_s"][name],
            "vs_" + BASELINE: {
                "wall": {k: summaries[name][k] for k in ("ratio", "paired_ratio")},
                "cpu": {k: summaries[name]["cpu"][k] for k in ("ratio", "paired_ratio")},
            },
            "losses": first["losses"][name],
            "collectives": first["counts"][name],
            "all_to_all_bytes_per_rank": [
                r["counts"][name].get("all_to_all@ep", [0, 0])[1] for r in per_rank
            ],
            "plan": first["plan"].get(name),
        }
        for name in names
    }
    worst = check_losses(first["losses"], first["tolerance"])
    for name, value in worst.items():
        results[name]["worst_loss_rel_diff"] = value
        results[name]["contract_tolerance"] = first["tolerance"].get(name)
    record = {
        **provenance(),
        "ranks": f"{WORLD} CPU gloo ranks",
        "model": {**CONFIG, "n_shared_experts": 0, "first_dense_layers": 0, "balance": "none"},
        "batch_per_rank": BATCH,
        "seq_len": SEQ,
        "tokens_per_step": tokens,
        "rounds": args.rounds,
        "one_process_losses": first["losses"]["one process"],
        "results": results,
    }
    if titan:
        from importlib.metadata import version

        record["torchtitan"] = version("torchtitan")
    if not args.no_torchtitan:
        record["torchtitan_failure"] = absent or first["torchtitan_failure"]
    print(table(record))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=1) + "\n")
        print(f"\nwrote {args.out}")


def _quartiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    q = statistics.quantiles(ordered, n=4)
    return {"median": statistics.median(ordered), "q1": q[0], "q3": q[2]}


def table(record: dict[str, Any]) -> str:
    lines = [
        f"{record['ranks']}, {record['machine']}, torch {record['torch']}; "
        f"{record['tokens_per_step']} tokens per step, {record['rounds']} interleaved rounds",
        "",
        "| setup | step ms, median (q1–q3) | vs dp 4 (wall) | CPU ms, all ranks | vs dp 4 (CPU) "
        "| tokens/s | first loss (worst rel. diff.) | all-to-all B/step, rank 0 (plan) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in record["results"].values():
        s, c = r["step_s"], r["cpu_step_s"]
        wall, cpu = r["vs_" + BASELINE]["wall"], r["vs_" + BASELINE]["cpu"]
        planned = f"{r['plan'].get('all_to_all@ep', [0, 0])[1]:,}" if r["plan"] else "–"
        a2a = r["all_to_all_bytes_per_rank"][0]
        lines.append(
            f"| {r['label']} | {s['median'] * 1e3:.1f} ({s['q1'] * 1e3:.1f}–{s['q3'] * 1e3:.1f}) "
            f"| {wall['ratio']:.3f} | {c['median'] * 1e3:.1f} | {cpu['ratio']:.3f} "
            f"| {r['tokens_per_s']:,.0f} | {r['losses'][0]:.7f} ({r['worst_loss_rel_diff']:.1e}) "
            f"| {a2a:,} ({planned}) |"
        )
    lines += ["", f"one process: losses {record['one_process_losses']}"]
    for clock in ("wall", "cpu"):
        lines.append(f"{clock} clock, each / {BASELINE}:")
        for name, r in record["results"].items():
            if name != BASELINE:
                paired = r["vs_" + BASELINE][clock]["paired_ratio"]
                lines.append(f"  {name}: {round_by_round(paired)}")
    if record.get("torchtitan_failure"):
        lines += ["", "torchtitan did not run:", record["torchtitan_failure"]]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
