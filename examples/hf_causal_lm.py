"""A Hugging Face causal LM in your own training loop, under FSDP × tensor parallel on 4 CPU ranks.

Run::

    torchrun --standalone --nproc_per_node 4 examples/hf_causal_lm.py

The model is ``transformers``' ``LlamaForCausalLM``, built tiny and random from a config (nothing
is downloaded); the rules are the model's own tensor-parallel plan (``mt.Rules.from_hf``). The
loop is the one you would write for DDP: each rank's mean loss over its own batch, ``backward``,
``optimizer.step`` — the plan averages gradients over data-parallel ranks as DDP does. Rank 0
trains the same model in one process on the whole batch and prints both losses.
"""

from __future__ import annotations

import argparse
import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

import meshtrain as mt
from meshtrain.train import clip_grad_norm_

CONFIG = LlamaConfig(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    use_cache=False,
)


def train(steps: int = 5, batch: int = 8, seq: int = 32) -> list[tuple[float, float]]:
    """On every rank of an initialised process group: (distributed loss, one-device loss) per step."""
    mesh = mt.make_mesh(dp=-1, tp=2)
    torch.manual_seed(0)  # the same weights on every rank: initialise once, on full tensors
    model = LlamaForCausalLM(CONFIG)
    reference = copy.deepcopy(model)
    plan = mt.plan(model, mesh, mt.Rules.from_hf(model, fsdp="dp"), zero=3)
    if dist.get_rank() == 0:
        print(plan.explain())
    model = mt.apply(plan, model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    dp, dp_rank = mesh.size("dp"), mesh.coordinates(dist.get_rank())["dp"]
    data = torch.Generator().manual_seed(1234)
    losses = []
    for _ in range(steps):
        tokens = torch.randint(0, CONFIG.vocab_size, (batch, seq + 1), generator=data)
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        mine = slice(dp_rank * batch // dp, (dp_rank + 1) * batch // dp)
        logits = model(inputs[mine]).logits  # vocab-sharded under tensor parallelism
        loss = F.cross_entropy(logits.flatten(0, 1), targets[mine].flatten())
        loss.backward()
        clip_grad_norm_(model.parameters(), max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()

        ref_loss = F.cross_entropy(reference(inputs).logits.flatten(0, 1), targets.flatten())
        ref_loss.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm=1.0)
        ref_optimizer.step()
        ref_optimizer.zero_grad()

        mean = mt.full_tensor(loss.detach())
        dist.all_reduce(mean)
        losses.append((float(mean) / dist.get_world_size(), float(ref_loss.detach())))
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    mt.init_distributed()
    for step, (loss, ref) in enumerate(train(args.steps), start=1):
        if dist.get_rank() == 0:
            print(
                f"step {step}  loss {loss:.6f}  one device {ref:.6f}  |diff| {abs(loss - ref):.1e}"
            )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
