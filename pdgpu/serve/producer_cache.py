"""A serving producer's automatic prefix cache (`--prefix-cache`, contract v4): what it
finds, computes, sends and keeps for one life, and the messages that make each of those a
trace event through the decoder's ledger (checked live there, like `computed`).

For a life with `prefix` D (the decoder's hit, sent per request; 0 until the decoder has a
cache of its own) the producer looks up its own cached pages of the prompt (source_prefix.py:
whole chunks, at least one token computed) and skips them, P tokens:
- `computed` over every layer and [0, P) with `hit` (its page ids): nothing computed;
- it computes [P, prompt) in chunks at multiples of `chunk` (as without the cache: the same
  bytes, the same tokens), D > P included: tokens the decoder holds that this producer does
  not are still needed for attention, so they are computed (and kept) like any other;
- its spans carry [D, prompt) as without the cache, a span over [D, P) reading the hit pages;
- after the prefill (before `produced`) the whole pages it computed that the cache lacks go
  in: `cache` with `producer` (the decoder answers `cached`, saying whether its trace took
  it: a life it already ended takes none; until then no lookup returns those pages), and,
  when D > 0, its own `reuse` of [0, D) (no span reads them), so the trace lets go of those
  pages now rather than at the life's end;
- evictions (`evict` with `producer`, only pages nobody holds) when the pool or the budget
  lacks room; the decoder records them whatever the life's state (`req` is whom the room was
  for);
- the life lets go of its pages when the decoder grants `reuse` (sent after every span of
  the life was acknowledged, or, for an ended life, after its writer said `stopped` and its
  spans were fenced: a cancelled span's source pages stay held until then, EVICT-1).
Each life's hit is reported as `computed.hit`: P = len(hit) * page_tokens prompt tokens the
producer did not compute (what the decoder counts as cached tokens).
A `prefill` waits for room with its prompt's key chain (`chain`), made once on arrival and
kept by its life: every turn's `can_open`, then `open` and `keep`, hash its pages once.
"""

from __future__ import annotations

import attrs

from pdgpu.prefix_index import KeyChain
from pdgpu.serve.digest import DigestingKV, row_digests
from pdgpu.source_cache import SourceCache
from pdgpu.source_prefix import Held, SourcePrefix, load_hit
from pdref.events import Mode
from pdref.geometry import Geometry
from pdref.plan import Region, plan_chunks, plan_spans, plan_steps


@attrs.frozen
class Plan:
    """A life's prefill with a hit: the compute steps (chunks, or layers in layer mode), the
    spans each makes ready, the spans ready at once (over the hit), those after `produced`."""

    steps: list
    ready: list
    upfront: list
    after: list


def plan_life(mode: Mode, geometry: Geometry, prompt: int, start: int, prefix: int,
              chunk: int) -> Plan:
    """A life's plan without a hit (`start` is `prefix`): pdref's steps (hybrids included);
    whole mode and an empty suffix queue their spans after `produced`."""
    chunks = plan_chunks(prompt, prefix, chunk)
    steps = list(range(geometry.layers)) if mode is Mode.LAYER and chunks else chunks
    ready = [s.spans for s in plan_steps(mode, geometry, prompt, prefix, chunk)] if chunks \
        else []
    after = plan_spans(mode, geometry, prompt, prefix, chunk) \
        if mode is Mode.WHOLE or prefix == prompt else []
    return Plan(steps, ready, [], after)


def plan_with_hit(mode: Mode, geometry: Geometry, prompt: int, start: int, prefix: int,
                  chunk: int) -> Plan:
    """Compute [start, prompt) (chunks at multiples of `chunk` from `start`), send
    [prefix, prompt) in the mode's spans (pdref's, a sliding layer's window in layer mode,
    a state span per run of linear layers after the last chunk; layer mode: none linear)."""
    chunks = plan_chunks(prompt, start, chunk)
    layers = geometry.layers
    if mode is Mode.CHUNK:
        every = (0, layers)
        ready = [[Region(every, (max(a, prefix), b))] if b > prefix else [] for a, b in chunks]
        upfront = [Region(every, (prefix, start))] if start > prefix else []
        if geometry.layout is not None:  # the linear layers' states, once they are final
            ready[-1] = ready[-1] + [Region(r, (prompt, prompt), True)
                                     for r in geometry.layout.linear]
        return Plan(chunks, ready, upfront, [])
    spans = plan_spans(mode, geometry, prompt, prefix, chunk)
    if mode is Mode.LAYER:
        return Plan(list(range(layers)),
                    [[s for s in spans if s.layers == (n, n + 1)] for n in range(layers)], [], [])
    return Plan(chunks, [[] for _ in chunks], [], spans)


class ProducerCache:
    """One producer's cache and its messages (`send(op, **body)`: to the decoder)."""

    def __init__(self, source: SourceCache, layers: int, budget: int, chunk: int, id_base: int,
                 send) -> None:
        self.prefix = SourcePrefix(source, budget, chunk, id_base)
        self.send = send
        self.layers = layers  # the model's (a hit covers every layer, linear ones included)

    def chain(self, tokens: list[int]) -> KeyChain:
        """The key chain of a life's prompt: made once, given to every call below."""
        return self.prefix.chain(tokens)

    def can_open(self, keys: KeyChain) -> bool:
        """Whether a life of prompt `keys.tokens` can open now: the pool has room
        (evictions included), and no page of a longer hit waits for the decoder's word on
        its `cache`."""
        hit = self.prefix.lookup(keys)
        return not hit.waiting and self.prefix.can_open(len(keys.tokens), hit)

    def open(self, req: str, handle: str, keys: KeyChain) -> Held:
        """Hold the hit, allocate the rest; `evict` and `computed` with `hit` sent."""
        held, evicted = self.prefix.open(len(keys.tokens), self.prefix.lookup(keys))
        self._evicted(req, evicted)
        if held.skip:
            self.send("computed", handle=handle, layers=(0, self.layers),
                      tokens=(0, held.skip), hit=self.prefix.hit_ids(held))
        return held

    def load(self, kv: DigestingKV, held: Held) -> None:
        """The hit's KV into the workspace, and its rows' digests (a span over the hit is
        checked against them, `--verify`); a hybrid's state at the hit's end into its slot."""
        load_hit(kv.inner, held.skip)
        snapshot = self.prefix.snapshot(held)
        if snapshot is not None:
            kv.inner.state_pool.write(kv.inner.state_slot, *snapshot)
        if held.skip:
            rows = kv.inner.kv.index_select(2, kv.inner.slots[:held.skip])  # [L, 2, P, KVH, D]
            kv.digests[:, :held.skip] = row_digests(rows).permute(0, 2, 1)  # [L, P, 2]

    def computed(self, held: Held, kv: DigestingKV, end: int) -> None:
        """After a chunk ending at token `end`: a hybrid's state kept for its page."""
        self.prefix.took_state(held, end, kv.inner.read_state)

    def keep(self, req: str, handle: str, keys: KeyChain, held: Held, prefix: int) -> None:
        """After the prefill: `cache` the new whole pages, `reuse` [0, prefix) (see above)."""
        kept = self.prefix.keep(keys, held, held.skip)
        self._evicted(req, kept.evicted)
        for run, pages in kept.runs:
            self.send("cache", handle=handle, tokens=run, pages=pages)
        if prefix:
            self.send("reuse", handle=handle, tokens=(0, prefix), below=True)

    def confirm(self, held: Held, recorded: bool) -> None:
        self.prefix.confirm(held, recorded)

    def release(self, held: Held) -> None:
        self.prefix.release(held)

    def _evicted(self, req: str, pages: tuple) -> None:
        if pages:
            self.send("evict", req=req, pages=pages)

