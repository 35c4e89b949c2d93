"""No import circles inside engines/: the graph of `import engines.X` edges (runtime, function-local and
TYPE_CHECKING imports alike) over engines/*.py and engines/spec/*.py is acyclic."""

from __future__ import annotations

import ast
from pathlib import Path

from import_graph import find_cycle, module_name  # conftest puts tests/ on the path

ROOT = Path(__file__).resolve().parents[2]


def engine_imports(path: Path, modules: set[str]) -> set[str]:
    """The engines modules `path` imports anywhere in its body (a package import counts as its __init__)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        out |= {n for n in names if n in modules}
    return out


def import_graph() -> dict[str, set[str]]:
    files = sorted((ROOT / "engines").glob("*.py")) + sorted((ROOT / "engines" / "spec").glob("*.py"))
    modules = {module_name(f) for f in files}
    return {module_name(f): engine_imports(f, modules) - {module_name(f)} for f in files}


def test_the_import_graph_of_engines_has_no_cycle():
    graph = import_graph()
    assert "engines.spec.decoder" in graph and "engines.scheduler" in graph["engines.spec.drafter"]
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle)


def test_the_cycle_finder_finds_a_planted_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def project_imports(path: Path) -> set[str]:
    """The top-level project packages (engines, gateway, ...) `path` imports anywhere in its body."""
    packages = {p.name for p in ROOT.iterdir() if (p / "__init__.py").exists()}
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module.split(".")[0])
    return out & packages


def test_kernels_imports_nothing_of_the_project_but_itself():
    files = sorted((ROOT / "kernels").glob("*.py"))
    assert files and "engines" in project_imports(ROOT / "engines" / "runner.py")  # the check sees imports
    assert {f.name: project_imports(f) - {"kernels"} for f in files} == {f.name: set() for f in files}
