# SPDX-License-Identifier: Apache-2.0
"""The package's layers import one way (docs/design.md, "Layers"): every module imports, no module imports a layer
above its own, the analysis layers reach the runtime only through its op handles, and no two modules import
each other through any chain. The checker is run on the real import graph and on made-up graphs that break each
rule, so that it is known to fail when someone adds a forbidden import."""
import ast
import importlib
import os
from typing import Dict, List, Set, Tuple

import networkx as nx
import pytest

from checkout import PACKAGE_DIR

PACKAGE = "deepspeed.compile"

# bottom first; a module may import its own layer and the layers below it
LAYERS: List[Tuple[str, Tuple[str, ...]]] = [
    ("base", ("", "config", "constants", "compat", "effects", "adapters", "_deepspeed_compile_hook")),
    ("runtime", ("runtime", "native")),  # graph ops and their registry, the runtime behind them, the native op
    ("graph", ("graph", )),  # analysis vocabulary, tag and rewrite passes, the pass runner
    ("schedule", ("schedule", )),
    ("driver", ("driver", )),  # the compile driver: dynamo backend, compiler, stage parts, ZeRO-3's eager hooks
    ("integrations", ("integrations", )),  # DeepSpeed's checkpointing, Accelerate, transformers
    # the engine's DeepCompile state, the checks of what composes with what, the user-facing report
    ("engine", ("engine_state", "composition", "report")),
    # thin entry points, each there because stock DeepSpeed (or a user script written for it) imports it by name, and
    # the data helper user scripts import
    ("entry points", ("backend", "util", "z3_eager_fallback", "init_z3", "init_z1_and_2", "init_sp", "init_tp",
                      "passes", "data")),
]
# graph analysis and scheduling see the runtime only through the ops' handles, never its communication code
OPS_ONLY = {"graph", "schedule"}
OPS_MODULES = {"runtime", "runtime.ops", "runtime.registry"}


def layer_of(module: str) -> int:
    """Index in LAYERS of a module given relative to the package ('' is the package itself)."""
    best = None
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if module == prefix or (prefix and module.startswith(prefix + ".")):
                if best is None or len(prefix) > best[1]:
                    best = (index, len(prefix))
    if best is None:
        raise AssertionError(f"module {module!r} is in no layer: add it to LAYERS and docs/design.md")
    return best[0]


def package_modules() -> List[str]:
    """Every module of the package, relative to it ('' for the package)."""
    names = []
    for folder, dirs, files in os.walk(PACKAGE_DIR):
        dirs[:] = [d for d in dirs if os.path.isfile(os.path.join(folder, d, "__init__.py"))]
        rel = os.path.relpath(folder, PACKAGE_DIR)
        parts = [] if rel == "." else rel.split(os.sep)
        for name in files:
            if name.endswith(".py"):
                stem = name[:-3]
                names.append(".".join(parts if stem == "__init__" else parts + [stem]))
    return sorted(names)


def _source_path(module: str) -> str:
    base = os.path.join(PACKAGE_DIR, *module.split(".")) if module else PACKAGE_DIR
    return os.path.join(base, "__init__.py") if os.path.isdir(base) else base + ".py"


def imports_of(module: str, modules: Set[str]) -> Set[str]:
    """Package modules that ``module`` imports anywhere in its file (top level, in functions, under
    TYPE_CHECKING): ``from .x import y`` counts as ``x.y`` when that is a module, else ``x``."""
    path = _source_path(module)
    is_package = path.endswith("__init__.py")
    tree = ast.parse(open(path).read(), path)
    found: Set[str] = set()

    def add(name: str) -> None:
        if name in modules and name != module:
            found.add(name)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == PACKAGE or alias.name.startswith(PACKAGE + "."):
                    add(alias.name[len(PACKAGE) + 1:])
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                if node.module is None or not (node.module == PACKAGE or node.module.startswith(PACKAGE + ".")):
                    continue
                base = node.module[len(PACKAGE) + 1:]
            else:
                parts = module.split(".") if module else []
                anchor = parts if is_package else parts[:-1]
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            for alias in node.names:
                child = f"{base}.{alias.name}" if base else alias.name
                add(child if child in modules else base)
    return found


def import_graph() -> Dict[str, Set[str]]:
    modules = set(package_modules())
    return {module: imports_of(module, modules) for module in modules}


def violations(graph: Dict[str, Set[str]]) -> List[str]:
    """Every import that breaks a rule, and every import cycle, as readable lines (empty: all is well)."""
    found = []
    for module, targets in sorted(graph.items()):
        here = layer_of(module)
        for target in sorted(targets):
            there = layer_of(target)
            if there > here:
                found.append(f"{module or PACKAGE} ({LAYERS[here][0]}) imports {target} ({LAYERS[there][0]}), "
                             "a layer above it")
            elif LAYERS[here][0] in OPS_ONLY and LAYERS[there][0] == "runtime" and target not in OPS_MODULES:
                found.append(f"{module} ({LAYERS[here][0]}) imports {target}: analysis reaches the runtime "
                             "only through runtime.ops")
    digraph = nx.DiGraph([(m, t) for m, targets in graph.items() for t in targets])
    for cycle in nx.simple_cycles(digraph):
        found.append("import cycle: " + " -> ".join(cycle + cycle[:1]))
    return found


def test_every_module_imports_and_the_layers_hold():
    modules = package_modules()
    for module in modules:
        importlib.import_module(f"{PACKAGE}.{module}" if module else PACKAGE)
    graph = import_graph()
    assert "runtime.z3" in graph and "graph.nodes" in graph and "driver.compiler" in graph  # the walk found them
    assert sum(len(t) for t in graph.values()) > 20  # and their imports
    assert violations(graph) == []


@pytest.mark.parametrize("module, target, expected", [
    ("runtime.z3", "graph.saved", "a layer above it"),  # the runtime must not read compile statistics
    ("graph.nodes", "schedule.memory_plan", "a layer above it"),
    ("driver.compiler", "backend", "a layer above it"),  # the compiler must not reach into an entry point
    ("schedule.fast_free", "runtime.z3", "only through runtime.ops"),
])
def test_a_forbidden_import_is_reported(module, target, expected):
    graph = import_graph()
    graph[module] = graph[module] | {target}
    found = violations(graph)
    assert any(f"{module} (" in line and target in line and expected in line for line in found), found


def test_an_import_cycle_is_reported():
    graph = import_graph()
    graph["graph.saved"] = graph["graph.saved"] | {"graph.rewrite"}
    graph["graph.rewrite"] = graph["graph.rewrite"] | {"graph.saved"}
    assert any(line.startswith("import cycle:") and "graph.saved" in line for line in violations(graph))


def test_a_module_outside_the_layers_is_refused():
    with pytest.raises(AssertionError, match="in no layer"):
        layer_of("optimizer_offload")
