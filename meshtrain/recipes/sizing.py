"""Size a recipe for a world it has not been run on: ``meshtrain plan RECIPE --world N``.

The model is built on the meta device and planned on an abstract mesh of ``world`` ranks (no
processes, no memory). The recipe's mesh keeps its fixed axis sizes and its ``-1`` axis absorbs
the rest. **Batch rule:** the recipe's global batch is kept when it splits into the world's
data-parallel ranks × micro-batches; otherwise it is rounded up to the next multiple (the report
says so) — the same sequences per micro-batch per rank a larger run would use. With
``strategy="auto"`` the degrees, ZeRO stage and checkpointing are chosen by
:func:`meshtrain.plan.auto.search.choose_plan` instead of the recipe's.

Example:
    >>> from meshtrain.recipes import load_recipe
    >>> sizing = size_recipe(load_recipe("debug"), world=8, device_memory="1GiB")
    >>> sizing.plan.mesh, sizing.footprint.fits
    (Mesh({dp: 4, tp: 2}), True)
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from meshtrain.errors import MeshError, PlanError
from meshtrain.plan.api import plan as make_plan
from meshtrain.plan.auto.experts import choose_expert_plan, has_experts
from meshtrain.plan.auto.search import choose_plan
from meshtrain.plan.ir import Plan
from meshtrain.plan.memory.footprint import Footprint, footprint
from meshtrain.plan.memory.sizes import parse_bytes
from meshtrain.plan.options import AutoSearch, PlanOptions
from meshtrain.recipes.recipe import Recipe
from meshtrain.spec.mesh import Mesh, make_mesh


@dataclass(frozen=True)
class Sizing:
    """A recipe planned at a world size: the plan, its footprint, the batch used, the time."""

    recipe: str
    world: int
    strategy: str
    global_batch: int
    batch_note: str
    plan: Plan
    footprint: Footprint
    seconds: float

    def format(self) -> str:
        """The report ``meshtrain plan`` prints."""
        head = (
            f"{self.recipe} on {self.world:,} ranks (strategy {self.strategy}): global batch "
            f"{self.global_batch:,} sequences{'; ' + self.batch_note if self.batch_note else ''}"
        )
        notes = [f"  - {note}" for note in self.plan.notes]
        tail = ["", "notes:", *notes] if notes else []
        return (
            "\n".join(
                [
                    head,
                    self.footprint.format().rstrip("\n"),
                    *tail,
                    f"planned in {self.seconds:.2f} s",
                ]
            )
            + "\n"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "recipe": self.recipe,
            "world": self.world,
            "strategy": self.strategy,
            "global_batch": self.global_batch,
            "batch_note": self.batch_note,
            "seconds": round(self.seconds, 3),
            "notes": list(self.plan.notes),
            **self.footprint.to_json(),
        }


def size_recipe(
    recipe: Recipe,
    *,
    world: int,
    device_memory: str | int | None = None,
    strategy: str = "recipe",
    node_size: int = 8,
    progress: Callable[[str], None] | None = None,
) -> Sizing:
    """Plan ``recipe`` on ``world`` abstract ranks and report one rank's footprint.

    ``strategy``: ``"recipe"`` (the recipe's mesh and options) or ``"auto"`` (needs
    ``device_memory``; ``progress``, e.g. ``print``, is told how a long search goes). Raises :class:`PlanError` when the recipe's fixed axes do not fit
    ``world`` (naming the smallest world that does) or, under auto, when nothing fits.
    """
    start = time.perf_counter()
    memory = parse_bytes(device_memory) if device_memory is not None else None
    model = recipe.build_model(device="meta")
    options = recipe.plan_options()
    global_batch = recipe.train.batch_size
    if strategy == "auto":
        if memory is None:
            raise PlanError("strategy auto needs the memory per device: give --device-memory.")
        chosen = PlanOptions()  # what the search chooses starts from the defaults
        request = dataclasses.replace(
            options,
            zero=chosen.zero,
            activation_checkpointing=chosen.activation_checkpointing,
            checkpoint_every=chosen.checkpoint_every,
            pipeline=None,
            microbatches=chosen.microbatches,
        )
        choose = choose_expert_plan if has_experts(model) else choose_plan
        choice = choose(
            model,
            world,
            recipe.rules(),
            request,
            search=AutoSearch(memory, node_size, progress),
            device_type="cuda",
        )
        plan, used, note = choice.plan, global_batch, ""
    elif strategy == "recipe":
        mesh = _mesh(recipe, world)
        used, note = _global_batch(recipe, mesh.shape, global_batch, options)
        plan = make_plan(
            model,
            mesh,
            recipe.rules(),
            dataclasses.replace(options, global_batch=used),
            example_inputs=recipe.example_inputs(),
        )
    else:
        raise PlanError(f"strategy {strategy!r} is unknown: use 'recipe' or 'auto'.")
    report = footprint(plan, memory)
    return Sizing(
        recipe.name, world, strategy, used, note, plan, report, time.perf_counter() - start
    )


def _mesh(recipe: Recipe, world: int) -> Mesh:
    axes = recipe.mesh_axes()
    try:
        return make_mesh(axes, world_size=world, abstract=True, device_type="cuda")
    except MeshError as error:
        fixed = math.prod(size for size in axes.values() if size != -1)
        raise PlanError(
            f"recipe {recipe.name!r} fixes mesh axes {axes} ({fixed} ranks per data-parallel "
            f"replica), which do not fit a world of {world}: {error.message.split('. ')[0]}. The "
            f"smallest world this mesh takes is {fixed} (then any multiple of it); or let "
            "--strategy auto choose the degrees, or change them with --set mesh.<axis>=N."
        ) from error


def _global_batch(
    recipe: Recipe, sizes: dict[str, int], global_batch: int, options: PlanOptions
) -> tuple[int, str]:
    """The batch rule (module docstring): the recipe's, or the next multiple that splits."""
    ep = recipe.parallel.ep
    experts = (ep,) if recipe.model.kind == "moe" and ep else ()  # it splits the batch too
    data_ranks = math.prod(sizes.get(axis, 1) for axis in (*recipe.parallel.fsdp, *experts))
    pipeline = options.pipeline
    if pipeline is not None:
        axis_size = sizes.get(pipeline.axis, 1)
        micro = pipeline.microbatches or axis_size * pipeline.stages_per_rank
    else:
        micro = options.microbatches
    per_step = data_ranks * micro
    if global_batch % per_step == 0:
        return global_batch, ""
    used = -(-global_batch // per_step) * per_step
    return used, (
        f"the recipe's {global_batch} does not split into {data_ranks} data-parallel ranks × "
        f"{micro} micro-batches, so it is rounded up to {used} "
        f"({used // per_step} per micro-batch per rank)"
    )
