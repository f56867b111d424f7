"""No import circles in pdgpu, pdref or pdsim: a module never imports its caller, counting the
imports inside functions too (a lazy import is still a dependency, only a later one)."""

from pathlib import Path

import pytest
from import_helpers import circles

import pdgpu
import pdref
import pdsim

PACKAGES = {"pdgpu": pdgpu, "pdref": pdref, "pdsim": pdsim}


def test_a_circle_through_a_function_level_import_is_found(tmp_path):
    """The checker sees a circle closed by an import inside a function, and a relative one."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "top.py").write_text("from pkg.sub import low\n")
    (pkg / "sub" / "low.py").write_text("def f():\n    from .. import top\n")
    (pkg / "sub" / "other.py").write_text("from . import low\n")
    assert circles(pkg) == ["pkg.sub.low -> pkg.top -> pkg.sub.low"]


@pytest.mark.parametrize("name", ["pdgpu", "pdref", "pdsim"])
def test_package_has_no_import_circle(name):
    """Every import, at module level or inside a function, points down: no circle."""
    assert circles(Path(PACKAGES[name].__file__).parent) == []
