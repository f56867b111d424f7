"""pdsim's prefix caches held to `pdgpu serve`'s on a small conversation: each turn resends
the one before plus new tokens, one request at a time (so which pages each side holds does
not depend on timing), the decoder's cache large and the producer's two pages. The decoder
then holds more of each prompt than the producer: both compute, cache and send the same
tokens, life by life (docs/prefix-cache.md, issue 35 item 4)."""

from __future__ import annotations

import json
import random
from collections import defaultdict

import pytest
from serve_helpers import serve, trace_ok

from pdref.models import load_model
from pdref.trace import parse_lines
from pdsim.core.config import RequestSpec, SimConfig
from pdsim.core.costs import costs_for, engine_of, sim_geometry
from pdsim.core.play import simulate
from pdsim.core.profiles import link_of, load_hw

CHUNK, PAGE, PRODUCER_PAGES, DECODER_PAGES, OUT = 32, 16, 2, 64, 2


def _conversation(path, turns: int = 5) -> list[int]:
    """A prompts file whose every prompt is the one before and 10..40 new tokens; the
    prompts' lengths."""
    rng, tokens, lines = random.Random(7), [], []
    for k in range(turns):
        tokens = tokens + [rng.randrange(256) for _ in range(rng.randint(10, 40) + 40 * (k == 0))]
        lines.append({"req": f"c0t{k}", "tokens": tokens, "output_tokens": OUT})
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return [len(x["tokens"]) for x in lines]


def _lives(events) -> dict:
    """req -> (reserve prefix, producer hit end, computed regions, tokens the producer
    cached, KV span regions), from a trace's events."""
    out = defaultdict(lambda: [0, 0, [], [], []])
    for e in events:
        if e.kind == "evict":  # (the engine's run ends evicting every cached page)
            continue
        life, region = out[e.req], (tuple(e.layers), tuple(e.tokens)) \
            if hasattr(e, "layers") else None
        if e.kind == "reserve":
            life[0] = e.prefix
        elif e.kind == "computed" and e.hit:
            life[1] = e.tokens[1]
        elif e.kind == "computed":
            life[2].append(region)
        elif e.kind == "cache" and e.producer:
            life[3].append(tuple(e.tokens))
        elif e.kind == "issue":
            life[4].append(region)
    return {req: (d, p, sorted(c), sorted(k), sorted(s)) for req, (d, p, c, k, s) in out.items()}


def _simulated(mode: str, prompts: list[int], pool_pages: int) -> dict:
    """pdsim's lives for the same conversation, caches and pool, one request at a time."""
    hw = load_hw("a100-pcie")
    spec = load_model("tiny")
    cfg = SimConfig(sim_geometry(spec, PAGE), costs_for(spec, hw, link_of(hw), engine_of(hw)),
                    mode, CHUNK, pool_pages=pool_pages, concurrency=1, sender="queued",
                    decoder_cache_pages=DECODER_PAGES, producer_cache_pages=PRODUCER_PAGES)
    requests = [RequestSpec(f"c0t{k}", 0.0, n, 0, OUT, session="c0")
                for k, n in enumerate(prompts)]
    return _lives(e for e in simulate(cfg, requests).protocol if hasattr(e, "req"))


@pytest.mark.timeout(360)  # a hang guard, not a clock: 17 s (the first) at load 10
@pytest.mark.parametrize("mode", ["chunk", "layer"])
def test_pdsim_computes_caches_and_sends_what_the_engine_does(tmp_path, capsys, mode):
    """Life by life the decoder's prefix, the producer's hit, the regions computed (the
    decoder's tokens the producer lacks included), the pages the producer caches and the
    spans are pdgpu serve's; the decoder holds more than the producer in later turns."""
    prompts = _conversation(tmp_path / "p.jsonl")
    code, results, trace = serve(
        tmp_path, "--model", "tiny", "--prompts", str(tmp_path / "p.jsonl"), "--chunk",
        str(CHUNK), "--page-tokens", str(PAGE), "--mode", mode, "--concurrency", "1",
        "--prefix-cache", "--prefix-cache-pages", str(PRODUCER_PAGES),
        "--decoder-cache-pages", str(DECODER_PAGES), "--json")
    capsys.readouterr()
    trace_ok(trace)
    assert code == 0 and all(r["status"] == "ok" for r in results)
    header, *events = [e for _, e in parse_lines(trace)]
    engine = _lives(e for e in events if hasattr(e, "req"))
    assert any(d > p for d, p, *_ in engine.values())  # the case this test is for
    assert _simulated(mode, prompts, header.pool_pages) == engine
