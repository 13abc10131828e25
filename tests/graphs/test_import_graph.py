"""No import cycles among fsdp_graph's modules, deferred imports included (the project's rule: layers import
downward; a cycle hidden by importing inside a function is still a cycle). Imports under `if TYPE_CHECKING:` are
annotations only and do not count. Imports of a package (its `__init__`, which re-exports) do not count either."""

from __future__ import annotations

import ast
from pathlib import Path

import networkx  # torch's own dependency

PACKAGE = Path(__file__).resolve().parents[2] / "fsdp_graph"


def _modules(package: Path) -> dict[str, Path]:
    modules = {}
    for path in package.rglob("*.py"):
        parts = path.relative_to(package.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    inside = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            inside.update(id(n) for statement in node.body for n in ast.walk(statement))
    return inside


def _targets(module: str, is_package: bool, node: ast.Import | ast.ImportFrom) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        parts = module.split(".") if is_package else module.split(".")[:-1]
        parts = parts[: len(parts) - node.level + 1]
        base = ".".join([*parts, base] if base else parts)
    return [f"{base}.{alias.name}" for alias in node.names] + [base]


def import_graph(package: Path) -> dict[str, set[str]]:
    """Module -> the package's non-package modules it imports anywhere in its code, outside TYPE_CHECKING."""
    modules = _modules(package)
    packages = {name for name, path in modules.items() if path.name == "__init__.py"}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        skipped = _type_checking_nodes(tree)
        edges = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in skipped:
                for target in _targets(name, name in packages, node):
                    while target and target not in modules:
                        target = target.rpartition(".")[0]
                    if target and target != name and target not in packages:
                        edges.add(target)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module, each sorted."""
    digraph = networkx.DiGraph([(a, b) for a, targets in graph.items() for b in targets])
    return sorted(sorted(c) for c in networkx.strongly_connected_components(digraph) if len(c) > 1)


def test_fsdp_graph_has_no_import_cycles():
    graph = import_graph(PACKAGE)
    assert len(graph) > 90 and graph["fsdp_graph.runtime.unit"], "the package was not read"
    found = cycles(graph)
    described = [" <-> ".join(c) + ": " + "; ".join(f"{a} -> {b}" for a in c for b in graph[a] & set(c)) for c in found]
    assert not found, "import cycles:\n" + "\n".join(described)


def test_the_check_finds_a_deferred_cycle_and_lets_type_checking_imports_through(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("from pkg import low\n")
    (package / "sub" / "__init__.py").write_text("")
    (package / "low.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.sub.high import High\n"
    )
    (package / "sub" / "high.py").write_text("from ..low import *\nfrom pkg import sub\n")
    assert cycles(import_graph(package)) == []  # the TYPE_CHECKING import and the package import do not count
    (package / "low.py").write_text("def f():\n    from pkg.sub import high\n")
    assert cycles(import_graph(package)) == [["pkg.low", "pkg.sub.high"]]
