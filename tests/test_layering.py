"""Dependencies point one way: elastic_ring <- state <- ray_integration."""

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
FORBIDDEN = {
    "elastic_ring": {"ray", "state", "ray_integration"},
    "state": {"ray", "ray_integration"},
}


def imported_roots(package: str) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for path in (ROOT / package).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                found.setdefault(name.split(".")[0], set()).add(path.name)
    return found


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_upward_imports(package):
    found = imported_roots(package)
    bad = {root: sorted(files) for root, files in found.items() if root in FORBIDDEN[package]}
    assert not bad, f"{package} must not import {bad}"


def test_importing_elastic_ring_does_not_load_ray():
    code = "import sys, elastic_ring; assert 'ray' not in sys.modules, 'ray was imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


PACKAGES = ("elastic_ring", "state", "ray_integration")


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _under_type_checking(tree: ast.AST) -> set[int]:
    """Line numbers of imports inside ``if TYPE_CHECKING:`` (annotations only: no dependency at run time)."""
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            lines |= {n.lineno for body in node.body for n in ast.walk(body) if isinstance(n, (ast.Import, ast.ImportFrom))}
    return lines


def import_graph() -> dict[str, set[str]]:
    """Module -> project modules it imports anywhere in its text (top level or inside functions)."""
    paths = {_module_name(p): p for package in PACKAGES for p in (ROOT / package).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for module, path in paths.items():
        tree = ast.parse(path.read_text(), str(path))
        skip = _under_type_checking(tree)
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(tree):
            if getattr(node, "lineno", None) in skip:
                continue
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                targets.add(base)
                targets |= {f"{base}.{a.name}" for a in node.names}
        # a module's own parent packages are always imported before it: not an edge of a cycle
        ancestors = {".".join(module.split(".")[:i]) for i in range(1, len(module.split(".")))}
        graph[module] = {t for t in targets if t in paths and t != module and t not in ancestors}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (as a path that ends where it starts), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_cycle_finder_table():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"b2"}, "b2": {"b"}}) == ["b", "b2", "b"]


def test_no_import_cycles_even_through_imports_inside_functions():
    graph = import_graph()
    assert {"elastic_ring.runtime", "state.state", "ray_integration.driver"} <= set(graph)
    assert "elastic_ring.signature" in graph["elastic_ring.collectives"]  # the graph sees imports,
    assert "elastic_ring.gloo_communicator" in graph["elastic_ring.runtime"]  # those inside functions too
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)
