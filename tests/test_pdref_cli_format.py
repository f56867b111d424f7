"""--help of pdref, pdsim and pdgpu: every option has a help line that shows its default."""

from __future__ import annotations

import argparse

import pytest

from pdgpu.cli import build_parser as pdgpu_parser
from pdref.cli import _parser as pdref_parser
from pdsim.cli import _commands
from pdsim.cli import _parser as pdsim_parser


def _subcommands():
    """(name, subparser) of every subcommand of the three command lines."""
    parsers = {"pdref": pdref_parser(), "pdsim": pdsim_parser(_commands()),
               "pdgpu": pdgpu_parser()}
    for tool, parser in parsers.items():
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        for name, subparser in sub.choices.items():
            yield f"{tool} {name}", subparser


SUBCOMMANDS = dict(_subcommands())


@pytest.mark.parametrize("name", sorted(SUBCOMMANDS))
def test_every_option_has_help_and_shows_its_default(name):
    """Each option has help text; one with a fixed default names it in --help."""
    parser = SUBCOMMANDS[name]
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        flag = "/".join(action.option_strings) or action.dest
        assert action.help, f"{name} {flag}: no help line"
        helped = parser._get_formatter()._expand_help(action)
        if action.option_strings and action.nargs != 0 and action.default is not None:
            assert "default" in helped, f"{name} {flag}: default {action.default!r} not shown"


def test_default_of_a_list_option_reads_as_the_flag_takes_it():
    """A tuple default is shown comma separated, as the option is typed."""
    text = " ".join(SUBCOMMANDS["pdsim sweep"].format_help().split())
    assert "(default: 64,128,256,512,1024,2048)" in text
