"""Each closed vocabulary is defined once (issue 44, point 4): no two ``Literal`` aliases or
``Enum`` classes under ``meshtrain/`` list the same values. A layer that needs another layer's
vocabulary imports it (``lower/context/ring_attention.py`` takes the plan options' ``ContextMethod``)."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "meshtrain"


def _literal_values(node: ast.expr) -> tuple[object, ...] | None:
    """The values of ``Literal[...]`` (``None``: not a literal of constants)."""
    if not (isinstance(node, ast.Subscript) and getattr(node.value, "id", None) == "Literal"):
        return None
    items = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
    if not all(isinstance(item, ast.Constant) for item in items):
        return None
    return tuple(item.value for item in items if isinstance(item, ast.Constant))


def _enum_values(node: ast.ClassDef) -> tuple[object, ...] | None:
    if not any(
        getattr(base, "id", getattr(base, "attr", "")).endswith("Enum") for base in node.bases
    ):
        return None
    return tuple(
        statement.value.value
        for statement in node.body
        if isinstance(statement, ast.Assign) and isinstance(statement.value, ast.Constant)
    )


def vocabularies() -> dict[frozenset[object], list[str]]:
    """Value set → where each vocabulary with those values is defined (``file:name``)."""
    found: dict[frozenset[object], list[str]] = defaultdict(list)
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            values = None
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                values = _literal_values(node.value)
                name = ", ".join(getattr(t, "id", "?") for t in targets)
            elif isinstance(node, ast.ClassDef):
                values, name = _enum_values(node), node.name
            if values is not None and len(values) > 1:
                found[frozenset(values)].append(f"{path.relative_to(PACKAGE.parent)}:{name}")
    return found


def test_no_vocabulary_is_defined_twice() -> None:
    twice = {
        tuple(sorted(map(repr, values))): where
        for values, where in vocabularies().items()
        if len(where) > 1
    }
    assert not twice, f"vocabularies defined more than once (import one instead): {twice}"


def test_the_check_sees_the_vocabularies_it_guards() -> None:
    """Not vacuous: the context balance and method, document format and checkpointing modes are
    found, each once."""
    found = vocabularies()
    for values in (
        {"headtail", "contiguous"},
        {"ring", "allgather"},
        {"text", "instruction"},
        {"none", "full", "selective"},
    ):
        assert len(found[frozenset(values)]) == 1, (values, found.get(frozenset(values)))


def _functions() -> list[tuple[str, ast.FunctionDef]]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        name = str(path.relative_to(PACKAGE.parent))
        found += [(name, n) for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)]
    return found


def test_one_flattener_of_nested_tables_and_one_toml_value_writer() -> None:
    """Dotted keys come from ``meshtrain/tables.py``'s ``flatten_table`` and TOML values from its
    ``toml_value``: no other flattening function calls itself with a dotted ``prefix``, and no
    other function writes TOML values."""
    flatteners = [
        f"{name}:{function.name}"
        for name, function in _functions()
        if "flatten" in function.name
        and any(
            isinstance(call, ast.Call)
            and getattr(call.func, "id", None) == function.name
            and any(isinstance(arg, ast.JoinedStr) for arg in call.args)
            for call in ast.walk(function)
        )
    ]
    writers = [f"{n}:{f.name}" for n, f in _functions() if "toml_value" in f.name]
    assert flatteners == ["meshtrain/tables.py:flatten_table"]
    assert writers == ["meshtrain/tables.py:toml_value"]
