"""Reading a recipe: finding the file, parsing its TOML and applying ``--set`` overrides.

This module imports no torch, so the launcher reads a recipe and refuses an impossible launch
(:mod:`meshtrain.recipes.preflight`) in a fraction of a second; validation against the schema
(:mod:`meshtrain.recipes.schema`) comes after.

Example:
    >>> data, source = parse_recipe('[mesh]\\ndp = -1\\n', "r.toml", ["mesh.tp=2"])
    >>> data, source
    ({'mesh': {'dp': -1, 'tp': 2}}, 'r.toml (with --set mesh.tp=2)')
"""

from __future__ import annotations

import copy
import dataclasses
import stat
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from meshtrain.errors import RecipeError, describe_os_error, did_you_mean
from meshtrain.recipes.sections import SECTION_NAMES, SECTION_TYPES

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

__all__ = [
    "SECTION_NAMES",
    "apply_overrides",
    "find_recipe",
    "named_directories",
    "parse_recipe",
    "read_recipe",
    "recipe_name",
    "recipe_roots",
    "run_directories",
]


def find_recipe(path_or_name: str | Path) -> Path:
    """A path as given, or ``<name>.toml`` in the first of :func:`recipe_roots` holding one."""
    path = Path(path_or_name)
    if path.suffix == ".toml" or len(path.parts) > 1 or path.is_file():
        if path.is_dir():
            raise RecipeError(_directory_message(path))
        if path.exists() and not path.is_file():
            raise RecipeError(
                f"recipe {str(path)!r} is {_kind(path)}, not a regular file: meshtrain reads "
                "recipes from .toml files (save it to one first)."
            )
        if not path.is_file():
            raise RecipeError(f"recipe file {str(path)!r} does not exist.")
        return path
    roots = recipe_roots()
    for root in roots:
        if (root / f"{path}.toml").is_file():
            return root / f"{path}.toml"
    known = sorted({p.stem for root in roots if root.is_dir() for p in root.glob("*.toml")})
    if path.is_dir() and str(path) not in known:
        raise RecipeError(_directory_message(path))
    raise RecipeError(
        f"no recipe named {str(path)!r} in {' or '.join(str(root) for root in roots)}"
        f"{did_you_mean(str(path), known, 'recipes')}. Give a path to a .toml file or a known name."
    )


def run_directories(data: Mapping[str, Any], source: str) -> tuple[Path, Path]:
    """The run directory and checkpoint directory of a recipe's data: ``logging.run_dir``
    (default ``runs/<recipe name>``) and ``checkpoint.dir`` (default ``<run_dir>/checkpoints``);
    no torch, so the launcher can lock them first.

    Example:
        >>> run_directories({"checkpoint": {"dir": "/ckpt"}}, "recipes/debug.toml (--set x=1)")
        (PosixPath('runs/debug'), PosixPath('/ckpt'))
    """
    logging, checkpoint = data.get("logging", {}), data.get("checkpoint", {})
    return named_directories(logging.get("run_dir"), checkpoint.get("dir"), recipe_name(source))


def named_directories(
    run_dir: str | None, checkpoint_dir: str | None, name: str
) -> tuple[Path, Path]:
    """``run_dir`` (default ``runs/<name>``) and ``checkpoint_dir`` (default
    ``<run_dir>/checkpoints``) as paths: the one rule :func:`run_directories` and
    :class:`~meshtrain.recipes.recipe.Recipe` share."""
    run = Path(run_dir or f"runs/{name}")
    return run, Path(checkpoint_dir) if checkpoint_dir else run / "checkpoints"


def recipe_name(source: str) -> str:
    """A recipe's name: its file's stem, from the source as messages name it."""
    return Path(source.split(" (")[0]).stem


def recipe_roots() -> list[Path]:
    """Where recipe names are looked up, in order: ``recipes/`` under the current directory,
    the recipes the installed package ships (``meshtrain/_recipes``, put there by the wheel),
    then ``recipes/`` of the source tree meshtrain runs from."""
    package = Path(__file__).resolve().parents[1]
    roots = [Path.cwd() / "recipes", package / "_recipes", package.parent / "recipes"]
    unique = {root.resolve(): root for root in roots}
    return list(unique.values())


def _kind(path: Path) -> str:
    """What a path that is not a regular file or a directory is, in words."""
    mode = path.stat().st_mode
    kinds = [(stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISSOCK, "a socket")]
    kinds += [(stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")]
    return next((name for test, name in kinds if test(mode)), "not a regular file")


def _directory_message(path: Path) -> str:
    inside = sorted(entry.name for entry in path.glob("*.toml"))
    hint = f" (it holds {', '.join(inside)})" if inside else ""
    return (
        f"recipe {str(path)!r} is a directory, not a recipe file{hint}: give the path of a .toml "
        "file, or a recipe name."
    )


def read_recipe(path_or_name: str | Path) -> tuple[str, str]:
    """The text of a recipe and the path that names it in messages."""
    path = find_recipe(path_or_name)
    try:
        return path.read_text(), str(path)
    except OSError as err:
        raise RecipeError(f"cannot read recipe {str(path)!r}: {describe_os_error(err)}.") from None
    except UnicodeDecodeError as err:
        raise RecipeError(
            f"recipe {str(path)!r} is not UTF-8 text (byte 0x{err.object[err.start]:02x} at "
            f"offset {err.start:,}). Save it as UTF-8."
        ) from None


def parse_recipe(
    text: str, source: str = "<string>", overrides: Sequence[str] = ()
) -> tuple[dict[str, Any], str]:
    """The recipe's TOML as a dict with ``overrides`` applied, and its source as messages name
    it (the overrides included)."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise RecipeError(f"{source}: not valid TOML ({err}). Fix the syntax.") from None
    if overrides:
        data = apply_overrides(data, overrides, source)
        source = f"{source} (with --set {' '.join(overrides)})"
    return data, source


def apply_overrides(
    data: dict[str, Any], overrides: Sequence[str], source: str = "<string>"
) -> dict[str, Any]:
    """``data`` with each ``section.key=value`` set. The value is read as a TOML value
    (``3``, ``1e-4``, ``true``, ``["dp"]``, ``"text"``); anything that is not one, and anything
    given to a key its section's dataclass types ``str``, is taken as a bare string
    (``data.source=synthetic``, ``logging.wandb_entity=1234``). The section is the longest known section name the
    path starts with (``parallel.pipeline.schedule=GPipe``; the sections are
    :data:`~meshtrain.recipes.sections.SECTION_NAMES`, derived from the sections' dataclasses);
    keys are checked afterwards with the rest of the recipe, so an unknown key is the usual
    RecipeError.

    Example:
        >>> apply_overrides({"train": {"lr": 1.0}}, ["train.lr=3e-4", "mesh.tp=4"])
        {'train': {'lr': 0.0003}, 'mesh': {'tp': 4}}
        >>> apply_overrides({}, ["data.path=2024", "data.samples=16"])
        {'data': {'path': '2024', 'samples': 16}}
    """
    result = copy.deepcopy(data)
    for override in overrides:
        path, sep, text = override.partition("=")
        section = max(
            (name for name in SECTION_NAMES if path.startswith(name + ".")), key=len, default=""
        )
        key = path[len(section) + 1 :] if section else ""
        if not sep or not section or not key:
            named = path.partition(".")[0]
            raise RecipeError(
                f"{source}: --set {override!r} is not section.key=value with a known section"
                f"{did_you_mean(named, SECTION_NAMES, 'sections')}. Write e.g. --set "
                "train.steps=100."
            )
        value = _override_value(section, key, text)
        table = result
        for part in section.split("."):
            table = table.setdefault(part, {})
            if not isinstance(table, dict):
                raise RecipeError(f"{source}: --set {override!r}: [{section}] is not a table.")
        table[key] = value
    return result


def _override_value(section: str, key: str, text: str) -> Any:
    """``--set``'s value: TOML, else the bare text; a ``str`` key keeps the text as given."""
    try:
        value = tomllib.loads(f"value = {text}")["value"]
    except tomllib.TOMLDecodeError:
        return text
    section_type = SECTION_TYPES[section]
    if isinstance(value, str) or not dataclasses.is_dataclass(section_type):
        return value
    types = {
        field.metadata.get("toml") or field.name: field.type
        for field in dataclasses.fields(section_type)
    }
    return text if types.get(key) in ("str", str) else value
