"""``mt.materialise`` after ``mt.apply`` on real gloo ranks (tier 1): a Hugging Face model built on
the meta device, sharded (tensor parallel, FSDP) and materialised holds, gathered, exactly the
weights ``initialise`` gives the same model built on one CPU — every rank seeds every parameter
alike and copies its own shard, at its own offset."""

from __future__ import annotations

import pytest
import torch
import zoo

import meshtrain as mt
from meshtrain.lower import initialise
from meshtrain.testing.runner import get_pool

pytestmark = pytest.mark.spmd


def materialised_differs(axes: dict[str, int], tensor_parallel: bool) -> list[str]:
    """On every rank: the FQNs whose gathered weights differ from the one-CPU initialisation."""
    reference = initialise(zoo.llama(), seed=3)
    with torch.device("meta"):
        model = zoo.llama()
    rules = zoo.hf_rules(model) if tensor_parallel else zoo.REPLICATED
    if "dp" not in axes:
        rules = zoo.without_data_axes(rules)
    plan = mt.plan(model, mt.make_mesh(axes), rules, zero=3)
    mt.materialise(mt.apply(plan, model), seed=3)
    expected = dict(reference.named_parameters())
    return [
        fqn
        for fqn, param in model.named_parameters()
        if not torch.equal(mt.full_tensor(param.detach()), expected[fqn].detach())
    ]


@pytest.mark.parametrize(
    ("axes", "tensor_parallel"), [({"tp": 2}, True), ({"dp": 2}, False)], ids=["tp", "fsdp"]
)
def test_materialised_shards_gather_to_the_one_cpu_initialisation(
    axes: dict[str, int], tensor_parallel: bool
) -> None:
    for differ in get_pool(2).run(materialised_differs, axes, tensor_parallel):
        assert differ == []
