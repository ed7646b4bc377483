"""Every ``>>>`` example in the documentation pages runs and prints what the page says."""

from __future__ import annotations

import doctest
import re
from pathlib import Path

import pytest

DOCS = [
    page
    for page in sorted((Path(__file__).resolve().parents[1] / "docs").glob("*.md"))
    if ">>> " in page.read_text()
]
_FENCE = re.compile(r"(?m)^[ \t]*```.*$")


@pytest.mark.parametrize("page", DOCS, ids=[page.name for page in DOCS])
def test_page_examples(page: Path) -> None:
    # Code fences are blanked so an example's expected output ends at the fence, not after it.
    text = _FENCE.sub("", page.read_text())
    test = doctest.DocTestParser().get_doctest(
        text, {"__name__": page.stem}, str(page), str(page), 0
    )
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    report: list[str] = []
    runner.run(test, out=report.append)
    assert runner.tries > 0 and runner.failures == 0, "".join(report)
