"""The package's layout is its architecture: subpackages in layers, each importing only the ones below it.

    config < lifecycle < training < swarm < averaging < state < observe < rounds < tools < the daemon and the CLI

A module may import its own subpackage and any lower one; nothing imports a higher one, the imports have
no cycles, and no module of a running peer imports ``tools`` (the demo, simulator and test bed). These
tests read the source (ast), so they also see imports inside functions.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import diloco_peer

PACKAGE = Path(diloco_peer.__file__).parent
LAYERS = ["config", "lifecycle", "training", "swarm", "averaging", "state", "observe", "rounds", "tools"]
TOP = len(LAYERS)  # the top-level modules: daemon, bootstrap_node, cli, commands, __main__
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60


def modules() -> dict[str, Path]:
    """Dotted name (``averaging.allreduce``, ``daemon``) -> file, for every module of the package."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name or "__init__"] = path
    return found


def layer(module: str) -> int:
    if module == "__init__":
        return -1  # the package root holds ``__version__`` only and imports nothing: anyone may read it
    head = module.split(".")[0]
    return LAYERS.index(head) if head in LAYERS else TOP


def imports_of(module: str, source: str, known: set[str], is_package: bool = False) -> set[str]:
    """The package modules ``module`` imports (relative or absolute, at any depth of its ``source``)."""
    package = [] if module == "__init__" else module.split(".") if is_package else module.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - (node.level - 1)] if node.level > 1 else package
                target = ".".join([*base, *(node.module.split(".") if node.module else [])])
            elif (node.module or "").startswith("diloco_peer"):
                target = node.module.removeprefix("diloco_peer").lstrip(".")
            else:
                continue
            for alias in node.names:  # ``from . import reachability`` names a module, not an attribute
                sub = f"{target}.{alias.name}" if target else alias.name
                found.add(sub if sub in known else target)
        elif isinstance(node, ast.Import):
            found |= {a.name.removeprefix("diloco_peer.") for a in node.names if a.name.startswith("diloco_peer.")}
    return {name or "__init__" for name in found} - {module}


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports_of(name, path.read_text(), set(known), path.name == "__init__.py")
            for name, path in known.items()}


def test_the_package_has_the_documented_subpackages():
    for name in LAYERS:
        init = PACKAGE / name / "__init__.py"
        assert init.is_file(), f"missing subpackage {name}/"
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert "Owns" in doc and "Imports" in doc, f"{name}/__init__.py must say what it owns and may import"


def test_no_module_imports_a_higher_layer(graph):
    assert graph["__init__"] == set(), "diloco_peer/__init__.py must import nothing of the package"
    upward = [f"{importer} imports {imported}" for importer, targets in graph.items() for imported in targets
              if imported in graph and layer(imported) > layer(importer)]
    assert not upward, "layering broken (order: " + " < ".join(LAYERS) + " < top level): " + "; ".join(upward)


def test_no_module_of_a_running_peer_imports_the_tools(graph):
    # the CLI starts the demo and the simulator; nothing a peer or a bootstrap node runs may need them
    users = sorted(m for m, targets in graph.items() for t in targets
                   if t.split(".")[0] == "tools" and m.split(".")[0] != "tools" and m not in ("cli", "commands"))
    assert not users, f"production modules import tools/: {users}"


def test_the_imports_have_no_cycles(graph):
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if nxt not in graph:
                continue
            assert state.get(nxt) != 1, "import cycle: " + " -> ".join([*path, node, nxt])
            if nxt not in state:
                visit(nxt, [*path, node])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [])


def test_the_layering_check_sees_an_upward_import():
    """The checks above would pass vacuously if the import parser missed relative or nested imports."""
    known = set(modules())
    source = ("from ..config import PeerConfig\nfrom ..swarm import reachability\n"
              "def f():\n    from ..daemon import PeerDaemon\n")
    found = imports_of("training.probe", source, known)
    assert found == {"config", "swarm.reachability", "daemon"}
    assert {m for m in found if layer(m) > layer("training.probe")} == {"swarm.reachability", "daemon"}


def test_modules_and_functions_stay_readable():
    too_long = [f"{p.relative_to(PACKAGE)}: {n} lines" for p in PACKAGE.rglob("*.py")
                if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES]
    assert not too_long, f"modules over {MAX_MODULE_LINES} lines (split by responsibility): {too_long}"
    long_functions = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    long_functions.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name}: {length} lines")
    assert not long_functions, f"functions over {MAX_FUNCTION_LINES} lines: {long_functions}"
