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
