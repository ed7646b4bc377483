"""One rank of the start-up memory test (run under torchrun by tests/test_startup_memory.py).

Builds a recipe's model the way ``meshtrain train`` does (``start_model``) and writes, per rank,
the growth of the process's peak resident memory during start-up next to what the plan says the
rank holds at rest and the largest single tensor of the model (the one unit the materialiser
holds in full at a time).
"""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from meshtrain.launch import init_distributed
from meshtrain.recipes.recipe import recipe_from_toml
from meshtrain.recipes.run import start_model
from meshtrain.spec.mesh import make_mesh


def peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def main(recipe_file: str, out: str) -> None:
    init_distributed(backend="gloo")
    recipe = recipe_from_toml(Path(recipe_file).read_text(), source=recipe_file)
    meta = recipe.build_model(device="meta")
    largest = max(p.numel() * p.element_size() for p in meta.parameters())
    full = sum(p.numel() * p.element_size() for p in meta.parameters())
    dist.barrier()
    before = peak_bytes()
    plan, applied, _ = start_model(recipe, make_mesh(recipe.mesh_axes()), torch.device("cpu"))
    dist.barrier()
    grown = peak_bytes() - before
    local = sum(p.to_local().numel() * p.element_size() for p in applied.parameters())
    finite = all(bool(torch.isfinite(p.to_local()).all()) for p in applied.parameters())
    report = {"rank": dist.get_rank(), "grown": grown, "at_rest": plan.memory.params,
              "local": local, "largest": largest, "full": full, "finite": finite}  # fmt: skip
    Path(out, f"rank{dist.get_rank()}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
