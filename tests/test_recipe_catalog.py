"""The recipes ship with the package: ``meshtrain recipe list`` and ``recipe cp`` in a clone, and
the built wheel's own files, run from a directory with no clone in reach."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from meshtrain.cli import main
from meshtrain.recipes.catalog import recipe_entries, recipe_markdown

ROOT = Path(__file__).resolve().parents[1]
PIP_WHEEL = (sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation")
SHIPPED = sorted(path.stem for path in (ROOT / "recipes").glob("*.toml"))


def test_the_list_names_every_recipe_with_its_model_and_mesh(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)  # no recipes/ here: the clone's own
    assert main(["recipe", "list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["NAME", "MODEL", "MESH", "SUMMARY"]
    assert [line.split()[0] for line in lines[1:]] == SHIPPED
    debug = next(line for line in lines if line.startswith("debug "))
    assert debug.split()[1:3] == ["debug", "dp=-1"] and "tp=2" in debug
    assert all(len(line) <= 130 for line in lines)


def test_a_recipe_in_the_working_directory_hides_the_shipped_one(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes" / "debug.toml").write_text('# mine\n[model]\npreset = "debug"\n')
    monkeypatch.chdir(tmp_path)
    debug = next(entry for entry in recipe_entries() if entry.name == "debug")
    assert (debug.path, debug.summary, debug.mesh) == (
        tmp_path / "recipes" / "debug.toml",
        "mine",
        "one device",
    )


def test_cp_copies_once_and_never_overwrites_or_follows_a_link(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["recipe", "cp", "debug", str(tmp_path)]) == 0
    copied = tmp_path / "debug.toml"
    assert copied.read_text() == (ROOT / "recipes" / "debug.toml").read_text()
    assert f"wrote {copied}" in capsys.readouterr().out
    copied.write_text("# edited\n")
    assert main(["recipe", "cp", "debug", str(copied)]) == 2
    assert "exists; meshtrain does not overwrite it" in capsys.readouterr().err
    assert copied.read_text() == "# edited\n"
    elsewhere = tmp_path / "elsewhere.toml"
    elsewhere.write_text("keep\n")
    (tmp_path / "link.toml").symlink_to(elsewhere)
    assert main(["recipe", "cp", "debug", str(tmp_path / "link.toml")]) == 2
    assert elsewhere.read_text() == "keep\n"
    assert main(["recipe", "cp", "no_such_recipe", str(tmp_path / "x.toml")]) == 2
    assert "no recipe named 'no_such_recipe'" in capsys.readouterr().err
    assert main(["recipe", "cp", "debug", str(tmp_path / "missing" / "x.toml")]) == 2
    capsys.readouterr()
    assert main(["recipe", "cp", "debug", "/proc/debug.toml"]) == 2  # unwritable even for root
    err = capsys.readouterr().err
    assert err.startswith("RecipeError: recipe cp debug /proc/debug.toml: cannot write")
    assert "Traceback" not in err


@pytest.fixture(scope="module")
def wheel_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel built from this tree, unpacked as a site-packages directory would hold it."""
    pytest.importorskip("hatchling")
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [*PIP_WHEEL, "-w", str(out), str(ROOT)],
        check=True,
        capture_output=True,
    )
    (wheel,) = out.glob("meshtrain-*.whl")
    site = out / "site"
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(site)
    return site


def _from_wheel(site: Path, cwd: Path, *args: str, timeout: float = 60) -> str:
    env = {**os.environ, "PYTHONPATH": str(site), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "meshtrain", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return done.stdout


def test_the_wheel_ships_every_recipe_and_finds_them_without_a_clone(
    wheel_site: Path, tmp_path: Path
) -> None:
    shipped = sorted(path.stem for path in (wheel_site / "meshtrain" / "_recipes").glob("*.toml"))
    assert shipped == SHIPPED
    listed = _from_wheel(wheel_site, tmp_path, "recipe", "list").splitlines()
    assert [line.split()[0] for line in listed[1:]] == SHIPPED
    _from_wheel(wheel_site, tmp_path, "recipe", "cp", "llama3_8b", "mine.toml")
    assert (tmp_path / "mine.toml").read_text() == (ROOT / "recipes/llama3_8b.toml").read_text()
    plan = _from_wheel(wheel_site, tmp_path, "plan", "llama3_8b", "--world", "16")
    assert "per rank" in plan.lower()


@pytest.mark.extended  # a real launch of 4 ranks: ~60 s on 2 cores
def test_the_wheel_trains_the_debug_recipe_on_four_ranks_without_a_clone(
    wheel_site: Path, tmp_path: Path
) -> None:
    out = _from_wheel(
        wheel_site,
        tmp_path,
        "train",
        "debug",
        "--nproc",
        "4",
        "--set",
        "train.steps=3",
        "--set",
        "logging.wandb=disabled",
        timeout=300,
    )
    assert "step 3/3" in out
    assert (tmp_path / "runs" / "debug" / "checkpoints").is_dir()


def test_the_docs_list_every_shipped_recipe_as_recipe_list_prints_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """docs/recipes.md's table is generated from recipes/ (it used to omit 5 of 12); regenerate
    it with ``python -c "from meshtrain.recipes.catalog import *;
    print(recipe_markdown(recipe_entries()))"`` from a directory without recipes/."""
    monkeypatch.chdir(tmp_path)
    text = (ROOT / "docs" / "recipes.md").read_text()
    block = text.split("<!-- recipe-list:begin -->\n")[1].split("\n<!-- recipe-list:end -->")[0]
    assert block == recipe_markdown(recipe_entries())
