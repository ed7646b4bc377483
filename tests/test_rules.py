"""Regex and logical-axis rules: first match wins, Flax priority semantics, no silent fallbacks."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from meshtrain import Mesh, P, RuleError, Rules, SpecError, annotate

MESH = Mesh(("dp", "tp"), (2, 2))
SHAPES = {
    "layers.0.attn.wq.weight": (8, 4),
    "layers.0.attn.wo.weight": (4, 8),
    "layers.1.attn.wq.weight": (8, 4),
    "layers.1.attn.wo.weight": (4, 8),
    "norm.weight": (4,),
}


def test_first_full_match_wins() -> None:
    rules = Rules(
        [
            (r"layers\.\d+\.attn\.wq\.weight", P("tp", None)),
            (r"layers\.\d+\.attn\.w.\.weight", P(None, "tp")),
            (r".*", P()),
        ]
    )
    specs = rules.resolve(SHAPES, MESH).specs
    assert specs["layers.0.attn.wq.weight"] == P("tp", None)
    assert specs["layers.1.attn.wo.weight"] == P(None, "tp")
    assert specs["norm.weight"] == P()


def test_patterns_match_whole_fqns_only() -> None:
    rules = Rules({r"wq\.weight": P("tp"), r".*": P()}, allow_unused=False)
    with pytest.raises(
        RuleError,
        match=r"r'wq\\.weight': no parameter matches it in full.*\nPatterns must match whole FQNs",
    ):
        rules.resolve(SHAPES, MESH)


def test_unmatched_parameters_are_listed_with_nearest_patterns() -> None:
    rules = Rules(
        {r"layers\.\d+\.attn\.wq\.weight": P("tp"), r"layers\.\d+\.attn\.wo\.weight": P()}
    )
    with pytest.raises(RuleError) as info:
        rules.resolve(SHAPES, MESH)
    message = str(info.value)
    assert "1 of 5 parameters match no rule on mesh {dp: 2, tp: 2}" in message
    assert "'norm.weight' (shape 4)" in message
    assert "allow_unmatched=True" in message
    assert info.value.fqn == "norm.weight"


def test_allow_unmatched_replicates_and_reports() -> None:
    rules = Rules({r"layers\.\d+\.attn\..*": P()}, allow_unmatched=True)
    resolution = rules.resolve(SHAPES, MESH)
    assert resolution.specs["norm.weight"] == P()
    assert resolution.coverage()["unmatched"] == ["norm.weight"]


def test_shadowed_rule_is_reported_as_unused() -> None:
    rules = Rules([(r".*", P()), (r"norm\.weight", P("tp"))])
    with pytest.raises(
        RuleError,
        match=r"shadowed: 'norm.weight' matches it but earlier rule r'\.\*' wins.*\nMove a shadowed rule",
    ):
        rules.resolve(SHAPES, MESH)
    assert Rules([(r".*", P()), (r"norm\.weight", P("tp"))], allow_unused=True).resolve(
        SHAPES, MESH
    )


def test_conflicting_and_malformed_rules() -> None:
    with pytest.raises(
        RuleError, match="conflicting rules: pattern 'w' maps to both P\\('tp'\\) and P\\(\\)"
    ):
        Rules([("w", P("tp")), ("w", P())])
    with pytest.raises(RuleError, match="not a valid regex"):
        Rules({"(": P()})
    with pytest.raises(RuleError, match="rules map to P"):
        Rules({"w": ("tp", None)})  # type: ignore[dict-item]


def test_spec_error_names_parameter_and_rule() -> None:
    rules = Rules({r"norm\.weight": P("tp"), r".*": P(None, "dp")})
    with pytest.raises(SpecError) as info:
        rules.resolve(
            {"norm.weight": (3,)},
            MESH,
        )
    assert (
        "parameter 'norm.weight' (shape 3) cannot take P('tp') (from rule regex r'norm\\.weight')"
        in str(info.value)
    )


LOGICAL = [
    ("batch", ("dp", "fsdp")),
    ("vocab", "tp"),
    ("heads", "tp"),
    ("mlp", "tp"),
    ("embed", "fsdp"),
    ("embed", None),
    ("norm", None),
]
MESH3 = Mesh(("dp", "fsdp", "tp"), (1, 2, 2))


@pytest.mark.parametrize(
    ("names", "expected"),
    [
        (("vocab", "embed"), P("tp", "fsdp")),
        (("embed", "mlp"), P("fsdp", "tp")),
        (("heads", "mlp"), P("tp")),  # tp taken by the earlier rule; mlp stays unsharded
        (("norm",), P()),
        (("batch", "embed"), P(("dp", "fsdp"))),  # fsdp used by batch; embed falls back to None
        (("embed", "embed"), P("fsdp")),  # a name twice: the first unassigned dim takes the axis
    ],
)
def test_logical_priority_semantics(names: tuple[str, ...], expected: P) -> None:
    assert Rules(logical=LOGICAL).logical_spec(names, MESH3) == expected


def test_unknown_logical_name_and_missing_axis_are_errors() -> None:
    with pytest.raises(
        RuleError, match=r"logical name 'emb' .* appears in no logical rule \(did you mean 'embed'"
    ):
        Rules(logical=LOGICAL).logical_spec(("vocab", "emb"))
    with pytest.raises(
        RuleError, match=r"names axis 'fsdp', which mesh \{dp: 2, tp: 2\} does not have.*fsdp=1"
    ):
        Rules(logical=LOGICAL).logical_spec(("vocab",), MESH)


class TinyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = annotate(nn.Embedding(16, 8), weight=("vocab", "embed"))
        self.proj = annotate(nn.Linear(8, 4), weight=("mlp", "embed"), bias=("mlp",))
        self.head = nn.Linear(4, 2, bias=False)


def test_resolve_reads_annotations_and_regex_overrides_them() -> None:
    with torch.device("meta"):
        model = TinyModel()
    rules = Rules({r"head\.weight": P()}, logical=LOGICAL)
    resolution = rules.resolve(model, MESH3)
    assert resolution.specs == {
        "embed.weight": P("tp", "fsdp"),
        "proj.weight": P("tp", "fsdp"),
        "proj.bias": P("tp"),
        "head.weight": P(),
    }
    assert resolution.coverage() == {
        "logical": ["embed.weight", "proj.weight", "proj.bias"],
        "regex r'head\\.weight'": ["head.weight"],
    }
    report = resolution.report()
    assert report.splitlines()[0] == "# specs on mesh {dp: 1, fsdp: 2, tp: 2}"
    assert "embed.weight" in report and "logical=('vocab', 'embed')" in report
    assert json.loads(resolution.to_json())["params"][0]["spec"] == {
        "entries": ["tp", "fsdp"],
        "unreduced": [],
    }


def test_unannotated_parameter_under_logical_rules_is_unmatched() -> None:
    with torch.device("meta"):
        model = TinyModel()
    with pytest.raises(RuleError, match=r"'head.weight' \(shape 2×4\) \(no logical names"):
        Rules(logical=LOGICAL).resolve(model, MESH3)


def test_logical_spec_that_does_not_divide_is_a_spec_error() -> None:
    shapes = {"w": (3, 8)}
    with pytest.raises(
        SpecError,
        match="parameter 'w' \\(shape 3×8\\) cannot take P\\('tp', 'fsdp'\\) \\(from rule logical \\('vocab', 'embed'\\)\\)",
    ):
        Rules(logical=LOGICAL).resolve(shapes, MESH3, logical_axes={"w": ("vocab", "embed")})


@given(st.permutations(["vocab", "heads", "mlp", "embed", "norm"]), st.integers(1, 3))
def test_logical_specs_never_use_an_axis_twice(names: list[str], ndim: int) -> None:
    spec = Rules(logical=LOGICAL).logical_spec(tuple(names[:ndim]), MESH3)
    assert len(spec.axes) == len(set(spec.axes))


def test_fsdp_axis_must_exist_and_logical_targets_must_be_axes() -> None:
    with pytest.raises(RuleError, match=r"fsdp=\('dpp',\) names axis 'dpp'.*did you mean 'dp'"):
        Rules({r".*": P()}, fsdp="dpp").resolve(SHAPES, MESH)
    with pytest.raises(RuleError, match=r"logical rule \('embed', 3\) has a bad mesh-axis target"):
        Rules(logical=[("embed", 3)])  # type: ignore[list-item]
