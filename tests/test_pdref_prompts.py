"""The serving prompts file, read once for both shells: the first bad line is refused naming
the file's line and the field, and pdsim and pdgpu refuse a file with the same words."""

from __future__ import annotations

import json

import pytest

from pdgpu.cli import main as pdgpu_main
from pdref.prompts import PromptsError, read_prompts, shared_prefix
from pdsim.cli import main as pdsim_main


def _file(tmp_path, *lines: str):
    path = tmp_path / "p.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_lines_in_file_order_blank_lines_skipped(tmp_path):
    """Every request in file order; output_tokens None where the line has none."""
    path = _file(tmp_path, json.dumps({"req": "b", "tokens": [3, 4, 5], "output_tokens": 2}),
                 "", json.dumps({"req": "a", "tokens": [7]}))
    lines = read_prompts(path)
    assert [(x.req, x.tokens, x.output_tokens, x.prompt) for x in lines] == \
        [("b", (3, 4, 5), 2, 3), ("a", (7,), None, 1)]


@pytest.mark.parametrize(("line", "field"), [
    ("[1, 2]", "JSON object"),
    ('{"tokens": [1]}', "req"),
    ('{"req": "", "tokens": [1]}', "req"),
    ('{"req": "x", "tokens": []}', "tokens"),
    ('{"req": "x", "tokens": [1, true]}', "tokens"),
    ('{"req": "x", "tokens": [1], "output_tokens": 0}', "output_tokens"),
    ('{"req": "x", "tokens": [1], "output_tokens": 1.5}', "output_tokens"),
    ('{"req": "a", "tokens": [1]}', "appears twice"),
    ("{not json", "not valid JSON"),
])
def test_the_first_bad_line_is_named(tmp_path, line, field):
    """A bad second line: the error names line 2 and the rule's field."""
    path = _file(tmp_path, '{"req": "a", "tokens": [1, 2]}', line)
    with pytest.raises(PromptsError, match=f"line 2: .*{field}"):
        read_prompts(path)


def test_empty_and_missing_files_are_refused(tmp_path):
    """A file with no request, and one that cannot be read, name the file."""
    with pytest.raises(PromptsError, match="holds no request"):
        read_prompts(_file(tmp_path, "", "  "))
    with pytest.raises(PromptsError, match="cannot read"):
        read_prompts(tmp_path / "absent.jsonl")


def test_shared_prefix_names_the_request_that_differs(tmp_path):
    """Every prompt must start with the same prefix tokens; the one that does not is named."""
    lines = read_prompts(_file(tmp_path, '{"req": "a", "tokens": [1, 2, 3]}',
                               '{"req": "b", "tokens": [1, 2, 9]}',
                               '{"req": "c", "tokens": [1, 5, 3]}'))
    assert shared_prefix(lines[:2], 2) == (1, 2)
    with pytest.raises(PromptsError, match="'c'"):
        shared_prefix(lines, 2)
    with pytest.raises(PromptsError, match="'a'"):  # c's prefix first: a differs
        shared_prefix(lines[2:] + lines[:2], 2)


def test_both_shells_refuse_a_bad_file_with_the_same_words(tmp_path, capsys):
    """pdsim run and pdgpu serve: exit 2, one line, the same sentence about line 2."""
    path = _file(tmp_path, '{"req": "a", "tokens": [1, 2]}', '{"req": "b", "tokens": [1.5]}')
    assert pdsim_main(["run", "--prompts", str(path)]) == 2
    sim = capsys.readouterr().err.strip()
    assert pdgpu_main(["serve", "--prompts", str(path), "--no-progress"]) == 2
    gpu = capsys.readouterr().err.strip()
    want = f"--prompts: {path} line 2: tokens must be a non-empty list of integers"
    assert len(sim.splitlines()) == len(gpu.splitlines()) == 1
    assert want in sim and want in gpu
