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


def test_metric_values_carry_units_and_json_words():
    """Seconds and bytes show units, None is null, booleans are lower case."""
    from pdref.cli_format import metric_text

    assert metric_text("tail_s", 0.0396) == "0.039600 s  (39.600 ms)"
    assert metric_text("prefill_s", 752.1367) == "752.137 s"
    assert metric_text("first_token", None) == "null"
    assert metric_text("no_compute", False) == "false"
    assert metric_text("link_gbps", 0.2) == "0.2 GB/s"


@pytest.mark.parametrize("n,text", [(2**20 * 999, "999.00 MiB"), (40 * 2**30, "40.00 GiB"),
                                    (2**30, "1.00 GiB")])
def test_byte_figures_switch_to_gib_before_mib_runs_long(n, text):
    """Bytes read in MiB below 1 GiB and in GiB from there: no six-digit MiB figures."""
    from pdref.cli_format import metric_text

    assert metric_text("bytes", n) == f"{n} B  ({text})"


def test_counts_agree_in_number():
    """1 request, 2 requests, 0 events."""
    from pdref.cli_format import count

    assert [count(1, "request"), count(2, "request"), count(0, "event")] == [
        "1 request", "2 requests", "0 events"]


def test_the_three_tools_print_null_units_and_singulars(tmp_path, capsys):
    """pdgpu run and pdsim run text: no None, units beside values; pdref check: 1 request."""
    from pdgpu.cli import main as pdgpu_main
    from pdref.cli import main as pdref_main
    from pdsim.cli import main as pdsim_main

    trace = tmp_path / "t.jsonl"
    assert pdgpu_main(["run", "--prompt", "32", "--chunk", "16", "--trace", str(trace)]) == 0
    assert pdsim_main(["run", "--prompt", "512"]) == 0
    out = capsys.readouterr().out
    assert "None" not in out and "True" not in out and "False" not in out
    assert "link_gbps: null" in out and "handoff_s: " in out and " ms)" in out
    assert " B  (" in out and "MiB)" in out
    assert pdref_main(["check", str(trace)]) == 0
    assert capsys.readouterr().out.rstrip().endswith(" events, 1 request")
