"""Train the debug Llama on 4 CPU ranks: FSDP over ``dp`` × tensor parallel over ``tp``.

Run (the README's first command installs meshtrain and runs this)::

    torchrun --standalone --nproc_per_node 4 examples/quickstart.py

What it shows: a named mesh, the model's logical-axis rules compiled into a plan (printed with
``explain()``: one spec per parameter, the tensor-parallel style each module lowers to, FSDP
units, memory and collectives), ``mt.apply`` lowering it with PyTorch's own DTensor, tensor
parallel and FSDP2, and a few AdamW steps written as for DDP — each rank's mean loss over its own
batch, gradients averaged over data-parallel ranks by the plan and clipped by the global norm —
whose loss rank 0 compares with the same model trained on one device from the same initial
weights and data.
"""

from __future__ import annotations

import argparse
import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F

import meshtrain as mt
from meshtrain.lower import device_mesh
from meshtrain.models import LlamaConfig, build_llama, default_rules
from meshtrain.train import clip_grad_norm_


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    parser.add_argument("--seq", type=int, default=32)
    args = parser.parse_args()

    mt.init_distributed()  # joins torchrun's process group (gloo on CPU, NCCL on GPUs)
    mesh = mt.make_mesh(dp=-1, tp=args.tp)  # a description: {dp: world/tp, tp: tp}
    rank = dist.get_rank()
    dp, dp_rank = mesh.size("dp"), mesh.coordinates(rank)["dp"]
    config = LlamaConfig.debug()

    # Initialise once, on full tensors, from one seed: every rank and the reference start equal.
    model = build_llama(config, seed=0)
    reference = copy.deepcopy(model) if rank == 0 else None

    plan = mt.plan(model, mesh, default_rules(tp="tp", fsdp="dp"), zero=3)
    if rank == 0:
        print(plan.explain())
    mt.apply(plan, model)

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    ref_optimizer = (
        torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.1) if reference else None
    )
    data = torch.Generator().manual_seed(1234)
    for step in range(1, args.steps + 1):
        tokens = torch.randint(0, config.vocab_size, (args.batch, args.seq + 1), generator=data)
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        local = slice(dp_rank * args.batch // dp, (dp_rank + 1) * args.batch // dp)

        # This rank's mean loss, as for DDP: the plan averages gradients over data-parallel ranks.
        with mt.loss_parallel(plan):  # vocab-sharded logits are never gathered
            logits = model(inputs[local])
            loss = F.cross_entropy(logits.flatten(0, 1), targets[local].flatten())
            loss.backward()
        clip_grad_norm_(model.parameters(), max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()

        global_loss = mt.full_tensor(loss.detach())
        dist.all_reduce(global_loss, group=device_mesh(mesh).get_group("dp"))
        global_loss /= dp  # every data-parallel rank's mean over as many tokens: the global mean
        if reference is not None and ref_optimizer is not None:
            ref_loss = F.cross_entropy(reference(inputs).flatten(0, 1), targets.flatten())
            ref_loss.backward()
            torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm=1.0)
            ref_optimizer.step()
            ref_optimizer.zero_grad()
            print(
                f"step {step}  loss {global_loss.item():.6f}  one device {ref_loss.item():.6f}  "
                f"|diff| {abs(global_loss.item() - ref_loss.item()):.1e}",
                flush=True,
            )
    dist.barrier()  # every rank finishes its last collective before any tears the group down
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
