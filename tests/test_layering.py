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


def import_graph() -> dict[str, set[str]]:
    """Module -> project modules it imports anywhere in its text (top level, inside functions, or under
    ``if TYPE_CHECKING:``: an annotation that needs the other module is a dependency too)."""
    paths = {_module_name(p): p for package in PACKAGES for p in (ROOT / package).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for module, path in paths.items():
        tree = ast.parse(path.read_text(), str(path))
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(tree):
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
    assert {"elastic_ring.ring.runtime", "state.state", "ray_integration.driver.loop"} <= set(graph)
    assert "elastic_ring.reduction.signature" in graph["elastic_ring.collectives.tensors"]  # the graph sees imports,
    assert "elastic_ring.backends.gloo" in graph["elastic_ring.ring.runtime"]  # those inside functions too
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


# ------------------------------------------------------------------ elastic_ring's layers (issue 24)
#: elastic_ring's sub-packages, lowest first. A module imports from its own layer and the layers below it,
#: never from one above; imports inside functions and under ``if TYPE_CHECKING:`` count too.
LAYERS = ("core", "backends", "ring", "reduction", "collectives")
#: The modules of elastic_ring outside the layers, above all of them (no layer imports them): the package
#: itself (``import elastic_ring as er`` re-exports the layers' public names) and ``shadowing`` (standard
#: library only; state/ and ray_integration/ load it by file path).
OUTSIDE_LAYERS = {"elastic_ring", "elastic_ring.shadowing"}


def layer(module: str) -> int | None:
    """The layer of an elastic_ring module or sub-package (its index in LAYERS), None outside them."""
    parts = module.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[0] == "elastic_ring" and parts[1] in LAYERS else None


def elastic_ring_imports() -> list[tuple[str, str, int]]:
    """(importing module, imported elastic_ring module or package, line) for every import in elastic_ring."""
    paths = {_module_name(p): p for p in (ROOT / "elastic_ring").rglob("*.py")}
    found = []
    for module, path in sorted(paths.items()):
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                # a name that is a module comes from that module; any other name from the package itself
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in paths else base for a in node.names]
            else:
                continue
            found += [(module, t, node.lineno) for t in targets if t == "elastic_ring" or t.startswith("elastic_ring.")]
    return found


def test_layer_table():
    assert layer("elastic_ring.core.errors") == 0 and layer("elastic_ring.backends.nccl.lib") == 1
    assert layer("elastic_ring.collectives") == 4
    assert layer("elastic_ring") is None and layer("elastic_ring.shadowing") is None and layer("state.state") is None


def test_every_elastic_ring_module_is_in_a_layer():
    loose = sorted(m for m in map(_module_name, (ROOT / "elastic_ring").rglob("*.py"))
                   if layer(m) is None and m not in OUTSIDE_LAYERS)
    assert not loose, (f"{loose}: every module of elastic_ring lives in one of its sub-packages {LAYERS} (lowest "
                       "first): move it into the lowest one that holds everything it imports")


def test_elastic_ring_layers_import_only_downward():
    found = elastic_ring_imports()
    # the check sees imports inside functions: runtime imports its backends only when it forms a round
    assert ("elastic_ring.ring.runtime", "elastic_ring.backends.gloo") in {(m, t) for m, t, _ in found}
    upward = []
    for module, target, line in found:
        mine, theirs = layer(module), layer(target)
        if mine is None or (theirs is not None and theirs <= mine):
            continue
        where = "outside the layers, above them all" if theirs is None else f"layer {LAYERS[theirs]}"
        upward.append(f"{module} (layer {LAYERS[mine]}), line {line}, imports {target} ({where})")
    assert not upward, ("elastic_ring's layers are " + " < ".join(LAYERS) + ": a module imports its own layer and the "
                        "ones below it, never one above (move the code it needs down, or the module up):\n  "
                        + "\n  ".join(upward))


# ------------------------------------------------------------------ state's parts (issue 31)
#: What each part of state may import of state. The core (the modules at state's root) may import anything of
#: state; the sub-packages never import the core, only the leaf modules named here (which import nothing of state).
#: Imports inside functions and under ``if TYPE_CHECKING:`` count too.
STATE_RULES = {
    "state.samplers": ("state.samplers",),
    "state.checkpoints": ("state.checkpoints", "state.errors", "state.snapshot"),
    "state.errors": (),
    "state.snapshot": (),
}


def state_rule(module: str) -> tuple[str, ...] | None:
    """The parts of state that ``module`` may import (module or package names), None for anything of state."""
    for part, allowed in STATE_RULES.items():
        if module == part or module.startswith(part + "."):
            return allowed
    return None


def allowed_in_state(module: str, target: str) -> bool:
    allowed = state_rule(module)
    return allowed is None or any(target == a or target.startswith(a + ".") for a in allowed)


def test_state_rule_table():
    assert state_rule("state.samplers.stream") == ("state.samplers",) and state_rule("state.state") is None
    assert allowed_in_state("state.state", "state.checkpoints.store")  # the core imports its sub-packages
    assert allowed_in_state("state.checkpoints.background", "state.snapshot")
    assert allowed_in_state("state.checkpoints.sequenced", "state.checkpoints.lease")
    assert not allowed_in_state("state.checkpoints.reported", "state.state")  # never the core
    assert not allowed_in_state("state.samplers.sampler", "state.membership")
    assert not allowed_in_state("state.samplers.sampler", "state.checkpoints.config")
    assert not allowed_in_state("state.errors", "state.checkpoints.faults")  # a leaf imports nothing of state
    assert state_rule("state.checkpoints_old") is None  # a part is a package and what is inside it, not a prefix


def state_imports() -> list[tuple[str, str, int]]:
    """(importing module, imported state module or package, line) for every import in state, wherever it is."""
    paths = {_module_name(p): p for p in (ROOT / "state").rglob("*.py")}
    found = []
    for module, path in sorted(paths.items()):
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in paths else base for a in node.names]
            else:
                continue
            found += [(module, t, node.lineno) for t in targets if t.startswith("state.")]
    return found


def test_state_parts_import_only_what_their_rule_allows():
    found = state_imports()
    assert ("state.durable", "state.checkpoints.store") in {(m, t) for m, t, _ in found}  # the check sees the graph
    bad = [f"{module}, line {line}, imports {target} (allowed: {', '.join(state_rule(module)) or 'nothing of state'})"
           for module, target, line in found if not allowed_in_state(module, target)]
    assert not bad, ("state's sub-packages never import its core (state.state and the other root modules), only "
                     "their own modules and the leaves state.errors / state.snapshot; move the code down, or "
                     "pass what it needs in:\n  " + "\n  ".join(bad))


# ------------------------------------------------------------------ ray_integration's sub-packages (issue 31)
#: ray_integration's units (its sub-packages, and the root modules below the front door) and what each may import
#: of ray_integration, besides ``errors`` (every public error), which any unit may import. Imports inside functions
#: and under ``if TYPE_CHECKING:`` count. Read upward, the table is the architecture:
#:
#:     front door (trainer, result, launch, the package)  may import every unit
#:     driver    config, wire, worker (the actor class, only in driver.pool: it creates the actors)
#:     worker    wire, data
#:     train     data              horovod   wire
#:     wire, data, config, errors  nothing of ray_integration
RAY_INTEGRATION_UNITS = {
    "errors": set(),
    "config": set(),
    "wire": set(),
    "data": set(),
    "horovod": {"wire"},
    "train": {"data"},
    "worker": {"wire", "data"},
    "driver": {"config", "wire", "worker"},
}
#: The root modules a user calls; they may import every unit. ``train.torch`` is Ray Train's ``ray.train.torch`` for
#: scripts that import ``ray_integration.train``: its ``TorchTrainer`` builds an ``ElasticTrainer``, so it is a front
#: door inside the ``train`` folder (the ``train`` unit, what runs inside the training function, never imports it).
FRONT_DOOR = {"ray_integration", "trainer", "result", "launch", "train.torch"}
#: The only module of the driver that imports the worker side: the pool creates the worker actors from its class.
ACTOR_MAKER = "ray_integration.driver.pool"
#: The driver's states decide; the loop acts. These modules never import the loop or the pool (nor the watcher,
#: the mailroom: anything that touches Ray or the workers).
DECIDING = ("ray_integration.driver.states", "ray_integration.driver.context", "ray_integration.driver.decisions",
            "ray_integration.driver.formation", "ray_integration.driver.pacing")
ACTING = {"ray_integration.driver.loop", "ray_integration.driver.pool", "ray_integration.driver.watcher",
          "ray_integration.driver.mailroom"}


def ray_integration_unit(module: str) -> str | None:
    """The unit of a ray_integration module (a key of RAY_INTEGRATION_UNITS or a member of FRONT_DOOR), else None."""
    parts = module.split(".")
    if parts[0] != "ray_integration":
        return None
    if parts[1:3] == ["train", "torch"]:
        return "train.torch"
    return "ray_integration" if len(parts) == 1 else parts[1]


def test_ray_integration_unit_table():
    assert ray_integration_unit("ray_integration.driver.loop") == "driver"
    assert ray_integration_unit("ray_integration.wire") == "wire"
    assert ray_integration_unit("ray_integration") == "ray_integration"
    assert ray_integration_unit("ray_integration.errors") == "errors" and ray_integration_unit("state.state") is None
    assert ray_integration_unit("ray_integration.train.torch._trainer") == "train.torch"
    assert ray_integration_unit("ray_integration.train._model") == "train"


def test_every_ray_integration_module_is_in_a_unit():
    loose = sorted(m for m in map(_module_name, (ROOT / "ray_integration").rglob("*.py"))
                   if ray_integration_unit(m) not in RAY_INTEGRATION_UNITS.keys() | FRONT_DOOR)
    assert not loose, (f"{loose}: every module of ray_integration is a front-door module ({sorted(FRONT_DOOR)}) or "
                       f"lives in a unit of RAY_INTEGRATION_UNITS ({sorted(RAY_INTEGRATION_UNITS)}); put it in the "
                       "sub-package that owns what it does, and give a new unit its rule")


def test_a_cycle_through_a_type_checking_import_is_found(tmp_path, monkeypatch):
    package = tmp_path / "ray_integration"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "loop.py").write_text("from .states import Starting\n")
    (package / "states.py").write_text("from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from .loop import Driver\n")
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    assert find_cycle(import_graph()) == ["ray_integration.loop", "ray_integration.states", "ray_integration.loop"]


def test_ray_integration_units_import_only_what_their_rule_allows():
    graph = import_graph()
    wrong = []
    for module, targets in sorted(graph.items()):
        mine = ray_integration_unit(module)
        if mine is None or mine in FRONT_DOOR:
            continue
        for target in sorted(targets):
            theirs = ray_integration_unit(target)
            if theirs is None or theirs == mine or theirs == "errors":
                continue
            if theirs not in RAY_INTEGRATION_UNITS[mine]:
                wrong.append(f"{module} ({mine}) imports {target} ({theirs}); {mine} may import "
                             f"{sorted(RAY_INTEGRATION_UNITS[mine] | {'errors'})}")
            elif (mine, theirs) == ("driver", "worker") and module != ACTOR_MAKER:
                wrong.append(f"{module} imports {target}: of the worker side the driver imports only the actor "
                             f"class, in {ACTOR_MAKER}")
    assert not wrong, ("ray_integration's units import downward only (RAY_INTEGRATION_UNITS); move the code either "
                       "needs into the lower unit, or pass it in from the front door:\n  " + "\n  ".join(wrong))


def test_the_driver_states_decide_and_never_import_what_acts():
    graph = import_graph()
    assert ACTING <= set(graph) and set(DECIDING) <= set(graph)
    wrong = {module: sorted(graph[module] & ACTING) for module in DECIDING if graph[module] & ACTING}
    assert not wrong, f"the driver's states and decisions return typed actions; only the loop acts: {wrong}"
