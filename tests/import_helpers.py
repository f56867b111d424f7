"""The import graph of a package, read from its sources with `ast` (imports inside functions
counted), and its circles: for tests/test_import_circles.py, test_pdgpu_serve_parts.py and
test_pdsim_layout.py."""

import ast
from pathlib import Path

import networkx as nx


def _modules(root: Path) -> dict[str, Path]:
    """Dotted module name -> its file, for every .py under the package folder `root`."""
    modules = {}
    for path in root.rglob("*.py"):
        parts = (root.name, *path.relative_to(root).with_suffix("").parts)
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _targets(node: ast.AST, module: str, is_package: bool) -> list[str]:
    """The dotted names an import statement may load (for `from a import b`: a, and a.b in
    case b is a module); relative imports resolved against `module`."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:
        package = module.split(".") if is_package else module.split(".")[:-1]
        package = package[:len(package) - node.level + 1]
        base = ".".join([*package, base] if base else package)
    return [base, *(f"{base}.{alias.name}" for alias in node.names)]


def _known(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of `name` that is a module of the package (None: outside it)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(root: Path) -> nx.DiGraph:
    """Module -> the package's modules it imports anywhere in its file. An import of one's
    own enclosing package is left out: Python loads it first whatever the module says."""
    modules = _modules(root)
    graph = nx.DiGraph()
    for module, path in modules.items():
        graph.add_node(module)
        for node in ast.walk(ast.parse(path.read_text())):
            for name in _targets(node, module, path.name == "__init__.py"):
                target = _known(name, modules)
                if target and target != module and not module.startswith(target + "."):
                    graph.add_edge(module, target)
    return graph


def circles(root: Path) -> list[str]:
    """Each import circle as 'a -> b -> a', from its first module in name order, sorted."""
    found = []
    for cycle in nx.simple_cycles(import_graph(root)):
        first = cycle.index(min(cycle))
        turned = cycle[first:] + cycle[:first]
        found.append(" -> ".join([*turned, turned[0]]))
    return sorted(found)
