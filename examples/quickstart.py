"""Train the debug Llama on 4 CPU ranks: FSDP over ``dp`` × tensor parallel over ``tp``.

Run (the README's first command installs meshtrain and runs this)::

    torchrun --standalone --nproc_per_node 4 examples/quickstart.py

What it shows: a named mesh, the model's logical-axis rules resolved to one spec per parameter
(printed as a coverage table), tensor-parallel styles read off those specs (a Linear whose
weight is ``P('tp', None)`` is column-wise, ``P(None, 'tp')`` row-wise, a vocab-sharded embedding
row-wise), FSDP2 over the data axis, and a few AdamW steps whose loss rank 0 compares with the
same model trained on one device from the same initial weights and data.

Until the plan compiler lands, the lowering below is written out by hand with PyTorch's own
``parallelize_module`` and ``fully_shard``.
"""

from __future__ import annotations

import argparse
import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    loss_parallel,
    parallelize_module,
)

import meshtrain as mt
from meshtrain.models import LlamaConfig, build_llama, default_rules


def tensor_parallel_styles(model: nn.Module, specs: dict[str, mt.P]) -> dict[str, ParallelStyle]:
    """Module FQN → parallel style, read off each weight's spec."""
    styles: dict[str, ParallelStyle] = {}
    for fqn, spec in specs.items():
        module_fqn, _, name = fqn.rpartition(".")
        module = model.get_submodule(module_fqn)
        if spec.padded(2) == mt.P(None, None) or spec == mt.P():
            continue
        if isinstance(module, nn.Linear) and name == "weight":
            if spec == mt.P("tp", None) or spec == mt.P("tp"):
                # The output head keeps its logits vocab-sharded for the loss-parallel cross-entropy.
                styles[module_fqn] = ColwiseParallel(use_local_output=module_fqn != "output")
                continue
            if spec == mt.P(None, "tp"):
                styles[module_fqn] = RowwiseParallel()
                continue
        if isinstance(module, nn.Embedding) and spec in (mt.P("tp"), mt.P("tp", None)):
            styles[module_fqn] = RowwiseParallel(input_layouts=Replicate())
            continue
        raise mt.PlanError(f"parameter '{fqn}' has {spec!r}, which this example cannot lower.")
    return styles


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    parser.add_argument("--seq", type=int, default=32)
    args = parser.parse_args()

    mesh = mt.make_mesh(dp=-1, tp=args.tp)  # reads the torchrun environment; gloo on CPU
    rank, dp, dp_rank = dist.get_rank(), mesh.size("dp"), mesh.coordinates(dist.get_rank())["dp"]
    config = LlamaConfig.debug()

    # Initialise once, on full tensors, from one seed: every rank and the reference start equal.
    model = build_llama(config, seed=0)
    reference = copy.deepcopy(model) if rank == 0 else None

    resolution = default_rules(tp="tp", fsdp="dp").resolve(model, mesh)
    if rank == 0:
        print(resolution.report())

    assert mesh.device_mesh is not None
    if args.tp > 1:
        parallelize_module(
            model, mesh.device_mesh["tp"], tensor_parallel_styles(model, resolution.specs)
        )
    if dp > 1:
        dp_mesh = mesh.device_mesh["dp"]
        for block in model.layers.values():
            fully_shard(block, mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh)

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    ref_optimizer = (
        torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.1) if reference else None
    )
    data = torch.Generator().manual_seed(1234)
    for step in range(1, args.steps + 1):
        tokens = torch.randint(0, config.vocab_size, (args.batch, args.seq + 1), generator=data)
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        local = slice(dp_rank * args.batch // dp, (dp_rank + 1) * args.batch // dp)

        # Equal tokens per dp rank: the local mean, averaged by FSDP's gradient reduction, is the
        # mean over the global batch. Under loss_parallel the vocab-sharded logits are never gathered.
        with loss_parallel():
            logits = model(inputs[local])
            loss = F.cross_entropy(logits.flatten(0, 1), targets[local].flatten())
            loss.backward()
        loss = loss.full_tensor() if isinstance(loss, DTensor) else loss
        optimizer.step()
        optimizer.zero_grad()

        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)
        global_loss /= mesh.world_size  # every tp rank holds the same dp-local loss
        if reference is not None and ref_optimizer is not None:
            ref_loss = F.cross_entropy(reference(inputs).flatten(0, 1), targets.flatten())
            ref_loss.backward()
            ref_optimizer.step()
            ref_optimizer.zero_grad()
            print(
                f"step {step}  loss {global_loss.item():.6f}  one device {ref_loss.item():.6f}  "
                f"|diff| {abs(global_loss.item() - ref_loss.item()):.1e}",
                flush=True,
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
