"""`pdgpu serve --http` with its prefix cache, on by default (issue 35 item 3):
`usage.prompt_tokens_details.cached_tokens` in both endpoints, streamed and not, and vLLM's
prefix-cache counters on /metrics, each held against the trace's `computed.hit` (what the
producer did not compute) and against `pdgpu generate`'s tokens; `--no-prefix-cache`: 0."""

from __future__ import annotations

import json

import pytest
from serve_helpers import reference, trace_ok, write_sensitive_checkpoint
from test_pdgpu_http import CHUNK, Server, token_ids, write_tokenizer

PROMPT = list(range(60, 110))  # 50 tokens: 3 whole chunks of 16 can be skipped, not the 4th


CHAT = [{"role": "user", "content": " ".join(["the quick brown fox"] * 9)}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A server with no cache option (the cache on by default): a prompt twice, then
    streamed; a chat twice (requests h0..h4, one at a time); its /metrics at the end;
    stopped, its trace checked."""
    tmp = tmp_path_factory.mktemp("http-cache")
    folder = write_sensitive_checkpoint(tmp / "ckpt")
    write_tokenizer(folder, vocab=256)
    srv = Server(tmp, str(folder), "--http-max-prompt", "96")
    try:
        client, model = srv.client(), srv.model_id
        got = [client.completions.create(model=model, prompt=PROMPT, max_tokens=6)
               for _ in range(2)]
        got.append(list(client.completions.create(
            model=model, prompt=PROMPT, max_tokens=6, stream=True,
            stream_options={"include_usage": True})))
        got += [client.chat.completions.create(model=model, max_tokens=3, messages=CHAT)
                for _ in range(2)]
        metrics = srv.metrics()
    finally:
        code, values = srv.stop()
    assert code == 143 and values["leaked_pages"] == 0, (code, values)
    trace_ok(srv.trace.read_bytes().splitlines())  # every event legal (contract v4)
    return srv, got, metrics


def hits_in_trace(server) -> dict[str, int]:
    """req -> prompt tokens its producer found cached (`computed` with `hit`)."""
    hits: dict[str, int] = {}
    for line in server.trace.read_text().splitlines()[1:]:
        e = json.loads(line)
        if e["kind"] == "computed" and e.get("hit"):
            hits[e["req"]] = hits.get(e["req"], 0) + e["tokens"][1] - e["tokens"][0]
    return hits


def usages(got) -> list:
    return [g[-1].usage if isinstance(g, list) else g.usage for g in got]


def counters(metrics: dict) -> tuple[float, float]:
    return metrics["vllm:prefix_cache_queries_total{}"], metrics["vllm:prefix_cache_hits_total{}"]


def test_cached_tokens_are_what_each_producer_skipped(served):
    """Each request's cached_tokens (streamed usage too) is the trace's hit for it: none the
    first time, then the whole chunks the producer held (at least one token computed)."""
    srv, got, _ = served
    cached = [u.prompt_tokens_details.cached_tokens for u in usages(got)]
    hits = hits_in_trace(srv)
    assert cached == [hits.get(f"h{i}", 0) for i in range(5)]
    chat_prompt = got[3].usage.prompt_tokens
    assert cached == [0, 48, 48, 0, (chat_prompt - 1) // CHUNK * CHUNK]


def test_hits_change_no_token(served):
    """The tokens of a cache hit are `pdgpu generate`'s, as without one."""
    srv, got, _ = served
    want = reference(srv.model, PROMPT, 6, CHUNK, 0)
    assert token_ids(got[0].choices[0]) == token_ids(got[1].choices[0]) == want
    assert [token_ids(e.choices[0])[0] for e in got[2] if e.choices and
            token_ids(e.choices[0])] == want
    assert got[3].choices[0].message.content == got[4].choices[0].message.content


def test_metrics_count_prompts_queried_and_tokens_cached(served):
    """vllm:prefix_cache_queries counts every prompt token looked up, vllm:prefix_cache_hits
    the cached ones (the usages' sum); pdgpu_decoder_prefix_cache_hits the tokens the
    decoder held (the trace's reserve prefixes), some here."""
    srv, got, metrics = served
    assert counters(metrics) == (sum(u.prompt_tokens for u in usages(got)),
                                 sum(u.prompt_tokens_details.cached_tokens for u in usages(got)))
    prefixes = [json.loads(line)["prefix"] for line in srv.trace.read_text().splitlines()[1:]
                if '"kind":"reserve"' in line]
    assert metrics["pdgpu_decoder_prefix_cache_hits_total{}"] == sum(prefixes) > 0


def test_without_the_cache_nothing_is_cached_or_counted(tmp_path):
    """`--no-prefix-cache`: a repeated prompt reports 0 cached tokens and vLLM's prefix cache
    counters (shown, as vLLM shows them) count nothing."""
    srv = Server(tmp_path, "tiny", "--http-max-prompt", "64", "--no-prefix-cache")
    try:
        for _ in range(2):
            got = srv.client().completions.create(model="tiny", prompt=PROMPT, max_tokens=2)
            assert got.usage.prompt_tokens_details.cached_tokens == 0
        metrics = srv.metrics()
    finally:
        code, values = srv.stop()
    assert code == 143 and values["prefix_cache"] is False
    assert counters(metrics) == (0, 0) and metrics["pdgpu_decoder_prefix_cache_hits_total{}"] == 0
    assert metrics["pdgpu_pool_pages_cached{}"] == 0
