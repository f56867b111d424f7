"""Legal version 4 traces (the prefix cache), built for the tests from the contract's text by a
plain model (dicts of pages, not pdref's code): waves of requests sharing a system prompt, the
decoder and the producer each caching whole pages and hitting them, cancellations whose
writers are fenced late, LRU evictions. The builder also records the *sites* where one edit
breaks one version 4 rule, for the mutation properties of tests/test_pdref_cache.py."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from hybrid_helpers import PAGE, geometries, kv_bytes, linear_runs, state_issue
from hypothesis import strategies as st

from pdref import events as ev
from pdref.geometry import Geometry


@dataclass
class Page:
    """A cached page in the plain model."""

    key: object  # what it holds: ("s", k) page k of the shared prompt, else (request, k)
    first: int
    refs: int = 0
    sliding: bool = True  # holds the sliding layers' KV too
    used: int = 0  # last use, for LRU


@dataclass
class Life:
    req: str
    prompt: int
    prefix: int
    slab: tuple
    hit: tuple
    sources: list = field(default_factory=list)  # producer page ids it copies from
    spans: list = field(default_factory=list)  # (span id, tokens)
    reserve_at: int = 0


def span_bytes(geo: Geometry, layers, tokens, prompt: int, prefix: int) -> int:
    """A KV span's bytes: every layer full without kinds, else per kind (hybrid_helpers)."""
    if geo.kinds is None:
        return geo.bytes_per_token_layer * (layers[1] - layers[0]) * (tokens[1] - tokens[0])
    return kv_bytes(geo, layers, tokens, prompt, prefix)


def window_starts(geo: Geometry, prompt: int, prefix: int) -> list[int]:
    """Where each sliding layer's window starts, from the contract's sentence."""
    out = []
    for kind in geo.kinds or ():
        if kind.kind == "sliding":
            first = max(0, prompt - kind.window + 1)
            out.append(max(prefix, first - first % PAGE))
    return out


class Builder:
    """Writes one legal trace event by event and keeps the plain model's state."""

    def __init__(self, geo: Geometry, pool_pages: int, shared: int, chunk: int) -> None:
        self.geo, self.shared, self.chunk, self.pool_pages = geo, shared, chunk, pool_pages
        self.free = list(range(pool_pages))
        self.landed_at: dict[object, int] = {}  # span id -> index of its land
        self.decoder: dict[int, Page] = {}
        self.producer: dict[str, Page] = {}
        self.events: list = []
        self.sites: dict[str, list] = defaultdict(list)
        self.clock = self.span = self.names = 0
        self.decoder_caches = True
        self.unfenced: list[tuple[str, object, tuple]] = []  # (req, span, source pages read)

    def key(self, req: str, k: int):
        return ("s", k) if (k + 1) * PAGE <= self.shared else (req, k)

    def emit(self, event) -> int:
        self.events.append(event)
        return len(self.events) - 1

    def tick(self) -> float:
        self.clock += 1
        return self.clock * 0.001

    # --- the decoder side -------------------------------------------------------------------

    def decoder_hit(self, req: str, prompt: int) -> list[int]:
        """Leading pages of the prompt the decoder holds, usable by this request's window."""
        by_key = {p.key: pid for pid, p in self.decoder.items()}
        need = min(window_starts(self.geo, prompt, 0), default=prompt)
        out: list[int] = []
        for k in range((prompt - 1) // PAGE):  # at least one token is always computed
            pid = by_key.get(self.key(req, k))
            if pid is None or not (self.decoder[pid].sliding or (k + 1) * PAGE <= need):
                break
            out.append(pid)
        return out

    def evict_for(self, count: int, keep) -> None:
        """Evict least recently used decoder pages nobody holds until `count` are free."""
        idle = sorted((p.used, pid) for pid, p in self.decoder.items()
                      if p.refs == 0 and pid not in keep)
        take = [pid for _, pid in idle[:max(0, count - len(self.free))]]
        if take:
            self.emit(ev.Evict(self.tick(), "room", tuple(take)))
            for pid in take:
                del self.decoder[pid]
            self.free = sorted(self.free + take)

    def reserve(self, req: str, prompt: int, slot) -> Life | None:
        hit = self.decoder_hit(req, prompt)
        prefix = len(hit) * PAGE
        need = -(-(prompt - prefix) // PAGE)
        self.evict_for(need, set(hit))
        if need > len(self.free):
            return None
        idle = [pid for pid in hit if self.decoder[pid].refs == 0]
        slab, self.free = tuple(self.free[:need]), self.free[need:]
        at = self.emit(ev.Reserve(self.tick(), req, prompt, prefix, slab, "p0", slot, tuple(hit)))
        for pid in hit:
            self.decoder[pid].refs += 1
            self.decoder[pid].used = self.clock
        if len(set(hit)) >= 2:
            self.sites["swap_hit"].append(at)
        self.sites["hit_evicted"] += [(at, pid) for pid in idle]
        if prefix == 0 and slab:
            self.sites["hit_uncached"].append((at + 1, slab[0]))
        return Life(req, prompt, prefix, slab, tuple(hit), reserve_at=at)

    def publish_decoder(self, life: Life) -> None:
        """Every whole page of the slab whose content the cache lacks, in runs."""
        have = {p.key for p in self.decoder.values()}
        lo = max(window_starts(self.geo, life.prompt, life.prefix), default=life.prefix)
        run: list[int] = []
        for k in range(life.prefix // PAGE, life.prompt // PAGE + 1):
            new = k < life.prompt // PAGE and self.key(life.req, k) not in have
            if new:
                run.append(k)
                continue
            if run:
                a, b = run[0] * PAGE, (run[-1] + 1) * PAGE
                pages = life.slab[(a - life.prefix) // PAGE:(b - life.prefix) // PAGE]
                at = self.emit(ev.Cache(self.tick(), life.req, (a, b), pages))
                self.sites["cached"].append((at, life, (a, b)))
                writer = next(span for span, tokens in life.spans
                              if tokens is not None and tokens[0] < b and a < tokens[1])
                self.sites["cache_early"].append((at, self.landed_at[writer]))
                for i, pid in enumerate(pages):
                    first = a + i * PAGE
                    self.decoder[pid] = Page(self.key(life.req, first // PAGE), first, 1,
                                             first >= lo, self.clock)
                life.hit += pages  # held like its hit from now on
                run = []

    # --- the producer side ------------------------------------------------------------------

    def producer_hit(self, life: Life) -> int:
        """Copy sources from the producer's cache for [prefix, P): returns P."""
        by_key = {p.key: pid for pid, p in self.producer.items()}
        pages = []
        for k in range(life.prefix // PAGE, life.prompt // PAGE):
            pid = by_key.get(self.key(life.req, k))
            if pid is None:
                break
            pages.append(pid)
        if not pages:
            return life.prefix
        end = life.prefix + len(pages) * PAGE
        at = self.emit(ev.Computed(self.tick(), life.req, (0, self.geo.layers),
                                   (life.prefix, end), tuple(pages)))
        for pid in pages:
            self.producer[pid].refs += 1
        life.sources += pages
        self.sites["sources_held"].append((at, life, tuple(pages)))
        return end

    def publish_producer(self, life: Life, start: int) -> None:
        have = {p.key for p in self.producer.values()}
        ks = [k for k in range(start // PAGE, life.prompt // PAGE)
              if self.key(life.req, k) not in have]
        if not ks or ks != list(range(ks[0], ks[-1] + 1)):
            return
        names = tuple(f"s{self.names + i}" for i in range(len(ks)))
        self.names += len(ks)
        self.emit(ev.Cache(self.tick(), life.req, (ks[0] * PAGE, (ks[-1] + 1) * PAGE), names,
                           "p0"))
        for k, name in zip(ks, names, strict=True):
            self.producer[name] = Page(self.key(life.req, k), k * PAGE, 1)
        life.sources += names

    # --- a life's work ----------------------------------------------------------------------

    def send(self, life: Life, tokens, state_layers=None) -> None:
        span = self.span
        self.span += 1
        if state_layers is not None:
            self.emit(state_issue(self.tick(), life.req, span, self.geo, state_layers,
                                  life.prompt))
        else:
            self.emit(ev.Issue(self.tick(), life.req, span, (0, self.geo.layers), tokens,
                               span_bytes(self.geo, (0, self.geo.layers), tokens, life.prompt,
                                          life.prefix)))
        life.spans.append((span, tokens))

    def work(self, life: Life) -> None:
        """Compute what neither cache holds, send the suffix, then each state."""
        L = self.geo.layers
        start = self.producer_hit(life)
        if start > life.prefix:
            self.send(life, (life.prefix, start))
        for a in range(start, life.prompt, self.chunk):
            b = min(life.prompt, a + self.chunk)
            self.emit(ev.Computed(self.tick(), life.req, (0, L), (a, b)))
            self.send(life, (a, b))
        for run in linear_runs(self.geo) if self.geo.kinds else ():
            self.send(life, None, run)
        self.publish_producer(life, start)

    def finish(self, life: Life) -> None:
        t = self.tick()
        for span, _ in life.spans:
            self.landed_at[span] = self.emit(ev.Land(t, life.req, span))
        self.emit(ev.Produced(t, life.req, 1))
        self.emit(ev.Admit(t, life.req))
        if self.decoder_caches:
            self.publish_decoder(life)
        self.emit(ev.Reuse(self.tick(), life.req, (0, life.prompt)))
        for pid in life.sources:
            self.producer[pid].refs -= 1

    def cancel(self, life: Life) -> None:
        """Aborted with every span in flight: the writers are fenced at the wave's end."""
        at = self.emit(ev.Abort(self.tick(), life.req, "cancelled"))
        for span, tokens in life.spans:
            read = tuple(pid for pid in life.sources if tokens is not None
                         and tokens[0] < self.producer[pid].first + PAGE
                         and self.producer[pid].first < tokens[1])
            self.unfenced.append((life.req, span, read))
            self.sites["pinned"] += [(at + 1, pid) for pid in read]
        self.end(life, at)

    def end(self, life: Life, aborted_at: int | None = None) -> None:
        stop = len(self.events) if aborted_at is None else aborted_at
        if aborted_at is None:
            self.emit(ev.Release(self.tick(), life.req))
        else:  # the producer pages its unfenced spans read stay held until their fences
            for req, _, read in self.unfenced:
                for pid in read if req == life.req else ():
                    self.producer[pid].refs += 1
            for pid in life.sources:
                self.producer[pid].refs -= 1
        published = set(life.hit) - set(life.hit[:life.prefix // PAGE])
        for pid in life.hit:
            self.decoder[pid].refs -= 1
        self.free = sorted(self.free + [p for p in life.slab if p not in published])
        self.sites["held_decoder"] += [(life.reserve_at + 1, stop, pid)
                                       for pid in life.hit[:life.prefix // PAGE]]

    def fence_all(self) -> None:
        for req, span, read in self.unfenced:
            self.emit(ev.Fence(self.tick(), req, span))
            for pid in read:
                self.producer[pid].refs -= 1
        self.unfenced = []

    def evict_producer_idle(self) -> None:
        idle = tuple(pid for pid, p in self.producer.items() if p.refs == 0)
        if idle:
            self.emit(ev.Evict(self.tick(), "room", idle, "p0"))
            for pid in idle:
                del self.producer[pid]


@st.composite
def cache_traces(draw, hybrid=None, decoder=None, min_shared=0, min_waves=1, cancel_odds=5):
    """(header, events, sites) of one legal version 4 trace: waves of 1 to 3 requests
    sharing a system prompt, some cancelled (1 in `cancel_odds`), with LRU evictions of both
    caches. `decoder`: whether the decoder caches (None: drawn); `min_shared`, `min_waves`,
    `cancel_odds` bias the draw towards a property's sites."""
    if hybrid is None:
        hybrid = draw(st.booleans(), "hybrid")
    geo = draw(geometries()) if hybrid else Geometry(2, 1, 2, 1, PAGE)
    shared = draw(st.integers(min_shared, 24), "shared prompt")
    builder = Builder(geo, draw(st.integers(6, 24), "pool pages"), shared,
                      draw(st.integers(1, 12), "chunk"))
    # a decoder that caches nothing leaves the producer's hits to show (copy sources)
    builder.decoder_caches = (draw(st.sampled_from([True, True, False]), "decoder caches?")
                              if decoder is None else decoder)
    serial = 0
    for _ in range(draw(st.integers(min_waves, 5), "waves")):
        wave = []
        for slot in range(draw(st.integers(1, 3), "wave size")):
            prompt = shared + draw(st.integers(1, 12), "own tokens")
            life = builder.reserve(f"r{serial}", prompt, slot if geo.recurrent else None)
            serial += 1
            if life is not None:
                wave.append(life)
        cancelled = [draw(st.integers(0, cancel_odds - 1), "cancel?") == 0 for _ in wave]
        for life, gone in zip(wave, cancelled, strict=True):
            builder.work(life)
            if gone:
                builder.cancel(life)
            else:
                builder.finish(life)
        for life, gone in zip(wave, cancelled, strict=True):
            if not gone:
                builder.end(life)
        builder.fence_all()
        if draw(st.booleans(), "evict producer pages?"):
            builder.evict_producer_idle()
    header = ev.Header("test", "chunk", geo, pool_pages=builder.pool_pages, max_pending=64,
                       version=4)
    return header, builder.events, builder.sites
