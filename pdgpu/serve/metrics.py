"""`GET /metrics` of `pdgpu serve --http`: Prometheus text through `prometheus-client`.

Every value is written by the decoder thread (frontend.pump, once a turn) or by the HTTP
thread for requests refused at the door; the client library's metrics are thread-safe, and
the HTTP thread never reads the decoder's state itself (it changes under it). Times are the
run clock's, as in `pdgpu serve --json`: TTFT from arrival to the first token, ITL between
tokens, handoff from a life's slab reserved to the request's admission. Each server has its
own registry (tests start several in one process).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                   10.0, 30.0)


class ServeMetrics:
    def __init__(self, prefix_cache: bool = False) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("pdgpu_requests", "Requests by outcome (ok, cancelled, "
                                "failed; rejected: refused at the door: 400, 429, 503)",
                                ["outcome"], registry=r)
        self.ttft = Histogram("pdgpu_ttft_seconds", "Arrival to first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("pdgpu_itl_seconds", "Between two tokens of a request",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.handoff = Histogram("pdgpu_handoff_seconds", "Slab reserved to admission",
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.pages = Gauge("pdgpu_pool_pages_in_use", "Decoder pool pages not free "
                           "(held or quarantined; idle prefix-cache pages, which a request "
                           "takes when it needs room, are not counted)", registry=r)
        self.cached = Gauge("pdgpu_pool_pages_cached", "Decoder pool pages in its prefix "
                            "cache (held by a request or idle)", registry=r)
        self.pool = Gauge("pdgpu_pool_pages", "Decoder pool pages in all", registry=r)
        self.spans = Gauge("pdgpu_spans_in_flight", "Spans issued, not landed or fenced",
                           registry=r)
        self.queued = Gauge("pdgpu_requests_in_system", "Submitted and not ended", registry=r)
        self.producers = Gauge("pdgpu_producers_serving", "Producers serving now", registry=r)
        self.deaths = Counter("pdgpu_producer_deaths", "Producers declared dead", registry=r)
        self.violations = Counter("pdgpu_live_check_violations", "Events the live check "
                                  "refused (each one stops the run)", registry=r)
        # vLLM's names and help (vllm/v1/metrics/loggers.py), in tokens: each request's prompt
        # as looked up in its producer's cache, and the leading tokens found there (counted
        # with --prefix-cache only, as vLLM counts with prefix caching enabled only)
        self.prefix_queries = Counter("vllm:prefix_cache_queries", "Prefix cache queries, in "
                                      "terms of number of queried tokens.", registry=r)
        self.prefix_hits = Counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of "
                                   "number of cached tokens.", registry=r)
        self.decoder_hits = Counter("pdgpu_decoder_prefix_cache_hits", "Prompt tokens found "
                                    "in the decoder's prefix cache (their KV did not cross)",
                                    registry=r)
        self.prefix_cache_on = prefix_cache
        for outcome in ("ok", "cancelled", "failed", "rejected"):
            self.requests.labels(outcome)  # shown at 0 from the start
        self._deaths_seen = 0

    def text(self) -> bytes:
        return generate_latest(self.registry)

    # -- from the decoder thread --------------------------------------------------------------

    def first_token(self, t) -> None:
        """TTFT: arrival to `produced` (the first token's time, before or at admission)."""
        first = t.token_t[0] if t.token_t else t.life.produced_t
        self.ttft.observe(first - t.arrival)

    def prefix_cache(self, t) -> None:
        """An admitted request's prompt, as its producer looked it up in its cache, and what
        the decoder's cache held of it."""
        if self.prefix_cache_on:
            self.prefix_queries.inc(len(t.request.tokens))
            self.prefix_hits.inc(t.producer_hit)
            self.decoder_hits.inc(t.decoder_hit)

    def admitted(self, t) -> None:
        if t.reserved_t is not None:
            self.handoff.observe(t.admitted_t - t.reserved_t)

    def later_tokens(self, t, start: int, end: int) -> None:
        """ITL of tokens [start, end) (the first has none)."""
        times = t.token_t
        for i in range(max(1, start), min(end, len(times))):
            self.itl.observe(times[i] - times[i - 1])

    def ended(self, t) -> None:
        self.requests.labels(str(t.status)).inc()

    def sample(self, decoder, in_system: int) -> None:
        """The gauges, from the decoder's state (its own thread, once a turn)."""
        ledger, members, cache = decoder.ledger, decoder.members, decoder.prefix_cache
        idle = 0 if cache is None else len(cache.index.idle())
        self.pages.set(ledger.used_pages - idle)
        self.cached.set(0 if cache is None else len(cache.index))
        self.pool.set(ledger.header.pool_pages)
        self.spans.set(sum(1 for life in decoder.lives.values()
                           for span in life.spans.values() if span is not None))
        self.queued.set(in_system)
        self.producers.set(len(members.ready()))
        if members.deaths > self._deaths_seen:
            self.deaths.inc(members.deaths - self._deaths_seen)
            self._deaths_seen = members.deaths
