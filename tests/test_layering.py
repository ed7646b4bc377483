"""The layering of ``meshtrain/`` as docs/architecture.md draws it, checked on the source: every
import (at module level or inside a function) points down the layers, no module takes part in
an import cycle, and the calls that touch ``torch.distributed``'s runtime stay in their layer."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "meshtrain"

#: layer → the layers it may import (itself included). Read bottom up.
ALLOWED: dict[str, set[str]] = {
    "errors": {"errors"},
    "moved": {"moved"},  # old module paths, importable from every layer
    "tables": {"tables"},  # dotted keys and TOML values
    "files": {"errors", "files"},  # whole files, never through a link
    "spec": {"errors", "spec"},
    "models": {"errors", "spec", "models"},
    "adapters": {"errors", "spec", "adapters"},
    "plan": {"errors", "spec", "adapters", "plan"},
    "launch": {"errors", "files", "launch"},
    "lower": {"errors", "spec", "adapters", "plan", "launch", "lower"},
    "train": {"errors", "files", "spec", "adapters", "plan", "launch", "lower", "train"},
    "recipes": {
        "errors",
        "files",
        "spec",
        "models",
        "adapters",
        "plan",
        "launch",
        "lower",
        "train",
        "recipes",
    },
    "testing": {
        "errors",
        "files",
        "spec",
        "models",
        "adapters",
        "plan",
        "launch",
        "lower",
        "train",
        "recipes",
        "testing",
    },
    "cli": {
        "errors",
        "files",
        "spec",
        "adapters",
        "plan",
        "launch",
        "lower",
        "train",
        "recipes",
        "testing",
        "cli",
    },
    "__main__": {"cli"},
    "": {"errors", "spec", "adapters", "plan", "launch", "lower", "train", "testing"},  # facade
}

for _allowed in ALLOWED.values():
    _allowed |= {"moved", "tables"}  # they import nothing of meshtrain's

#: torch.distributed runtime calls → the modules that may make them
RUNTIME_CALLS = {
    "init_process_group": {"meshtrain.launch"},
    "init_device_mesh": {"meshtrain.lower.groups", "meshtrain.lower.reference"},
    "fully_shard": {"meshtrain.lower.data.parallel", "meshtrain.lower.reference"},
    "replicate": {"meshtrain.lower.data.parallel"},
    "parallelize_module": {"meshtrain.lower.tensor.parallel"},
    "PipelineStage": {"meshtrain.lower.pipeline"},
    "redistribute": {"meshtrain.lower.functional", "meshtrain.lower.tensor.parallel"},
    "local_map": {"meshtrain.lower.functional"},
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, ast.Module]:
    return {_module_name(path): ast.parse(path.read_text()) for path in PACKAGE.rglob("*.py")}


def _imports(tree: ast.Module) -> Iterator[str]:
    """Every meshtrain module a source file imports, wherever the import statement is."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] == "meshtrain":
                yield node.module
        elif isinstance(node, ast.Import):
            yield from (a.name for a in node.names if a.name.split(".")[0] == "meshtrain")
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", "") == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and str(node.args[0].value).startswith("meshtrain")
        ):
            yield str(node.args[0].value)


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


GRAPH = {name: set(_imports(tree)) for name, tree in _modules().items()}


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_imports_point_down_the_layers(module: str) -> None:
    layer = _layer(module)
    assert layer in ALLOWED, f"{module} is in no layer: add its package to docs/architecture.md"
    wrong = sorted(target for target in GRAPH[module] if _layer(target) not in ALLOWED[layer])
    assert not wrong, f"{module} ({layer or 'facade'}) imports {wrong}, above or beside its layer"


def test_no_import_cycles() -> None:
    """Tarjan's strongly connected components over the module graph: each must be one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(GRAPH.get(node, ())):
            if target not in GRAPH:
                continue
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(GRAPH):
        if node not in index:
            visit(node)
    assert not cycles, f"import cycles: {cycles}"


def test_the_graph_sees_imports_inside_functions() -> None:
    """The checks above are only as good as the graph: a lazy import counts as an arrow."""
    tree = ast.parse("def f():\n    from meshtrain.lower import apply\n")
    assert list(_imports(tree)) == ["meshtrain.lower"]


@pytest.mark.parametrize("call", sorted(RUNTIME_CALLS))
def test_runtime_calls_stay_in_their_layer(call: str) -> None:
    makers = set()
    for name, tree in _modules().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                func = node.func
                called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
                if called == call:
                    makers.add(name)
    assert makers <= RUNTIME_CALLS[call], (
        f"{call} is called in {sorted(makers - RUNTIME_CALLS[call])}"
    )


@pytest.mark.parametrize(
    "old, new",
    [
        ("meshtrain.train.hf_load", "meshtrain.train.hf.load"),
        ("meshtrain.train.checkpoint_files", "meshtrain.train.checkpoint.files"),
        ("meshtrain.plan.abstract", "meshtrain.plan.proof.run"),
        ("meshtrain.plan.tp_cost", "meshtrain.plan.tensor.cost"),
        ("meshtrain.lower.tensor_parallel", "meshtrain.lower.tensor.parallel"),
        ("meshtrain.train.checkpoint.lock", "meshtrain.files.lock"),
    ],
)
def test_moved_modules_still_import_with_a_warning(old: str, new: str) -> None:
    import importlib
    import sys

    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=f"moved to {new}"):
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)


def test_a_module_that_became_a_package_still_hands_out_its_names() -> None:
    from meshtrain.plan.pipeline import schedule

    with pytest.warns(DeprecationWarning, match="moved to meshtrain.plan.pipeline.schedule"):
        from meshtrain.plan.pipeline import SCHEDULES
    assert SCHEDULES is schedule.SCHEDULES
    with pytest.raises(ImportError):
        from meshtrain.plan.pipeline import no_such_name  # noqa: F401


@pytest.mark.parametrize("package", ["plan", "lower"])
def test_the_compiler_keeps_its_core_at_the_top_and_each_technique_in_a_sub_package(
    package: str,
) -> None:
    """At most 12 modules at the top of plan/ and lower/; a technique's modules live in its
    sub-package (plan/experts/, plan/proof/, ...), whose names no top module repeats."""
    top = sorted(p.stem for p in (PACKAGE / package).glob("*.py"))
    subs = sorted(p.name for p in (PACKAGE / package).iterdir() if (p / "__init__.py").exists())
    assert len(top) <= 12, top
    assert not [m for m in top for s in subs if m.startswith(s.rstrip("s"))], (top, subs)


def test_public_train_sub_packages_keep_their_names() -> None:
    from meshtrain.train.checkpoint import CheckpointConfig, find_resume_point
    from meshtrain.train.data import DistributedBatches, prepare_corpus
    from meshtrain.train.metrics import LoggingConfig, WandbSink, make_sinks

    assert CheckpointConfig.__module__ == "meshtrain.train.checkpoint.dcp"
    assert DistributedBatches.__module__ == "meshtrain.train.data.loader"
    assert WandbSink.__module__ == "meshtrain.train.metrics.wandb_sink"
    assert callable(find_resume_point) and callable(prepare_corpus) and callable(make_sinks)
    assert LoggingConfig.__module__ == "meshtrain.train.metrics.config"


def test_lowering_reads_the_plans_decisions_and_never_decides_again() -> None:
    """What a setting decides is computed once while planning and carried on the plan
    (``FSDPUnit.decisions``, ``PlanOptions.decisions``, ``Plan.pair_inputs_shared``): no
    lowering module calls the functions that decide."""
    deciders = {"fsdp_decisions", "pair_inputs_shared"}
    calls = [
        f"{path.relative_to(PACKAGE.parent)}:{node.lineno}"
        for path in sorted((PACKAGE / "lower").rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) in deciders
    ]
    assert calls == []


def test_the_proof_keeps_each_concern_in_a_class_one_can_read_at_once() -> None:
    """The plan-time proof is split by concern (tracking, checking, modules, effects, the
    dispatch mode): no class of plan/proof/ over 150 lines."""
    long = [
        f"{path.name}:{node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for path in sorted((PACKAGE / "plan" / "proof").glob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > 150
    ]
    assert long == []


def test_the_command_line_parses_and_dispatches_in_at_most_350_lines() -> None:
    """The rank lifecycle lives in recipes/job.py, the commands in recipes/commands.py."""
    assert len((PACKAGE / "cli.py").read_text().splitlines()) <= 350


def test_the_formatter_formats_the_code() -> None:
    """At most 60 lines the formatter is told to leave alone in the repository (tables are laid
    out as data it leaves as they are)."""
    skipped = [
        f"{path.relative_to(PACKAGE.parent)}:{number}"
        for folder in ("meshtrain", "tests", "benchmarks", "examples")
        for path in sorted((PACKAGE.parent / folder).rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if "fmt: skip" in line or "fmt: off" in line
    ]
    assert len(skipped) <= 60, skipped
