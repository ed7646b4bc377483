"""A CNN with BatchNorm under data parallelism on 4 CPU ranks, in a loop written as for DDP.

Run::

    torchrun --standalone --nproc_per_node 4 examples/cnn_ddp.py

``zero=0`` replicates the model as DDP does (``zero=3`` would shard it like FSDP); gradients are
averaged over the ranks, and every BatchNorm computes its statistics over the global batch, so
the model — its running statistics included — trains as on one device. Rank 0 trains the same
model in one process on the whole batch and prints both losses.
"""

from __future__ import annotations

import argparse
import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import meshtrain as mt


class ConvBlock(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.norm = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.norm(self.conv(x)))


class TinyResNet(nn.Module):
    def __init__(self, channels: int = 16, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, channels, 3, padding=1), nn.BatchNorm2d(channels))
        self.blocks = nn.ModuleList(ConvBlock(channels) for _ in range(3))
        self.head = nn.Linear(channels, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        h = self.stem(images)
        for block in self.blocks:
            h = block(h)
        return self.head(h.mean(dim=(2, 3)))


def train(steps: int = 5, batch: int = 16) -> list[tuple[float, float]]:
    """On every rank of an initialised process group: (distributed loss, one-device loss) per step."""
    mesh = mt.make_mesh(dp=-1)
    torch.manual_seed(0)
    model = TinyResNet()
    reference = copy.deepcopy(model)
    plan = mt.plan(model, mesh, mt.Rules({r".*": mt.P()}, fsdp="dp"), zero=0)
    model = mt.apply(plan, model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    ranks, rank = dist.get_world_size(), dist.get_rank()
    data = torch.Generator().manual_seed(1234)
    losses = []
    for _ in range(steps):
        images = torch.randn(batch, 3, 16, 16, generator=data)
        labels = torch.randint(0, 10, (batch,), generator=data)
        mine = slice(rank * batch // ranks, (rank + 1) * batch // ranks)
        loss = F.cross_entropy(model(images[mine]), labels[mine])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

        ref_loss = F.cross_entropy(reference(images), labels)
        ref_loss.backward()
        ref_optimizer.step()
        ref_optimizer.zero_grad()

        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append((float(mean) / ranks, float(ref_loss.detach())))
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
