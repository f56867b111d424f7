"""The shipped example traces: legal ones check ok, each illegal one triggers its named code."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pdref.check import check_file
from pdref.violations import CODES

EXAMPLES = Path(__file__).resolve().parent.parent / "specs" / "examples"
ALL = sorted(EXAMPLES.glob("*.jsonl"))
CODE_RE = re.compile(r"illegal-([A-Z]+-\d)-")


@pytest.mark.parametrize("path", [p for p in ALL if p.name.startswith("legal-")], ids=str)
def test_legal_example_checks_ok(path):
    """A shipped legal example passes the checker."""
    result = check_file(path)
    assert result.ok, result.text()


@pytest.mark.parametrize("path", [p for p in ALL if p.name.startswith("illegal-")], ids=str)
def test_illegal_example_triggers_its_code(path):
    """A shipped illegal example is refused with the code in its name."""
    result = check_file(path)
    assert not result.ok
    assert result.code == CODE_RE.match(path.name).group(1), result.text()


def test_every_code_has_an_example():
    """Every violation code of the contract has at least one shipped example."""
    named = {CODE_RE.match(p.name).group(1) for p in ALL if p.name.startswith("illegal-")}
    assert named == set(CODES)


def test_examples_are_up_to_date(tmp_path, monkeypatch):
    """Regenerating the examples gives the shipped files byte for byte."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "make_examples", EXAMPLES.parent.parent / "scripts" / "make_examples.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "OUT", tmp_path)
    module.main()
    fresh = {p.name: p.read_bytes() for p in tmp_path.glob("*.jsonl")}
    shipped = {p.name: p.read_bytes() for p in ALL}
    assert fresh == shipped
