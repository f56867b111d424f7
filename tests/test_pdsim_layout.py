"""pdsim's layout: core imports nothing above it, views never import the commands, and the
imports have no circle (function-level ones included)."""

import ast
from pathlib import Path

import networkx as nx

import pdsim

ROOT = Path(pdsim.__file__).parent
COMMANDS = {"pdsim.cli", "pdsim.sweep", "pdsim.ray_sweep", "pdsim.demo", "pdsim.study",
            "pdsim.__main__"}


def _names(node) -> set[str]:
    if isinstance(node, ast.ImportFrom) and node.module == "pdsim":  # from pdsim import sweep
        return {f"pdsim.{a.name}" for a in node.names}
    if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("pdsim."):
        return {node.module}
    if isinstance(node, ast.Import):
        return {a.name for a in node.names if a.name.startswith("pdsim.")}
    return set()


def _module(path: Path) -> str:
    return ".".join(("pdsim", *path.relative_to(ROOT).with_suffix("").parts))


def _graph(top_level_only: bool) -> dict[str, set[str]]:
    """Module -> the pdsim modules it imports (at module level only, or anywhere)."""
    graph = {}
    for path in ROOT.rglob("*.py"):
        tree = ast.parse(path.read_text())
        nodes = tree.body if top_level_only else ast.walk(tree)
        graph[_module(path)] = set().union(*(_names(n) for n in nodes))
    return graph


def test_core_imports_only_core():
    """pdsim.core (the simulator) imports nothing from fit, views or the command line."""
    bad = {(m, i) for m, deps in _graph(False).items() if m.startswith("pdsim.core.")
           for i in deps if not i.startswith("pdsim.core.")}
    assert bad == set()


def test_views_and_fit_never_import_the_commands():
    """A plot gets what it draws from its caller: no view or fit module imports sweep/demo/cli
    (plots -> sweep, with sweep -> plots, was a circle)."""
    bad = {(m, i) for m, deps in _graph(False).items()
           if m.startswith(("pdsim.views.", "pdsim.fit.")) for i in deps if i in COMMANDS}
    assert bad == set()


def test_module_level_imports_have_no_circle():
    """The import graph at module level is acyclic (lazy imports inside functions aside)."""
    graph = nx.DiGraph([(m, i) for m, deps in _graph(True).items() for i in deps])
    assert list(nx.simple_cycles(graph)) == []


def test_no_module_imports_its_caller():
    """No circle even through imports inside functions: a module never imports one that
    imports it (sim <-> fault_sim, sweep <-> ray_sweep, study <-> study_report were)."""
    graph = nx.DiGraph([(m, i) for m, deps in _graph(False).items() for i in deps])
    assert list(nx.simple_cycles(graph)) == []
