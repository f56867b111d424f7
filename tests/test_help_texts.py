"""Help texts: every subcommand listed, a summary line on each one's own --help, the presets
named under --model, and no empty "(default: )"."""

from __future__ import annotations

import re

import pytest

from pdgpu.cli import main as pdgpu_main
from pdref.models import list_models
from pdsim.cli import _commands
from pdsim.cli import main as pdsim_main

PDSIM = tuple(_commands())
PDGPU = ("run", "compare", "serve", "generate")
MODEL_OPTION = {"run", "sweep", "explain", "timeline", "validate", "demo"}


def _help(main, argv, capsys) -> str:
    """The --help text `main` prints for `argv`."""
    try:
        main([*argv, "--help"])
    except SystemExit as e:  # pdgpu's argparse exits itself; pdsim's main returns the code
        assert e.code == 0
    return capsys.readouterr().out


def _summary(text: str) -> str:
    """The paragraph after the usage lines."""
    return text.split("\n\n")[1].strip()


def test_pdsim_help_lists_every_subcommand_including_study(capsys):
    """`pdsim --help` names each subcommand, in its list and in its opening line."""
    text = _help(pdsim_main, [], capsys)
    for name in PDSIM:
        assert re.search(rf"^    {name} ", text, re.M), name
    assert "study" in _summary(text) and "study" in PDSIM


@pytest.mark.parametrize("main,name", [(pdsim_main, n) for n in PDSIM]
                         + [(pdgpu_main, n) for n in PDGPU])
def test_every_subcommand_help_has_a_summary_and_no_empty_default(main, name, capsys):
    """Its own --help opens with a summary line; no option shows "(default: )"."""
    text = _help(main, [name], capsys)
    assert not _summary(text).startswith("options:") and len(_summary(text)) > 10, text
    assert "(default: )" not in text and "default: )" not in text.replace("\n", " ")


@pytest.mark.parametrize("main,name", [(pdsim_main, n) for n in sorted(MODEL_OPTION)]
                         + [(pdgpu_main, n) for n in PDGPU])
def test_model_help_names_every_preset(main, name, capsys):
    """--model's help names each shipped preset (wrapped lines joined)."""
    text = " ".join(_help(main, [name], capsys).split())
    for preset in list_models():
        assert preset in text, (name, preset)
