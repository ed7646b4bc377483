"""The recipes a name finds (``meshtrain recipe list``) and a copy of one to edit
(``meshtrain recipe cp NAME DEST``); read as TOML text, no torch.

Names are looked up in :func:`~meshtrain.recipes.source.recipe_roots`: ``recipes/`` under the
current directory first, then the recipes shipped with the package (an installed wheel holds
them as ``meshtrain/_recipes``), then the source tree's ``recipes/``. A name in an earlier root
hides the same name in a later one; the list says where each comes from.

Example:
    >>> debug = next(entry for entry in recipe_entries() if entry.name == "debug")
    >>> debug.model, debug.mesh
    ('debug', 'dp=-1 tp=2')
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from meshtrain.errors import RecipeError, describe_os_error
from meshtrain.files import refuse_link
from meshtrain.recipes.source import find_recipe, parse_recipe, recipe_roots

__all__ = ["RecipeEntry", "copy_recipe", "recipe_entries", "recipe_markdown", "recipe_table"]

SUMMARY_WIDTH = 72


@dataclass(frozen=True)
class RecipeEntry:
    """One recipe a name finds: where it is, its model, its mesh and its first comment line."""

    name: str
    path: Path
    model: str
    mesh: str
    summary: str


def recipe_entries() -> list[RecipeEntry]:
    """Every recipe a name finds, sorted by name (a name found in two roots: the first)."""
    found: dict[str, Path] = {}
    for root in recipe_roots():
        for path in sorted(root.glob("*.toml")) if root.is_dir() else ():
            found.setdefault(path.stem, path)
    return [_entry(name, found[name]) for name in sorted(found)]


def _entry(name: str, path: Path) -> RecipeEntry:
    text = path.read_text(encoding="utf-8")
    data, _ = parse_recipe(text, str(path))
    model = data.get("model", {})
    described = model.get("preset") or model.get("hf") or model.get("factory") or "?"
    mesh = " ".join(f"{axis}={size}" for axis, size in data.get("mesh", {}).items())
    return RecipeEntry(name, path, str(described), mesh or "one device", _summary(text))


def _summary(text: str) -> str:
    """The recipe's first comment line, cut to :data:`SUMMARY_WIDTH` characters at a word."""
    first = next((line[1:].strip() for line in text.splitlines() if line.startswith("#")), "")
    if len(first) <= SUMMARY_WIDTH:
        return first
    return first[: first.rfind(" ", 0, SUMMARY_WIDTH - 1)].rstrip(",;:") + " …"


def recipe_table(entries: list[RecipeEntry]) -> str:
    """One line per recipe, columns aligned: name, model, mesh, summary."""
    rows = [("NAME", "MODEL", "MESH", "SUMMARY")]
    rows += [(e.name, e.model, e.mesh, e.summary) for e in entries]
    widths = [max(len(row[column]) for row in rows) for column in range(3)]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[3]
        for row in rows
    ]
    return "\n".join(line.rstrip() for line in lines)


def recipe_markdown(entries: list[RecipeEntry]) -> str:
    """The same list as a Markdown table (docs/recipes.md holds it; a test keeps it current)."""
    lines = ["| recipe | model | mesh | what it is |", "|---|---|---|---|"]
    lines += [f"| `{e.name}` | {e.model} | {e.mesh} | {e.summary} |" for e in entries]
    return "\n".join(lines)


def copy_recipe(name: str, destination: str | Path) -> tuple[Path, Path]:
    """Copy the recipe ``name`` finds to ``destination`` (a file, or a directory to put
    ``<name>.toml`` in); never over an existing file or through a link. Returns (from, to)."""
    source = find_recipe(name)
    target = Path(destination)
    if target.is_dir() and not target.is_symlink():
        target = target / f"{source.stem}.toml"
    refuse_link(target)
    if not target.parent.is_dir():
        raise RecipeError(
            f"recipe cp {name} {destination}: the directory {str(target.parent)!r} does not "
            "exist. Create it first, or give another destination."
        )
    try:
        descriptor = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    except FileExistsError:
        raise RecipeError(
            f"recipe cp {name} {destination}: {str(target)!r} exists; meshtrain does not "
            "overwrite it. Remove it, or give another destination."
        ) from None
    except OSError as err:  # a read-only or unwritable directory, a full disk
        raise RecipeError(
            f"recipe cp {name} {destination}: cannot write {str(target)!r} "
            f"({describe_os_error(err)}). Give a directory you can write."
        ) from None
    with os.fdopen(descriptor, "w", encoding="utf-8") as out:
        out.write(source.read_text(encoding="utf-8"))
    return source, target
