"""`pdref check` on the command line: exit codes, text and --json output, --open, many files."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from pdref import events as ev
from pdref.cli import main
from pdref.geometry import Geometry
from pdref.synth import SynthConfig, synth_trace
from pdref.trace import dumps

HEADER = ev.Header("t", "chunk", Geometry(2, 1, 2, 2, 4), 40, 2)


def write(path, objs) -> str:
    path.write_text("".join(dumps(o) + "\n" for o in objs))
    return str(path)


@pytest.fixture
def legal(tmp_path):
    events = synth_trace(HEADER, SynthConfig(requests=4, max_live=2, max_prompt=30), 5)
    objs = [ev.header_to_json(HEADER)] + [ev.event_to_json(e) for e in events]
    return write(tmp_path / "legal.jsonl", objs), len(events)


@pytest.fixture
def illegal(tmp_path):
    """A trace whose third line lands a span that was never issued (REQ-1)."""
    objs = [ev.header_to_json(HEADER),
            {"kind": "reserve", "t": 0, "req": "r", "prompt": 8, "prefix": 0, "pages": [0, 1]},
            {"kind": "land", "t": 1, "req": "r", "span": 3}]
    return write(tmp_path / "illegal.jsonl", objs)


@pytest.fixture
def partial(tmp_path):
    """A legal prefix of a run: it ends holding pages."""
    objs = [ev.header_to_json(HEADER),
            {"kind": "reserve", "t": 0, "req": "r", "prompt": 8, "prefix": 0, "pages": [0, 1]},
            {"kind": "computed", "t": 1, "req": "r", "layers": [0, 2], "tokens": [0, 8]}]
    return write(tmp_path / "partial.jsonl", objs)


def test_legal_trace_exit_0(legal, capsys):
    """A legal trace: exit 0 and 'FILE: ok: N events, R requests'."""
    path, n = legal
    assert main(["check", path]) == 0
    out = capsys.readouterr().out.strip()
    assert out == f"{path}: ok: {n} events, 4 requests"


def test_violation_exit_1_text(illegal, capsys):
    """An illegal trace: exit 1 and 'FILE:LINE: CODE sentence' naming the first violation."""
    assert main(["check", illegal]) == 1
    out = capsys.readouterr().out.strip()
    assert re.fullmatch(re.escape(illegal) + r":3: REQ-1 \S.*", out), out


def test_json_output(legal, illegal, capsys):
    """--json prints one object per file with file, ok, events, requests, code, line, message."""
    path, n = legal
    assert main(["check", "--json", path, illegal]) == 1
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2
    good, bad = (json.loads(line) for line in lines)
    keys = {"file", "ok", "events", "requests", "code", "line", "message"}
    assert set(good) == keys and set(bad) == keys
    assert good == {"file": path, "ok": True, "events": n, "requests": 4, "code": None,
                    "line": None, "message": None}
    assert (bad["file"], bad["ok"], bad["code"], bad["line"]) == (illegal, False, "REQ-1", 3)
    assert bad["events"] == 1 and bad["requests"] == 1 and bad["message"]


def test_open_skips_end_of_trace_life1(partial, capsys):
    """A trace ending with pages held is LIFE-1 at its last line, but ok with --open."""
    assert main(["check", partial]) == 1
    assert capsys.readouterr().out.strip() == f"{partial}:3: LIFE-1 " + \
        "trace ends with request 'r' holding 2 pages"
    assert main(["check", "--open", partial]) == 0
    assert "ok: 2 events, 1 request\n" in capsys.readouterr().out


def test_open_leaves_aside_a_last_line_caught_halfway(partial, capsys):
    """A trace being written, read in the middle of its last line's write: --open checks
    the whole lines before it; without --open that half line is TRACE-1."""
    with open(partial, "ab") as f:
        f.write(b'{"kind":"issue","t":2,"req":"r","sp')
    assert main(["check", "--open", partial]) == 0
    assert "ok: 2 events, 1 request\n" in capsys.readouterr().out
    assert main(["check", partial]) == 1
    assert ":4: TRACE-1 " in capsys.readouterr().out


def test_open_still_refuses_real_violations(illegal, capsys):
    """--open only skips the end-of-trace check: a broken rule is still exit 1."""
    assert main(["check", "--open", illegal]) == 1
    assert ": REQ-1 " in capsys.readouterr().out


def test_several_files_one_line_each(legal, illegal, partial, capsys):
    """Several files: one verdict line per file, in order, exit code the worst of them."""
    path, _ = legal
    assert main(["check", path, path]) == 0
    assert main(["check", path, illegal, partial]) == 1
    out = capsys.readouterr().out.strip().splitlines()
    assert [line.split(":")[0] for line in out] == [path, path, path, illegal, partial]


def test_unreadable_file_exit_2(legal, illegal, tmp_path, capsys):
    """A missing file or a directory: exit 2 (even after an illegal file), others still checked."""
    path, _ = legal
    missing = str(tmp_path / "nope.jsonl")
    assert main(["check", path, missing]) == 2
    captured = capsys.readouterr()
    assert captured.out.startswith(f"{path}: ok")
    assert missing in captured.err
    assert main(["check", missing, illegal]) == 2
    assert ": REQ-1 " in capsys.readouterr().out
    assert main(["check", str(tmp_path)]) == 2


def test_unreadable_file_json(tmp_path, capsys):
    """With --json an unreadable file still gets its one JSON line, ok false."""
    missing = str(tmp_path / "nope.jsonl")
    assert main(["check", "--json", missing]) == 2
    obj = json.loads(capsys.readouterr().out)
    assert obj["file"] == missing and obj["ok"] is False


def test_malformed_file_is_exit_1(tmp_path, capsys):
    """A file that can be read but is not a trace (empty, garbage) is a TRACE-1 verdict."""
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    garbage = tmp_path / "garbage.jsonl"
    garbage.write_bytes(b"\xff\x00not json\n")
    assert main(["check", str(empty), str(garbage)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out == [f"{empty}:1: TRACE-1 " + out[0].split(" TRACE-1 ", 1)[1],
                   f"{garbage}:1: TRACE-1 " + out[1].split(" TRACE-1 ", 1)[1]]


@pytest.mark.parametrize("argv", [[], ["check"], ["frobnicate", "x"], ["check", "--bogus", "x"]])
def test_bad_command_line_exit_2(argv, capsys):
    """A bad command line is argparse's exit 2 with a usage message."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert "usage" in capsys.readouterr().err


def test_module_entry_point(legal, illegal):
    """`python -m pdref check` runs the same command with the same exit codes."""
    path, _ = legal
    ok = subprocess.run([sys.executable, "-m", "pdref", "check", path], capture_output=True,
                        timeout=120)
    bad = subprocess.run([sys.executable, "-m", "pdref", "check", illegal], capture_output=True,
                         timeout=120)
    assert (ok.returncode, bad.returncode) == (0, 1)
    assert b": REQ-1 " in bad.stdout


def test_help_states_which_failure_is_exit_1_and_which_is_exit_2(tmp_path, capsys):
    """--help's exit table matches: a non-JSON file is TRACE-1 (1), a missing one is 2."""
    with pytest.raises(SystemExit):
        main(["check", "--help"])
    help_text = capsys.readouterr().out
    assert "not JSON" in help_text and "cannot be opened" in help_text
    not_json = tmp_path / "notes.txt"
    not_json.write_text("hello\n")
    assert main(["check", str(not_json)]) == 1
    assert "TRACE-1" in capsys.readouterr().out
    assert main(["check", str(tmp_path / "absent.jsonl")]) == 2
