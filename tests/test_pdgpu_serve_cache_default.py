"""The prefix cache is on by default (issue 35): a plain `pdgpu serve` caches and hits,
`--no-prefix-cache` turns it off, and where it cannot apply the default quietly runs without
it (said in the summary and the trace header) while an explicit `--prefix-cache` is refused."""

from __future__ import annotations

import json

import pytest
from serve_helpers import (
    drawn_prompts,
    events_of,
    reference,
    serve,
    trace_ok,
    write_sensitive_checkpoint,
)

from pdgpu.cli import main

CHUNK, PAGE = 16, 8


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A model whose tokens a wrong KV row changes (tiny's often repeat one token)."""
    return str(write_sensitive_checkpoint(tmp_path_factory.mktemp("ckpt") / "sensitive"))


def _repeated(path, out: int) -> list[dict]:
    """Four prompts sharing 48 leading tokens, the last one repeating the first."""
    lines = drawn_prompts(path, 3, [70, 90, 81], 256, 48, out)
    lines.append({**lines[0], "req": "again"})
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return lines


def _served(tmp_path, capsys, *extra: str) -> tuple[dict, list[dict], list[bytes], str]:
    code, results, trace = serve(
        tmp_path, "--prompts", str(tmp_path / "p.jsonl"), "--chunk", str(CHUNK),
        "--page-tokens", str(PAGE), "--concurrency", "1", "--json", *extra)
    out = capsys.readouterr()
    assert code == 0, out.err
    trace_ok(trace)
    return json.loads(out.out), results, trace, out.err


def test_the_cache_is_on_by_default_and_no_prefix_cache_turns_it_off(tmp_path, capsys,
                                                                      checkpoint):
    """Repeated prompts with no cache option hit both caches (the summary and trace say
    so); `--no-prefix-cache` gives the same tokens with no hit, no cache event, a version
    below 4, and a summary and header saying why it was off."""
    lines = _repeated(tmp_path / "p.jsonl", 3)
    runs = {}
    for name, extra in (("default", ()), ("off", ("--no-prefix-cache",))):
        runs[name] = _served(tmp_path, capsys, "--model", checkpoint, *extra)
    on, on_results, on_trace, _ = runs["default"]
    assert on["prefix_cache"] is True and "prefix_cache_off" not in on
    assert on["decoder_cache_hits"] > 0 and on["leaked_pages"] == 0
    assert json.loads(on_trace[0])["version"] == 4
    assert [e for e in events_of(on_trace, "computed") if e.get("hit")]
    assert [e for e in events_of(on_trace, "reserve") if e.get("hit")]
    off, off_results, off_trace, _ = runs["off"]
    header = json.loads(off_trace[0])
    assert off["prefix_cache"] is False and off["prefix_cache_off"] == "--no-prefix-cache"
    assert header["prefix_cache"] is False and header["version"] < 4
    assert "decoder_cache_hits" not in off and off["leaked_pages"] == 0
    assert not events_of(off_trace, "cache") and all(
        e["prefix"] == 0 for e in events_of(off_trace, "reserve"))
    for line, a, b in zip(lines, on_results, off_results, strict=True):
        assert a["output"] == b["output"] == reference(checkpoint, line["tokens"], 3, CHUNK,
                                                       0), line["req"]


def test_the_default_gives_way_to_a_fixed_prefix_with_a_note(tmp_path, capsys, checkpoint):
    """`--prefix P` under the default: served without the automatic cache (one note line on
    stderr, the summary says why), the fixed prefix's tokens as generate gives them."""
    lines = _repeated(tmp_path / "p.jsonl", 2)
    summary, results, trace, err = _served(tmp_path, capsys, "--model", checkpoint,
                                           "--prefix", "16")
    notes = [x for x in err.splitlines() if "prefix cache off" in x]
    assert len(notes) == 1 and "--prefix 16" in notes[0]
    assert summary["prefix_cache"] is False and "--prefix" in summary["prefix_cache_off"]
    assert not events_of(trace, "cache") and all(
        e["prefix"] == 16 for e in events_of(trace, "reserve"))
    for line, r in zip(lines, results, strict=True):
        assert r["output"] == reference(checkpoint, line["tokens"], 2, CHUNK, 16)


def test_where_the_cache_cannot_apply_the_default_serves_without_it(tmp_path, capsys):
    """Qwen3.5 in layer mode: no option serves with the cache off and says why in the
    summary and the trace header; `--prefix-cache` there is refused in one line, exit 2."""
    drawn_prompts(tmp_path / "p.jsonl", 2, [40, 50], 256, 32, 2)
    summary, _, trace, _ = _served(tmp_path, capsys, "--model", "tiny-qwen3.5", "--mode",
                                   "layer")
    header = json.loads(trace[0])
    assert summary["prefix_cache"] is False and header["prefix_cache"] is False
    assert "layer mode" in summary["prefix_cache_off"] == header["prefix_cache_off"]
    assert not events_of(trace, "cache") and summary["leaked_pages"] == 0
    assert main(["serve", "--prompts", str(tmp_path / "p.jsonl"), "--model", "tiny-qwen3.5",
                 "--mode", "layer", "--prefix-cache", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "prefix-cache: refused in layer mode" in err


def test_a_decoder_budget_where_the_cache_cannot_apply_is_refused(capsys):
    """A budget asks for the cache: with --prefix, one line naming it, exit 2 (the default
    alone would have served without the cache)."""
    assert main(["serve", "--requests", "2", "--no-progress", "--prefix", "16",
                 "--decoder-cache-pages", "4"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "prefix-cache: refused with --prefix" in err
