"""No import circles anywhere in the tree: over every module of the project's packages, the graph of imports
that can run (module level and function-local alike; only `if TYPE_CHECKING:` blocks, which never run, are
left out) is acyclic. tests/engines/test_engine_imports.py is the stricter check inside engines/."""

from __future__ import annotations

import ast
from pathlib import Path

from import_graph import find_cycle, module_name  # conftest puts tests/ on the path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engines", "gateway", "kernels", "router_model", "traces", "training", "deploy", "bench")


def _type_checking_only(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(tree: ast.AST):
    """Every Import / ImportFrom in `tree` outside `if TYPE_CHECKING:` bodies (their `else:` still runs)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        if _type_checking_only(node):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def imports_of(path: Path, name: str, modules: set[str]) -> set[str]:
    """The project modules `path` (module `name`) imports; `from pkg import x` is pkg.x when that is a module,
    else pkg (its __init__); relative imports are resolved."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in _import_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        for target in names:
            while target and target not in modules:  # `import a.b.c` of a module a.b: a.b
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def import_graph() -> dict[str, set[str]]:
    files = {module_name(f): f for pkg in PACKAGES for f in sorted((ROOT / pkg).rglob("*.py"))}
    return {name: imports_of(path, name, set(files)) for name, path in files.items()}


def test_the_graph_sees_the_imports_it_must():
    graph = import_graph()
    assert {"engines.engine", "gateway.app", "kernels.cpu_kernels", "router_model.features",
            "bench.results_meta"} <= set(graph)
    assert "kernels.quant_formats" in graph["kernels.cpu_kernels"]  # a module-level import
    assert "gateway.invalid_parameter" in graph["gateway.structured_outputs"]
    assert "gateway.structured_outputs" in graph["gateway.protocol"]
    # a TYPE_CHECKING-only import is no edge; a function-local one is
    assert "gateway.protocol" not in graph["gateway.structured_outputs"]
    assert "bench.results_meta" in graph["bench.compare_strategies"]


def test_find_cycle_finds_a_planted_circle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_relative_and_package_imports_resolve(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from pkg.a import x\n")
    (pkg / "a.py").write_text("from . import b\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.c\n")
    (pkg / "b.py").write_text("def f():\n    from pkg import a\n")
    modules = {"pkg", "pkg.a", "pkg.b", "pkg.c"}
    assert imports_of(pkg / "a.py", "pkg.a", modules) == {"pkg", "pkg.b"}
    assert imports_of(pkg / "b.py", "pkg.b", modules) == {"pkg", "pkg.a"}
    assert imports_of(pkg / "__init__.py", "pkg", modules) == {"pkg.a"}


def test_no_import_circle_in_the_tree():
    assert find_cycle(import_graph()) is None
