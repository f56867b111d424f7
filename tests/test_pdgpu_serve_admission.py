"""pdgpu serve's admission copies a request's context once into decode memory: the bytes the
decoder's `_admit` copies (every op that writes K/V or state from another tensor) equal its
context's K/V once (of a sliding layer only the window the decode step reads) and, of a
hybrid with linear layers, nothing of its state (landed where the decode step reads it)."""

from __future__ import annotations

import pytest
from admission_helpers import context_bytes
from serve_helpers import drawn_prompts, events_of, reference, serve, trace_ok

from pdgpu.op_count import bytes_copied
from pdgpu.serve.decoder import Decoder

CHUNK = 16
LENGTHS = (40, 57)  # longer than tiny-gemma3's window (16)


@pytest.mark.parametrize("prefix", ["no-prefix", "prefix", "prefix-cache"])
@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen3.5", "tiny-gemma3"])
def test_admission_copies_the_context_once_into_decode_memory(tmp_path, monkeypatch, preset,
                                                               prefix):
    """One request at a time (each admitted into an empty decode cache, so no bucket grows
    meanwhile), with no prefix, the fixed `--prefix`, or the decoder's cache (the second
    request hits the first's shared page): each admission copies exactly its context's K/V
    once, its state not at all; the served tokens still equal `pdgpu generate`'s."""
    copied: dict[str, int] = {}
    admit = Decoder._admit

    def counted(self, t):
        copied[t.req] = bytes_copied(admit, self, t)[1]
    monkeypatch.setattr(Decoder, "_admit", counted)
    shared = 0 if prefix == "no-prefix" else 16  # leading tokens both prompts share
    fixed = shared if prefix == "prefix" else 0
    prompts = drawn_prompts(tmp_path / "p.jsonl", 2, LENGTHS, 256, shared, 3)
    args = {"no-prefix": ["--no-prefix-cache"], "prefix": ["--prefix", str(fixed)],
            "prefix-cache": []}[prefix]  # the cache: on by default
    code, results, trace = serve(
        tmp_path, "--model", preset, "--prompts", str(tmp_path / "p.jsonl"), "--chunk",
        str(CHUNK), "--concurrency", "1", *args)
    assert code == 0
    trace_ok(trace)
    hits = [e for e in events_of(trace, "reserve") if e.get("hit")]
    assert len(hits) == (prefix == "prefix-cache")
    for line, result in zip(prompts, results, strict=True):
        assert result["output"] == reference(preset, line["tokens"], 3, CHUNK, fixed)
        assert copied[line["req"]] == context_bytes(preset, len(line["tokens"])), line["req"]
