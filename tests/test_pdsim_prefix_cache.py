"""pdsim's prefix cache on both sides (contract v4) and its multi-turn workload: sessions
whose turns resend the conversation, legal version 4 traces in every mode and model kind,
only the KV the decoder lacks crossing, the producer computing only what it lacks, LRU
under each side's page budget, and the what-if over cache sizes."""

from __future__ import annotations

import json
from collections import defaultdict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdref.check import check_file
from pdref.models import load_model
from pdref.trace import read_trace
from pdsim.cli import main
from pdsim.core.config import SimConfig
from pdsim.core.costs import costs_for, engine_of, sim_geometry
from pdsim.core.play import simulate
from pdsim.core.profiles import link_of, load_hw
from pdsim.core.sessions import SessionSpec, SessionWorkload

SESSIONS = ["--sessions", "6", "--turns", "3", "--system-prompt", "1024", "--turn-tokens",
            "40:200", "--output-tokens", "24", "--think", "0.2", "--rate", "20",
            "--chunk", "128"]


def _run(tmp_path, capsys, *args, name="t"):
    """`pdsim run --json --trace` of the arguments: (metrics, header, events), the trace
    checked by pdref."""
    trace = tmp_path / f"{name}.jsonl"
    assert main(["run", "--json", "--no-progress", "--trace", str(trace), *args]) == 0
    out = json.loads(capsys.readouterr().out)
    result = check_file(trace)
    assert result.ok, result.text()
    header, *events = [item for _, item in read_trace(trace)]
    return out, header, events


def test_a_turn_resends_the_conversation():
    """Turn k + 1's prompt is turn k's, its answer and new user tokens; sessions share the
    system prompt; the later turns wait for the one before (followups); seeded."""
    spec = SessionSpec(3, 4, system=100, user=(5, 9), output=(2, 4), think_s=0.5, seed=3)
    work = SessionWorkload(spec)
    assert len(work) == 12 and [r.req for r in work] == ["s0t0", "s1t0", "s2t0"]
    for turn in work.all_turns():
        follow = work.followups.get(turn.req)
        if follow is None:
            assert turn.req.endswith("t3")
            continue
        think, after = follow
        assert think >= 0 and after.session == turn.session and after.system == 100
        assert 5 <= after.prompt - turn.prompt - turn.output_tokens <= 9
    again = SessionWorkload(spec)
    assert again.all_turns() == work.all_turns() and again.followups == work.followups


@pytest.mark.parametrize("model", ["qwen3-0.6b", "qwen3.5-27b", "gemma-3-27b"])
@pytest.mark.parametrize("mode", ["whole", "chunk", "layer"])
def test_cached_sessions_are_legal_and_hand_off_less(model, mode, tmp_path, capsys):
    """Every model kind and mode: the cached run's trace is a legal version 4 trace with
    hits on both sides, it leaks no page, and it hands off fewer bytes than the same
    sessions without a cache (whose trace stays version 2 or 3)."""
    args = [*SESSIONS, "--model", model, "--mode", mode]
    off, head_off, _ = _run(tmp_path, capsys, *args, name="off")
    on, head, events = _run(tmp_path, capsys, *args, "--prefix-cache", name="on")
    assert head.version == 4 and head_off.version < 4
    assert any(e.kind == "reserve" and e.hit for e in events)
    assert on["prefix_cache_hits"] > 0 and on["leaked_pages"] == 0
    assert on["bytes"] < off["bytes"] and on["ok"] == off["ok"] == 18


def test_the_producer_computes_only_what_it_lacks(tmp_path, capsys):
    """A producer cache alone (the decoder's 0 pages): every suffix still crosses (the
    bytes of the uncached run), but tokens found in the producer's cache are a copy
    source (`computed` with `hit`), not computed: fewer tokens computed in all."""
    off, _, plain = _run(tmp_path, capsys, *SESSIONS, name="off")
    on, _, cached = _run(tmp_path, capsys, *SESSIONS, "--decoder-cache-pages", "0",
                         "--producer-cache-pages", "4096", name="on")

    def computed(events):
        return sum(e.tokens[1] - e.tokens[0] for e in events
                   if e.kind == "computed" and not getattr(e, "hit", None))

    assert on["bytes"] == off["bytes"]
    assert on["producer_prefix_cache_hits"] > 0
    assert computed(cached) < computed(plain)


def _computed_from(events, layers: int) -> dict:
    """req -> (its producer hit's end, the prompt tokens it computed at every layer, where
    its computing started)."""
    out = {}
    for e in events:
        if e.kind != "computed":
            continue
        hit, done, first = out.get(e.req, (0, 0, None))
        if getattr(e, "hit", None):
            assert e.tokens[0] == 0, e
            hit = e.tokens[1]
        else:
            done += (e.tokens[1] - e.tokens[0]) * (e.layers[1] - e.layers[0])
            first = e.tokens[0] if first is None else min(first, e.tokens[0])
        out[e.req] = (hit, done, first)
    return {req: (hit, done / layers, first) for req, (hit, done, first) in out.items()}


def _assert_computes_all_but_its_own_hit(events, layers: int) -> None:
    """Each life computes exactly [P, prompt) of every layer, P being its producer's own
    hit (whatever the decoder holds), and its KV spans carry [prefix, prompt) of a full
    layer at most, never a token below its prefix."""
    reserves = {e.req: e for e in events if e.kind == "reserve"}
    for req, (hit, done, first) in _computed_from(events, layers).items():
        assert first == hit and done == reserves[req].prompt - hit, req
    for e in events:
        if e.kind == "issue" and not e.state and e.tokens[0] < e.tokens[1]:
            assert e.tokens[0] >= reserves[e.req].prefix, e


@pytest.mark.parametrize("mode", ["whole", "chunk", "layer"])
def test_the_producer_computes_what_the_decoder_holds_and_it_lacks(mode, tmp_path, capsys):
    """The decoder caches, the producer cannot (0 pages): a later turn's prefix is the
    decoder's, so only the rest crosses, but its producer computes the whole prompt, as
    pdgpu's does (attention over the rest needs the prefix's KV on the producer)."""
    args = [*SESSIONS, "--mode", mode, "--decoder-cache-pages", "4096",
            "--producer-cache-pages", "0"]
    out, header, events = _run(tmp_path, capsys, *args)
    reserves = [e for e in events if e.kind == "reserve"]
    assert out["prefix_cache_hits"] > 0 and any(e.prefix for e in reserves)
    computed = _computed_from(events, header.geometry.layers)
    assert {req: (hit, done) for req, (hit, done, _) in computed.items()} == \
        {e.req: (0, e.prompt) for e in reserves}
    _assert_computes_all_but_its_own_hit(events, header.geometry.layers)
    per_token = header.geometry.bytes_per_token_layer * header.geometry.layers
    assert out["bytes"] == sum(e.prompt - e.prefix for e in reserves) * per_token


def test_a_producer_hit_ends_where_a_chunk_ends(tmp_path, capsys):
    """pdgpu's exact-tokens rule: a producer's hit ends at a multiple of the chunk (96 here,
    six pages), so its prefill computes the chunks an uncached prefill computes; it caches
    only pages inside the prompt's whole chunks."""
    args = [*SESSIONS[:-1], "96", "--decoder-cache-pages", "0", "--producer-cache-pages",
            "4096"]
    out, _, events = _run(tmp_path, capsys, *args)
    hits = [e for e in events if e.kind == "computed" and getattr(e, "hit", None)]
    assert hits and out["producer_prefix_cache_hits"] > 0
    assert all(e.tokens[0] == 0 and e.tokens[1] % 96 == 0 for e in hits)
    prompts = {e.req: e.prompt for e in events if e.kind == "reserve"}
    cached = [e for e in events if e.kind == "cache" and getattr(e, "producer", None)]
    assert cached and all(e.tokens[1] <= prompts[e.req] // 96 * 96 for e in cached)


def test_the_decoder_hits_and_caches_whole_chunks(tmp_path, capsys):
    """pdgpu's decoder: a reserve's prefix is whole chunks (96 here), and it caches only a
    slab's pages inside the prompt's whole chunks."""
    args = [*SESSIONS[:-1], "96", "--decoder-cache-pages", "4096", "--producer-cache-pages",
            "0"]
    out, _, events = _run(tmp_path, capsys, *args)
    reserves = {e.req: e for e in events if e.kind == "reserve"}
    assert out["prefix_cache_hits"] > 0
    assert all(e.prefix % 96 == 0 for e in reserves.values())
    cached = [e for e in events if e.kind == "cache" and not getattr(e, "producer", None)]
    assert cached and all(e.tokens[1] <= reserves[e.req].prompt // 96 * 96 for e in cached)


@pytest.mark.parametrize("budget", [4, 40])
def test_each_cache_stays_within_its_budget(budget, tmp_path, capsys):
    """Counting `cache` minus `evict` pages per cache along the trace: never above the
    budget; with a small budget pages are evicted (LRU) and the run stays legal."""
    _, _, events = _run(tmp_path, capsys, *SESSIONS, "--decoder-cache-pages", str(budget),
                        "--producer-cache-pages", str(budget))
    held, evicted = defaultdict(int), 0
    for e in events:
        if e.kind in ("cache", "evict"):
            owner = e.producer or ""
            held[owner] += len(e.pages) if e.kind == "cache" else -len(e.pages)
            evicted += e.kind == "evict"
            assert held[owner] <= budget
    assert evicted > 0 or budget > 4


def test_a_turn_arrives_after_the_previous_one_and_its_think_time(tmp_path, capsys):
    """Each later turn reserves only after the turn before it was released."""
    _, _, events = _run(tmp_path, capsys, *SESSIONS, "--prefix-cache")
    released = {e.req: e.t for e in events if e.kind == "release"}
    for e in events:
        if e.kind == "reserve" and not e.req.endswith("t0"):
            session, turn = e.req.split("t")
            assert e.t >= released[f"{session}t{int(turn) - 1}"]


def test_the_whatif_compares_cache_sizes(capsys):
    """`pdsim cache`: one row per size; no cache hits nothing, a large one hits, computes
    and hands off less."""
    assert main(["cache", "--json", *SESSIONS, "--cache-pages", "0,4096"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["cache_pages"] for r in rows] == [0, 4096]
    assert rows[0]["prefix_cache_hit_rate"] == 0 and rows[1]["prefix_cache_hit_rate"] > 0
    assert rows[1]["bytes"] < rows[0]["bytes"]


@pytest.mark.parametrize("args, words", [
    (["--sessions", "0"], "--sessions must be >= 1"),
    (["--sessions", "2", "--turn-tokens", "5:1"], "--turn-tokens must be A:B"),
    (["--sessions", "2", "--prompt", "100"], "--sessions draws its own prompts"),
    (["--prefix-cache", "--prefix", "16", "--prompt", "64"], "cache finds each request"),
    (["--decoder-cache-pages", "-1"], "--decoder-cache-pages must be"),
    (["--sessions", "2", "--prefix-cache", "--fail-rate", "0.1"], "faults"),
])
def test_bad_session_and_cache_options_are_refused(args, words, capsys):
    """A bad option is one line naming it, exit 2."""
    assert main(["run", *args]) == 2
    err = capsys.readouterr().err
    assert words in err and len(err.strip().splitlines()) == 1


def test_a_streamed_run_reports_what_a_traced_one_does(tmp_path, capsys):
    """`pdsim run` of cached sessions without a trace (streamed: followups and caches while
    only what is in flight is kept) prints the traced run's figures."""
    traced, _, _ = _run(tmp_path, capsys, *SESSIONS, "--prefix-cache")
    assert main(["run", "--json", "--no-progress", *SESSIONS, "--prefix-cache"]) == 0
    streamed = json.loads(capsys.readouterr().out)
    for key in ("requests", "ok", "bytes", "ttft_p50_s", "ttft_p99_s", "tokens_per_s",
                "prefix_cache_hits", "producer_prefix_cache_hits", "leaked_pages"):
        assert streamed[key] == traced[key], key


A100 = load_hw("a100-pcie")
COSTS = {m: costs_for(load_model(m), A100, link_of(A100), engine_of(A100, None))
         for m in ("qwen3-0.6b", "gemma-3-27b", "qwen3.5-27b")}


@settings(max_examples=15, deadline=None)
@given(st.sampled_from(sorted(COSTS)), st.sampled_from(["whole", "chunk", "layer"]),
       st.integers(0, 48), st.integers(0, 48), st.integers(100, 160), st.integers(0, 1200),
       st.integers(1, 2), st.integers(0, 9))
def test_any_cache_budget_pool_and_session_mix_is_legal(model, mode, decoder, producer, pool,
                                                        system, producers, seed):
    """Random budgets (tiny ones evict all the time), pools, system prompts and producers:
    every event passes pdref's live check (a Violation would raise), every turn ends ok and
    no page leaks."""
    geo = sim_geometry(load_model(model), 16)
    cfg = SimConfig(geo, COSTS[model], mode, 64, pool_pages=pool, producers=producers,
                    decoder_cache_pages=decoder, producer_cache_pages=producer)
    work = SessionWorkload(SessionSpec(4, 3, system, (8, 60), (4, 20), 0.05, 30.0, seed=seed))
    result = simulate(cfg, work)
    _assert_computes_all_but_its_own_hit(result.protocol, geo.layers)
    assert result.leaked_pages == 0 and len(result.requests) == 12
    assert sum(e.kind == "release" for e in result.protocol) == 12
    assert result.header.version == 4
