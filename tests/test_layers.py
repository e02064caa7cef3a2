"""The shape of the code, read from its imports: one-way layers, no cycles, no private reach-ins.

    cli  ->  stages: paths.prepare -> experts -> sharding -> paths.work -> compose  ->  core (paths.*)  ->  storage

A stage may use an earlier stage's public names (compose reads sharding's datasets and the
workers' evaluator), never a later one's; the core imports no stage; storage imports nothing of
the rest. Every import counts, function-level ones included.
"""

from __future__ import annotations

import ast
import os
from collections import defaultdict

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("storage", "paths", "experts", "sharding", "compose", "cli")
# (layer, rank): a module may import only modules of a rank <= its own.
LAYERS = [("storage", 0), ("paths", 1), ("paths.prepare", 2), ("experts", 3), ("sharding", 4), ("paths.work", 5), ("compose", 6), ("cli", 7)]


def layer_of(module: str) -> tuple[str, int]:
    """The most specific layer a module belongs to."""
    best = None
    for name, rank in LAYERS:
        if module == name or module.startswith(name + "."):
            if best is None or len(name) > len(best[0]):
                best = (name, rank)
    assert best is not None, module
    return best


def modules() -> dict[str, str]:
    """{dotted module name: file} of every module in the package folders."""
    out = {}
    for package in PACKAGES:
        for folder, _, files in os.walk(os.path.join(ROOT, package)):
            for f in files:
                if f.endswith(".py"):
                    rel = os.path.relpath(os.path.join(folder, f), ROOT)[:-3].replace(os.sep, ".")
                    out[rel.removesuffix(".__init__")] = os.path.join(folder, f)
    return out


def imports(known: dict[str, str]) -> dict[str, list[tuple[str, list[str]]]]:
    """{module: [(imported module, names taken from it)]}, the project's own modules only."""
    graph: dict[str, list[tuple[str, list[str]]]] = defaultdict(list)
    for module, path in known.items():
        tree = ast.parse(open(path).read(), path)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in known:
                        graph[module].append((alias.name, []))
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                if node.module.split(".")[0] not in PACKAGES:
                    continue
                for alias in node.names:  # `from paths import checkpoint` imports a module
                    sub = f"{node.module}.{alias.name}"
                    if sub in known:
                        graph[module].append((sub, []))
                names = [a.name for a in node.names if f"{node.module}.{a.name}" not in known]
                if names and node.module in known:
                    graph[module].append((node.module, names))
    return graph


KNOWN = modules()
GRAPH = imports(KNOWN)


def test_the_layer_rules_know_every_module():
    assert len(KNOWN) > 40  # the walk found the code (a test that reads nothing cannot fail)
    for module in KNOWN:
        layer_of(module)


def test_no_import_runs_up_a_layer():
    upward = []
    for module, targets in GRAPH.items():
        here = layer_of(module)
        for target, _ in targets:
            there = layer_of(target)
            if there[1] > here[1]:
                upward.append(f"{module} ({here[0]}) imports {target} ({there[0]})")
    assert not upward, "imports against the layers:\n" + "\n".join(sorted(upward))


def test_no_stage_takes_another_layers_private_names():
    private = []
    for module, targets in GRAPH.items():
        for target, names in targets:
            if layer_of(target)[0] != layer_of(module)[0]:
                private += [f"{module} takes {target}.{n}" for n in names if n.startswith("_")]
    assert not private, "\n".join(sorted(private))


def test_modules_import_each_other_in_no_cycle():
    edges = {m: sorted({t for t, _ in ts if t != m and not KNOWN[t].endswith("__init__.py")}) for m, ts in GRAPH.items()}
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for t in edges.get(m, []):
            if state.get(t) == 1:
                cycles.append(stack[stack.index(t):] + [t])
            elif t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(KNOWN):
        if m not in state:
            visit(m)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


@pytest.mark.parametrize("package", ["storage"])
def test_storage_imports_nothing_of_the_rest(package):
    above = [f"{m} imports {t}" for m, ts in GRAPH.items() if m.startswith(package) for t, _ in ts if not t.startswith(package)]
    assert not above, "\n".join(above)
