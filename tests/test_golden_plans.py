"""Golden plans (tier 1, abstract meshes): every zoo architecture and every shipped recipe gets
exactly the plan stored under ``tests/golden/plans/`` — layouts, styles, FSDP units and their
decisions, partial gradients, collectives, memory — or the stored refusal. A change that alters a
plan fails here with a diff; regenerate with ``python -m tests.golden --update`` and review it."""

from __future__ import annotations

import pytest

from tests.golden import CASES, current, diff, path


@pytest.mark.parametrize("name", list(CASES))
def test_plan_is_the_golden_one(name: str) -> None:
    assert path(name).exists(), (
        f"no golden plan for {name!r}: python -m tests.golden --update {name}"
    )
    now = current(name)
    assert now == path(name).read_text(), (
        f"the plan of {name!r} changed (if intended: python -m tests.golden --update {name}):\n"
        + diff(name, now)
    )


def test_a_changed_plan_shows_as_a_readable_diff() -> None:
    """The failure names the changed field, line by line (here: one layout's spec)."""
    import json

    stored = path("llama-tp").read_text()
    data = json.loads(stored)
    data["params"][0]["spec"]["entries"] = ["planted", None]
    text = diff("llama-tp", json.dumps(data, sort_keys=True, indent=1) + "\n")
    assert "(stored)" in text and "(planned now)" in text
    added = [line for line in text.splitlines() if line.startswith("+ ")]
    removed = [line for line in text.splitlines() if line.startswith("- ")]
    assert [line.strip("+ ,") for line in added] == ['"planted"'], text
    assert [line.strip("- ,") for line in removed] == ['"tp"'], text
