"""``mt.materialise`` on models meshtrain did not write (one process): a model built on the meta
device and materialised holds exactly the tensors ``initialise`` gives the same model built on
CPU the ordinary way; ties survive; a tensor no initialiser sets is refused by name."""

from __future__ import annotations

import pytest
import torch
import zoo
from torch import nn

import meshtrain as mt
from meshtrain.lower import initialise


def _cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 4)
    )


@pytest.mark.parametrize(
    "factory", [zoo.gpt2, zoo.bert, zoo.qwen2, _cnn], ids=["gpt2-tied", "bert-tied", "qwen2", "cnn"]
)
def test_meta_then_materialise_equals_a_cpu_build(factory) -> None:  # type: ignore[no-untyped-def]
    with torch.device("meta"):
        deferred = factory()
    mt.materialise(deferred, device="cpu", seed=3)
    direct = initialise(factory(), seed=3)
    ours, theirs = deferred.state_dict(), direct.state_dict()
    assert ours.keys() == theirs.keys()
    assert [name for name in ours if not torch.equal(ours[name], theirs[name])] == []
    assert all(not t.is_meta and bool(torch.isfinite(t.float()).all()) for t in ours.values())
    embeddings = getattr(deferred, "get_input_embeddings", None)
    if embeddings is not None and deferred.config.tie_word_embeddings:
        assert deferred.get_output_embeddings().weight is embeddings().weight


def test_the_seed_changes_the_values_and_the_same_seed_repeats_them() -> None:
    first, again, other = (initialise(_cnn(), seed=s) for s in (0, 0, 1))
    assert torch.equal(first[0].weight, again[0].weight)
    assert not torch.equal(first[0].weight, other[0].weight)


def test_a_parameter_no_initialiser_sets_is_refused_by_name() -> None:
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 4)
            self.gain = nn.Parameter(torch.randn(4))  # set in __init__ only

    with torch.device("meta"):
        model = Scaled()
    with pytest.raises(
        mt.PlanError, match=r"'gain' \(Scaled\) is not set by the module's initialiser"
    ):
        mt.materialise(model, device="cpu")
