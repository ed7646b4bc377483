"""Every rank must train the same plan: a fingerprint of the plan and the recipe, compared across
ranks at startup.

Ranks that load different recipes (an edited file on one node, a different ``--set``, another
meshtrain or torch version) would otherwise issue different collectives and hang, or train
silently wrong. The check is one all-gather of a 32-byte digest, the same on every rank; only when
the digests differ do the ranks exchange their recipes to say what differs.

Example:
    >>> a = fingerprint('{"plan": 1}', {"train": {"lr": 0.001}})
    >>> a == fingerprint('{"plan": 1}', {"train": {"lr": 0.001}}), len(a)
    (True, 64)
    >>> recipe_differences({"train": {"lr": 0.001}}, {"train": {"lr": 0.002}})
    ['train.lr = 0.001 vs 0.002']
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from meshtrain.errors import TrainingError
from meshtrain.tables import flatten_table


def fingerprint(plan_json: str, recipe: Mapping[str, Any]) -> str:
    """sha256 (hex) of the plan's JSON, the recipe's canonical JSON and the torch version."""
    digest = hashlib.sha256()
    for part in (plan_json, _canonical(recipe), torch.__version__):
        digest.update(part.encode())
        digest.update(b"\0")
    return digest.hexdigest()


def check_same_plan(plan_json: str, recipe: Mapping[str, Any]) -> str:
    """All-gather this rank's fingerprint; raise :class:`~meshtrain.TrainingError` on every rank
    when any two differ, naming the ranks and what differs. Returns the common fingerprint."""
    mine = fingerprint(plan_json, recipe)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return mine
    world = dist.get_world_size()
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"  # NCCL gathers CUDA tensors only
    local = torch.frombuffer(bytearray(bytes.fromhex(mine)), dtype=torch.uint8).to(device)
    gathered = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(gathered, local)
    digests = [bytes(t.cpu().tolist()).hex() for t in gathered]
    if len(set(digests)) == 1:
        return mine
    recipes: list[Any] = [None] * world
    dist.all_gather_object(recipes, {"recipe": dict(recipe), "plan": plan_json})
    groups: dict[str, list[int]] = {}
    for rank, digest in enumerate(digests):
        groups.setdefault(digest, []).append(rank)
    lines = []
    for digest, ranks in groups.items():
        first = ranks[0]
        if first == 0:
            continue
        differences = recipe_differences(recipes[0]["recipe"], recipes[first]["recipe"])
        what = (
            "; ".join(differences[:5])
            if differences
            else "the same recipe but a different plan (another meshtrain, torch or model code?)"
        )
        lines.append(f"ranks {ranks} (fingerprint {digest[:12]}) differ from rank 0: {what}")
    raise TrainingError(
        f"the {world} ranks do not agree on what to train (rank 0's fingerprint "
        f"{digests[0][:12]}): " + " | ".join(lines) + ". Start every rank with the same recipe "
        "file, the same --set overrides and the same meshtrain and torch versions."
    )


def recipe_differences(left: Mapping[str, Any], right: Mapping[str, Any]) -> list[str]:
    """``section.key = a vs b`` for every leaf that differs (a missing one shows as <unset>)."""
    flat_left, flat_right = flatten_table(left), flatten_table(right)
    return [
        f"{key} = {_show(flat_left, key)} vs {_show(flat_right, key)}"
        for key in sorted(set(flat_left) | set(flat_right))
        if flat_left.get(key, _UNSET) != flat_right.get(key, _UNSET)
    ]


_UNSET = object()


def _show(flat: Mapping[str, Any], key: str) -> str:
    return json.dumps(flat[key], default=str) if key in flat else "<unset>"


def _canonical(recipe: Mapping[str, Any]) -> str:
    return json.dumps(recipe, sort_keys=True, default=str, separators=(",", ":"))
