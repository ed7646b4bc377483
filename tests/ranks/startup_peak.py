"""One rank of the start-up memory test (run under torchrun by tests/test_startup_memory.py).

Builds a recipe's model the way ``meshtrain train`` does (``start_model``) and writes, per rank,
the growth of the process's peak resident memory during start-up next to what the plan says the
rank holds at rest and the largest single tensor of the model (the one unit the materialiser
holds in full at a time; an NF4 weight's counts in fp32, the stand-in it is drawn in). Besides
the peak resident set (which counts a checkpoint's memory-mapped pages as they are read), the peak
of anonymous resident memory is sampled every millisecond: what the process itself allocated.
"""

from __future__ import annotations

import json
import resource
import sys
import threading
from pathlib import Path

import torch
import torch.distributed as dist

from meshtrain.adapters.nf4 import dequantize, is_nf4, nf4_bytes
from meshtrain.launch import init_distributed
from meshtrain.recipes.recipe import recipe_from_toml
from meshtrain.recipes.run import start_model
from meshtrain.spec.mesh import make_mesh


def peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def anonymous_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


class AnonymousPeak(threading.Thread):
    """Samples the anonymous resident memory until stopped; ``peak`` is the largest sample."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak = anonymous_bytes()
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.001):
            self.peak = max(self.peak, anonymous_bytes())

    def stop(self) -> int:
        self.done.set()
        self.join()
        return max(self.peak, anonymous_bytes())


def full_bytes(param: torch.Tensor) -> int:
    """A parameter's bytes built whole: an NF4 base weight in fp32, as it was trained."""
    return param.numel() * (4 if is_nf4(param) else param.element_size())


def local_bytes(param: torch.Tensor) -> int:
    local = param.to_local()
    return nf4_bytes(local.numel()) if is_nf4(local) else local.numel() * local.element_size()


def main(recipe_file: str, out: str) -> None:
    init_distributed(backend="gloo")
    recipe = recipe_from_toml(Path(recipe_file).read_text(), source=recipe_file)
    meta = recipe.build_model(device="meta")
    largest = max(full_bytes(p) for p in meta.parameters())
    full = sum(full_bytes(p) for p in meta.parameters())
    dist.barrier()
    before, anonymous_before, sampler = peak_bytes(), anonymous_bytes(), AnonymousPeak()
    sampler.start()
    plan, applied, _ = start_model(recipe, make_mesh(recipe.mesh_axes()), torch.device("cpu"))
    dist.barrier()
    grown, grown_anonymous = peak_bytes() - before, sampler.stop() - anonymous_before
    local = sum(local_bytes(p) for p in applied.parameters())
    finite = all(bool(torch.isfinite(dequantize(p.to_local())).all()) for p in applied.parameters())
    nf4 = sum(is_nf4(p.to_local()) for p in applied.parameters())
    report = {
        "rank": dist.get_rank(),
        "grown": grown,
        "grown_anonymous": grown_anonymous,
        "at_rest": plan.memory.params,
        "local": local,
        "largest": largest,
        "full": full,
        "finite": finite,
        "nf4": nf4,
    }
    Path(out, f"rank{dist.get_rank()}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
