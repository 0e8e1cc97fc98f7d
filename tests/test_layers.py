"""The import graph: every file imports only its own layer or lower ones, and no cycles.

The layers, lowest first, are the subpackages of ``meshkit`` (docs/contributing.md
lists them). Imports inside functions and under ``if TYPE_CHECKING:`` count too: a lazy
import is still a dependency.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "meshkit"

#: Lowest first. A file may import from its own package or any package listed before it.
LAYERS: tuple[tuple[str, ...], ...] = (
    # foundation: plain Python, no meshkit imports
    ("choices", "errors", "units", "_fs", "_yamlfile", "_version"),
    ("strategy", "hlo"),  # ``meshkit.hlo``: a deprecated shim of ``meshkit.strategy.hlo``
    ("runtime", "distributed"),  # ``meshkit.distributed`` re-exports the runtime's
    ("data",),
    ("exchange", "cost"),  # ``meshkit.cost``: a deprecated shim of the exchange's
    ("config",),
    ("sharding",),
    ("model",),
    ("plan",),
    ("training",),
    ("plot",),
    ("cli",),
    ("benchmarks",),  # ``meshkit bench NAME`` runs them; they may use anything, cli included
)
RANK = {name: rank for rank, names in enumerate(LAYERS) for name in names}


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


FILES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _type_only(tree: ast.Module) -> set[int]:
    """Ids of the import nodes under ``if TYPE_CHECKING:``."""
    return {id(node)
            for block in ast.walk(tree)
            if isinstance(block, ast.If) and ast.unparse(block.test).endswith("TYPE_CHECKING")
            for statement in block.body
            for node in ast.walk(statement)}


def _imports(path: pathlib.Path, *, type_only: bool = True) -> set[str]:
    """The meshkit modules ``path`` imports, as the most specific existing module name.

    ``type_only=False`` leaves out imports under ``if TYPE_CHECKING:``: they never run.
    """
    found: set[str] = set()
    tree = ast.parse(path.read_text())
    skip = set() if type_only else _type_only(tree)
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            while name not in FILES and "." in name:
                name = name.rsplit(".", 1)[0]
            if name.startswith("meshkit.") or name == "meshkit":
                found.add(name)
    return found


GRAPH = {name: _imports(path) - {name} for name, path in FILES.items()}
RUNTIME_GRAPH = {name: _imports(path, type_only=False) - {name} for name, path in FILES.items()}


def _layer(module: str) -> int | None:
    parts = module.split(".")
    return RANK.get(parts[1]) if len(parts) > 1 else None  # ``meshkit`` itself: the facade


def test_every_file_belongs_to_a_layer():
    assert [m for m in FILES if m != "meshkit" and _layer(m) is None] == []


@pytest.mark.parametrize("module", sorted(m for m in FILES if m != "meshkit"))
def test_no_file_imports_a_higher_layer(module):
    rank = _layer(module)
    assert rank is not None
    upward = sorted(
        f"{target} (layer {LAYERS[_layer(target) or 0][0]})"
        for target in GRAPH[module]
        if target == "meshkit" or (_layer(target) or 0) > rank
    )
    assert upward == [], f"{module} (layer {LAYERS[rank][0]}) imports upward: {upward}"


def test_no_import_cycles():
    """Depth-first search over files' imports that run; a back edge is a cycle."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    cycles: list[list[str]] = []

    def visit(module: str, stack: list[str]) -> None:
        state[module] = 1
        for target in sorted(RUNTIME_GRAPH.get(module, ())):
            if state.get(target) == 1:
                cycles.append([*stack[stack.index(target):], target])
            elif target not in state:
                visit(target, [*stack, target])
        state[module] = 2

    for module in sorted(RUNTIME_GRAPH):
        if module not in state:
            visit(module, [module])
    assert cycles == []


def test_the_checker_reads_every_kind_of_import(tmp_path):
    path = tmp_path / "planted.py"
    path.write_text(
        "from typing import TYPE_CHECKING\n"
        "import meshkit.model.moe\n"
        "def f():\n    from meshkit.training.loop import train\n"
        "if TYPE_CHECKING:\n    from meshkit.exchange import cost\n"
    )
    assert _imports(path) == {"meshkit.model.moe", "meshkit.training.loop", "meshkit.exchange.cost"}
    assert _imports(path, type_only=False) == {"meshkit.model.moe", "meshkit.training.loop"}
    assert (_layer("meshkit.training.loop") or 0) > (_layer("meshkit.exchange.dedup") or 0)


def test_the_planner_does_not_import_the_trainer():
    assert not any(t.startswith("meshkit.training") for t in GRAPH["meshkit.plan.planner"])
