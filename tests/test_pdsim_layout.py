"""pdsim's layout: core imports nothing above it and views never import the commands (that no
import, even inside a function, closes a circle is tests/test_import_circles.py's)."""

from pathlib import Path

from import_helpers import import_graph

import pdsim

GRAPH = import_graph(Path(pdsim.__file__).parent)  # imports inside functions counted
COMMANDS = {"pdsim.cli", "pdsim.sweep", "pdsim.ray_sweep", "pdsim.demo", "pdsim.study",
            "pdsim.__main__"}


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_core_imports_only_core():
    """pdsim.core (the simulator) imports nothing from fit, views or the command line."""
    bad = {(m, i) for m, i in GRAPH.edges if _in(m, "pdsim.core") and not _in(i, "pdsim.core")}
    assert bad == set()


def test_views_and_fit_never_import_the_commands():
    """A plot gets what it draws from its caller: no view or fit module imports sweep/demo/cli
    (plots -> sweep, with sweep -> plots, was a circle)."""
    bad = {(m, i) for m, i in GRAPH.edges
           if (_in(m, "pdsim.views") or _in(m, "pdsim.fit")) and i in COMMANDS}
    assert bad == set()
