"""A rule-based state machine: random legal and illegal events go through `apply` and through
a deliberately simple second model (plain sets of (layer, token) points), which must agree on
every verdict and code, and on the whole state after every step. The simulator's
`FastMonitor` (a mutable mirror) goes along: the same verdict, code and message as `apply`,
and the same state after every step."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
)

from pdref import events as ev
from pdref.apply import apply, initial_state
from pdref.fast_monitor import FastMonitor
from pdref.geometry import Geometry
from pdref.kinds import LayerKind
from pdref.monitor import Monitor
from pdref.violations import Violation

PAGE_TOKENS = 4
MAX_PROMPT = 40
# The machine spends about 20 s of CPU (300 examples of 50 steps over three versions); on a
# loaded 2-core machine its wall time passed the default 120 s bound.
pytestmark = pytest.mark.timeout(300)

# (code, version, event kind) of every refusal the machine made: `test_the_machine_reaches_
# every_rules_edge` needs each rule's illegal cases reached, so a mirror that drifts on one
# of them (say COPY-3 against an unfenced span) is compared with `apply` there.
EDGES: Counter = Counter()
NAMES = ("a", "b", "c", "d")
PRODUCERS = ("p0", "p1")

# ---------------------------------------------------------------------------------------------
# The simple model: sets and dicts only, written from contract.md, following apply.py's check
# order where one event breaks two rules. It shares nothing with pdref.
# ---------------------------------------------------------------------------------------------


def cells(layers, tokens) -> set[tuple[int, int]]:
    return {(la, t) for la in range(layers[0], layers[1]) for t in range(tokens[0], tokens[1])}


def inside(outer, r) -> bool:
    """Each range checked on its own: an empty range lies anywhere (pdref's reading)."""
    return r[1] <= r[0] or (outer[0] <= r[0] and r[1] <= outer[1])


class Life:
    """One life of a request in the simple model."""

    def __init__(self, producer, prompt, prefix, pages):
        self.producer, self.prompt, self.prefix, self.pages = producer, prompt, prefix, pages
        self.computed: set = set()
        self.held: set = set()
        self.landed: set = set()
        self.flying: dict = {}  # span id -> set of cells
        self.unfenced: dict = {}  # (v2) span id -> set of cells: failed or cancelled, not fenced
        self.phase = "reserved"
        self.failed = False
        self.slot = None  # (v3) its producer's state slot
        self.states: set = set()  # (v3) linear layers whose state landed
        self.state_of: dict = {}  # (v3) state span id -> its layers (in flight or unfenced)


class Simple:
    """The second model: pages, lives and spans as plain sets and dicts."""

    def __init__(self, layers, pool_pages, max_pending, bpt, version=2, kinds=None):
        self.kinds = kinds  # (v3) [(kind, window or state bytes)] per layer, or None
        self.layers, self.pool_pages = layers, pool_pages
        self.max_pending, self.bpt, self.version = max_pending, bpt, version
        self.free = set(range(pool_pages))
        self.lives: dict[str, Life] = {}
        self.pending: dict[str, int] = {}
        self.used: set = set()
        self.unfenced: dict = {}  # (v2) span id -> (req, producer, Life)
        self.ended: list[Life] = []  # (v2) aborted lives whose pages wait for fences

    def quarantined(self) -> set:
        return {p for life in self.ended for p in life.pages}

    def _unfence_later(self, req, life, span, region):
        life.unfenced[span] = region
        self.unfenced[span] = (req, life.producer, life)

    @staticmethod
    def cfg(mode, recurrent, kinds=None):
        return "CFG-1" if mode == "layer" and recurrent and kinds is None else None

    def suffix(self, life):
        return cells((0, self.layers), (life.prefix, life.prompt))

    # --- version 3: layer kinds, written from the contract's table, one layer at a time ----

    def kind(self, layer):
        return "full" if self.kinds is None else self.kinds[layer][0]

    def linear_layers(self) -> set:
        return {la for la in range(self.layers) if self.kind(la) == "linear"}

    def window_lo(self, life, layer) -> int:
        """First token a sliding layer carries: the page of prompt - window + 1."""
        first = max(0, life.prompt - self.kinds[layer][1] + 1)
        return max(life.prefix, first - first % PAGE_TOKENS)

    def carried(self, life, layers, tokens, clip=True) -> int:
        """(layer, token) cells a KV span carries: full all, sliding its window, linear none."""
        total = 0
        for la in range(layers[0], min(layers[1], self.layers)):  # (beyond: COV-1 first)
            a = tokens[0]
            if self.kind(la) == "sliding" and clip:
                a = max(a, self.window_lo(life, la))
            if self.kind(la) != "linear":
                total += max(0, tokens[1] - a)
        return total

    def needed(self, life) -> set:
        """KV cells admission needs: full layers the suffix, sliding layers their window."""
        need = set()
        for la in range(self.layers):
            if self.kind(la) == "full":
                need |= cells((la, la + 1), (life.prefix, life.prompt))
            elif self.kind(la) == "sliding":
                need |= cells((la, la + 1), (self.window_lo(life, la), life.prompt))
        return need

    def clips(self, life) -> list[int]:
        """Sliding layers whose window starts above the life's prefix."""
        return [la for la in range(self.layers) if self.kind(la) == "sliding"
                and self.window_lo(life, la) > life.prefix]

    def slot_busy(self, producer, slot) -> bool:
        """A live life holds it until all its states landed; an unfenced state span reads it."""
        linear = self.linear_layers()
        if any(life.producer == producer and life.slot == slot and linear - life.states
               for life in self.lives.values()):
            return True
        return any(p == producer and life.slot == slot and span in life.state_of
                   for span, (_, p, life) in self.unfenced.items())

    def free_slot(self, producer) -> int:
        slot = 0
        while self.slot_busy(producer, slot):
            slot += 1
        return slot

    def _state_issue(self, e, life) -> str | None:
        if e.span in self.used:
            return "REQ-1"
        layers = range(e.layers[0], e.layers[1])
        if not (self.kinds and e.layers[0] < e.layers[1] <= self.layers
                and all(self.kind(la) == "linear" for la in layers)):
            return "COV-1"
        if e.tokens != (life.prompt, life.prompt):
            return "STATE-1"
        if e.bytes != sum(self.kinds[la][1] for la in layers):
            return "COPY-4"
        if cells(e.layers, (life.prefix, life.prompt)) - life.computed:
            return "STATE-1"
        flying = [ls for sp, ls in life.state_of.items() if sp in life.flying]
        if set(layers) & life.states or any(set(layers) & ls for ls in flying):
            return "STATE-2"
        if self.pending.get(life.producer, 0) >= self.max_pending:
            return "COPY-2"
        self.used.add(e.span)
        life.flying[e.span] = set()
        life.state_of[e.span] = set(layers)
        self.pending[life.producer] = self.pending.get(life.producer, 0) + 1
        return None

    def _writes_state(self, e, life) -> bool:
        """A computed that writes a linear layer under copy or after its state landed."""
        if e.tokens[1] <= e.tokens[0]:
            return False
        reading = {la for sp, ls in life.state_of.items()
                   if sp in life.flying or sp in life.unfenced for la in ls}
        return any(self.kind(la) == "linear" and (la in reading or la in life.states)
                   for la in range(max(0, e.layers[0]), min(self.layers, e.layers[1])))

    def _end(self, req):
        life = self.lives.pop(req)
        if self.version == 1:
            self.free |= set(life.pages)
            self.pending[life.producer] = self.pending.get(life.producer, 0) - len(life.flying)
            return
        for span, region in life.flying.items():  # cancelled: unfenced, slots still taken
            self._unfence_later(req, life, span, region)
        life.flying = {}
        if life.unfenced:
            self.ended.append(life)
        else:
            self.free |= set(life.pages)

    def _fence(self, e) -> str | None:
        owner = self.unfenced.get(e.span)
        if owner is None or owner[0] != e.req:
            return "REQ-1"
        _, producer, life = self.unfenced.pop(e.span)
        del life.unfenced[e.span]
        self.pending[producer] -= 1
        if life in self.ended and not life.unfenced:
            self.ended.remove(life)
            self.free |= set(life.pages)
        return None

    def step(self, e) -> str | None:
        """The code `e` breaks, or None after applying it."""
        kind = e.kind
        if kind == "stage":
            return None
        if kind == "fence":
            return self._fence(e)
        life = self.lives.get(e.req)
        if kind == "reserve":
            if life is not None:
                return "REQ-1"
            if e.prompt < 1 or not 0 <= e.prefix <= e.prompt or e.prefix % PAGE_TOKENS:
                return "SLAB-2"
            need = (e.prompt - e.prefix + PAGE_TOKENS - 1) // PAGE_TOKENS
            pages = list(e.pages)
            if len(pages) != need or len(set(pages)) != len(pages):
                return "SLAB-1"
            if any(not 0 <= p < self.pool_pages for p in pages):
                return "SLAB-1"
            if set(pages) & self.quarantined():
                return "COPY-5"
            if not set(pages) <= self.free:
                return "SLAB-1"
            if self.linear_layers() and (e.state_slot is None
                                         or self.slot_busy(e.producer, e.state_slot)):
                return "STATE-4"
            self.free -= set(pages)
            self.lives[e.req] = Life(e.producer, e.prompt, e.prefix, pages)
            self.lives[e.req].slot = e.state_slot
            return None
        if life is None:
            return "REQ-1"
        if kind == "computed":
            if not (inside((0, self.layers), e.layers) and inside((0, life.prompt), e.tokens)):
                return "PROD-1"
            if self._writes_state(e, life):
                return "STATE-4"
            life.computed |= cells(e.layers, e.tokens)
            life.held |= cells(e.layers, e.tokens)
        elif kind == "issue" and e.state:
            return self._state_issue(e, life)
        elif kind == "issue":
            region = cells(e.layers, e.tokens)
            if e.span in self.used:
                return "REQ-1"
            if not (inside((0, self.layers), e.layers)
                    and inside((life.prefix, life.prompt), e.tokens)):
                return "COV-1"
            width = self.carried(life, e.layers, e.tokens)
            unclipped = self.carried(life, e.layers, e.tokens, clip=False)
            if unclipped != width and e.bytes == self.bpt * unclipped:
                return "SLIDE-1"
            if e.bytes != self.bpt * width:
                return "COPY-4"
            if region - life.held:
                return "COPY-1"
            if any(region & other for other in life.flying.values()):
                return "COV-2"
            if self.pending.get(life.producer, 0) >= self.max_pending:
                return "COPY-2"
            self.used.add(e.span)
            life.flying[e.span] = region
            self.pending[life.producer] = self.pending.get(life.producer, 0) + 1
        elif kind in ("land", "fail"):
            if e.span not in life.flying:
                return "REQ-1"
            region = life.flying[e.span]
            if kind == "land":
                if region & life.landed:
                    return "COV-2"
                life.landed |= region
                life.states |= life.state_of.pop(e.span, set())
            else:
                life.failed = True
            del life.flying[e.span]
            if kind == "fail" and self.version >= 2:
                self._unfence_later(e.req, life, e.span, region)
            else:
                self.pending[life.producer] -= 1
        elif kind == "reuse":
            gone = {t for t in range(e.tokens[0], e.tokens[1])}
            readers = [*life.flying.values(), *life.unfenced.values()]
            if any(t in gone for region in readers for _, t in region):
                return "COPY-3"
            life.held = {(la, t) for la, t in life.held if t not in gone}
        elif kind == "produced":
            if life.phase != "reserved" or self.suffix(life) - life.computed:
                return "PROD-1"
            life.phase = "produced"
        elif kind == "admit":
            if life.phase == "admitted" or life.failed or life.flying:
                return "ADM-1"
            if self.needed(life) - life.landed:
                return "COV-3"
            if self.linear_layers() - life.states:
                return "STATE-3"
            if life.phase != "produced":
                return "ADM-1"
            life.phase = "admitted"
        elif kind == "release":
            if life.phase != "admitted":
                return "LIFE-1"
            self._end(e.req)
        elif kind == "abort":
            self._end(e.req)
        return None

    def can_admit(self, req) -> bool:
        life = self.lives.get(req)
        return (life is not None and life.phase == "produced" and not life.failed
                and not life.flying and not self.needed(life) - life.landed
                and not self.linear_layers() - life.states)


# ---------------------------------------------------------------------------------------------


def layer_kinds(kinds):
    """pdref's LayerKind values of the machine's (kind, parameter) pairs."""
    if kinds is None:
        return None
    return tuple(LayerKind(k, w if k == "sliding" else None, w if k == "linear" else None)
                 for k, w in kinds)


def coverage_cells(cov, layers) -> set[tuple[int, int]]:
    return {(la, t) for la in range(layers) for a, b in cov.tokens_of(la) for t in range(a, b)}


def check_invariants(s, m, layers):
    """Free and quarantined pages, live requests, pending counts, unfenced spans and every
    life's sets match."""
    free = {p for a, b in s.pool.free for p in range(a, b)}
    assert free == m.free and s.free_pages == len(m.free)
    assert {p for a, b in s.pool.quarantined for p in range(a, b)} == m.quarantined()
    assert set(s.unfenced.keys()) == set(m.unfenced)
    assert set(s.requests.keys()) == set(m.lives)
    for p in PRODUCERS:
        assert s.pending_of(p) == m.pending.get(p, 0)
        assert s.can_issue(p) == (m.pending.get(p, 0) < m.max_pending)
    held_pages = []
    for req, life in m.lives.items():
        got = s.live(req)
        held_pages += list(got.pages)
        assert sorted(got.pages) == sorted(life.pages)
        assert (got.prompt, got.prefix, got.producer) == (life.prompt, life.prefix,
                                                          life.producer)
        assert coverage_cells(got.progress.landed, layers) == life.landed
        assert coverage_cells(got.computed, layers) == life.computed
        assert coverage_cells(got.held, layers) == life.held
        assert {sp.span for sp in got.in_flight} == set(life.flying)
        assert {sp.span for sp in got.unfenced} == set(life.unfenced)
        assert got.phase.value == life.phase and got.failed == life.failed
        assert {la for a, b in got.states for la in range(a, b)} == life.states
        assert got.state_slot == life.slot
        assert s.can_admit(req) == m.can_admit(req)
        assert set(s.unfenced_of(req)) == {sp for sp, u in m.unfenced.items() if u[0] == req}
    assert len(held_pages) == len(set(held_pages))  # page ids never collide
    assert len(held_pages) + s.free_pages + len(m.quarantined()) == m.pool_pages
    for prompt in (1, 9, MAX_PROMPT):
        assert s.can_reserve(prompt, 0) == ((prompt + 3) // 4 <= len(m.free))


small = st.integers(0, MAX_PROMPT + 2)
ranges = st.tuples(small, small)


class ApplyVsSimple(RuleBasedStateMachine):
    """pdref's `apply` and the simple model side by side: same verdicts, same state."""

    reqs = Bundle("reqs")
    spans = Bundle("spans")  # (req, span id) of every span ever accepted

    @initialize(layers=st.integers(2, 4), pool_pages=st.integers(6, 24),
                max_pending=st.integers(1, 3), mode=st.sampled_from(["whole", "chunk", "layer"]),
                recurrent=st.booleans(), version=st.sampled_from([2, 3, 2, 1, 3, 4, 2]),
                kinds=st.lists(st.tuples(st.sampled_from(["full", "sliding", "linear"]),
                                         st.integers(1, 12)), min_size=4, max_size=4))
    def start(self, layers, pool_pages, max_pending, mode, recurrent, version, kinds):
        # (v3, and v4: version 3 with a prefix cache this machine does not use)
        kinds = kinds[:layers] if version >= 3 else None  # (kind, window or state bytes)
        if kinds is not None:  # every v3 run has a linear and a sliding layer (their edges)
            if all(k != "linear" for k, _ in kinds):
                kinds[-1] = ("linear", kinds[-1][1])
            if all(k != "sliding" for k, _ in kinds):
                kinds[0] = ("sliding", kinds[0][1])
            recurrent = any(k == "linear" for k, _ in kinds)
        geo = Geometry(layers=layers, kv_heads=1, head_dim=2, dtype_bytes=1,
                       page_tokens=PAGE_TOKENS, recurrent=recurrent, kinds=layer_kinds(kinds))
        got = None
        try:
            initial_state(ev.Header("m", mode, geo, pool_pages, max_pending))
        except Violation as v:
            got = v.code
        assert got == Simple.cfg(mode, recurrent, kinds)
        if got:
            EDGES[(got, version, "header")] += 1
            geo = Geometry(layers=layers, kv_heads=1, head_dim=2, dtype_bytes=1,
                           page_tokens=PAGE_TOKENS)
        self.L = layers
        self.version = version
        header = ev.Header("m", mode, geo, pool_pages, max_pending, version=version)
        self.header = header
        self.state = initial_state(header)
        self.fast = FastMonitor(header)
        self.model = Simple(layers, pool_pages, max_pending, geo.bytes_per_token_layer, version,
                            kinds)
        self.next_span = 0

    def do(self, event) -> bool:
        """Apply `event` to both models; they must agree. True when it was accepted."""
        want = self.model.step(event)
        fast = verdict_of(self.fast.emit, event)
        try:
            new = apply(self.state, event)
        except Violation as v:
            EDGES[(v.code, self.version, edge_of(v, event))] += 1
            assert v.code == want, f"{event}: pdref says {v.code}, simple model says {want}"
            assert fast == (v.code, v.message), f"{event}: FastMonitor says {fast}"
            return False
        assert want is None, f"{event}: pdref accepts, simple model says {want}"
        assert fast is None, f"{event}: pdref accepts, FastMonitor says {fast}"
        self.state = new
        return True

    def pick(self, data, other):
        """Mostly a live request (so events get past REQ-1), sometimes any name at all."""
        live = sorted(self.model.lives)
        if live and data.draw(st.integers(0, 19), "live?") < 19:
            return data.draw(st.sampled_from(live), "req")
        return other

    def rng_in(self, data, lo, hi):
        """Mostly a range inside [lo, hi], sometimes any small range."""
        if data.draw(st.integers(0, 9), "inside?") < 8 and lo <= hi:
            a = data.draw(st.integers(lo, hi))
            return (a, data.draw(st.integers(a, hi)))
        return data.draw(ranges)

    # --- requests ---------------------------------------------------------------------------

    @rule(target=reqs, req=st.sampled_from(NAMES), data=st.data(),
          how=st.sampled_from(["alloc", "alloc", "alloc", "random"]))
    def reserve(self, req, data, how):
        """A reservation: mostly the lowest free pages, sometimes any ids, prompt or prefix."""
        shape = data.draw(st.sampled_from(["ok"] * 8 + ["no prompt", "any prefix"]), "shape")
        prompt = 0 if shape == "no prompt" else data.draw(st.integers(1, MAX_PROMPT), "prompt")
        if shape == "any prefix":
            prefix = data.draw(st.integers(0, MAX_PROMPT), "prefix")
        else:
            prefix = PAGE_TOKENS * data.draw(st.integers(0, prompt // PAGE_TOKENS), "prefix")
        need = max(0, (prompt - prefix + PAGE_TOKENS - 1) // PAGE_TOKENS)
        if how == "alloc":
            pages = sorted(self.model.free)[:need]
        else:
            pages = data.draw(st.lists(st.integers(0, self.model.pool_pages), max_size=need + 1))
        producer = data.draw(st.sampled_from(PRODUCERS), "producer")
        slot = None
        if self.model.kinds is not None:  # (v3) mostly a free state slot, sometimes any
            slot = data.draw(st.sampled_from([self.model.free_slot(producer)] * 2
                                             + [0, 1, None]), "slot")
        if self.do(ev.Reserve(0.0, req, prompt, prefix, tuple(pages), producer, slot)):
            return req
        return multiple()

    @precondition(lambda self: self.model.lives)
    @rule(other=st.sampled_from(NAMES) | reqs, data=st.data())
    def computed(self, other, data):
        """The producer computed a region: often all of it, else a mostly-inside range."""
        req = self.pick(data, other)
        life = self.model.lives.get(req)
        if life is not None and data.draw(st.booleans(), "all"):
            layers, tokens = (0, self.L), (0, life.prompt)
        else:
            layers = self.rng_in(data, 0, self.L)
            tokens = self.rng_in(data, 0, life.prompt if life else MAX_PROMPT)
        self.do(ev.Computed(0.0, req, layers, tokens))

    @precondition(lambda self: self.model.lives)
    @rule(data=st.data(), past=st.integers(1, 3), on_layers=st.booleans())
    def computed_outside(self, data, past, on_layers):
        """A producer reports a region past its prompt or past the model's layers (PROD-1):
        the random ranges above reach this edge only by chance."""
        req = data.draw(st.sampled_from(sorted(self.model.lives)))
        prompt = self.model.lives[req].prompt
        layers, tokens = (0, self.L), (prompt, prompt + past)
        if on_layers:
            layers, tokens = (0, self.L + past), (0, prompt)
        self.do(ev.Computed(0.0, req, layers, tokens))

    @precondition(lambda self: self.model.lives)
    @rule(other=st.sampled_from(NAMES) | reqs, data=st.data())
    def produced(self, other, data):
        """The producer finished a request's prefill."""
        self.do(ev.Produced(0.0, self.pick(data, other), 1))

    @precondition(lambda self: self.model.lives)
    @rule(other=st.sampled_from(NAMES) | reqs, data=st.data())
    def admit(self, other, data):
        """Admit a request, ready or not."""
        self.do(ev.Admit(0.0, self.pick(data, other)))

    @precondition(lambda self: any(self.model.can_admit(r) for r in self.model.lives))
    @rule(data=st.data())
    def admit_ready(self, data):
        """Admit a request both models call admissible: it must be accepted."""
        req = data.draw(st.sampled_from(sorted(r for r in self.model.lives
                                               if self.model.can_admit(r))))
        assert self.state.can_admit(req)
        assert self.do(ev.Admit(0.0, req))

    @precondition(lambda self: self.model.lives)
    @rule(other=st.sampled_from(NAMES) | reqs, data=st.data())
    def release(self, other, data):
        """Release a request, admitted or not."""
        self.do(ev.Release(0.0, self.pick(data, other)))

    @precondition(lambda self: self.model.lives)
    @rule(other=st.sampled_from(NAMES) | reqs, data=st.data())
    def abort(self, other, data):
        """Abort a request in any phase."""
        self.do(ev.Abort(0.0, self.pick(data, other), "x"))

    @precondition(lambda self: self.model.lives)
    @rule(other=st.sampled_from(NAMES) | reqs, data=st.data())
    def reuse(self, other, data):
        """Free source KV for some tokens, sometimes under a span in flight or unfenced (the
        edges of COPY-3 in both versions)."""
        req = self.pick(data, other)
        life = self.model.lives.get(req)
        tokens = self.rng_in(data, 0, life.prompt if life else MAX_PROMPT)
        readers = [*life.flying.values(), *life.unfenced.values()] if life else []
        if readers and data.draw(st.booleans(), "hit a span?"):
            region = data.draw(st.sampled_from(sorted(readers, key=sorted)))
            if region:
                t = data.draw(st.sampled_from(sorted(t for _, t in region)))
                tokens = (t, t + data.draw(st.integers(1, 3)))
        self.do(ev.Reuse(0.0, req, tokens))

    @precondition(lambda self: any(life.prefix < life.prompt
                                   for life in self.model.lives.values()))
    @rule(data=st.data(), fail_first=st.booleans())
    def reuse_under_a_span(self, data, fail_first):
        """Free a source token that a span in flight reads (COPY-3), or fail that span first
        and then free it: COPY-3 against an unfenced span in versions 2 and 3, legal in
        version 1 (the edge a mirror that checks only spans in flight misses). Without a
        span in flight it issues one over a suffix token first."""
        req = data.draw(st.sampled_from(sorted(r for r, life in self.model.lives.items()
                                               if life.prefix < life.prompt)))
        life = self.model.lives[req]
        flying = sorted((s for s, region in life.flying.items() if region), key=str)
        if not flying:
            self.do(ev.Computed(0.0, req, (0, self.L), (0, life.prompt)))
            got = self._issue(req, None, (0, self.L), (life.prefix, life.prefix + 1), 0)
            if got is None or not life.flying.get(got[1]):  # refused (pending), or empty
                return
            flying = [got[1]]
        span = data.draw(st.sampled_from(flying))
        t = data.draw(st.sampled_from(sorted(t for _, t in life.flying[span])))
        if fail_first:
            assert self.do(ev.Fail(0.0, req, span, "e"))
        accepted = self.do(ev.Reuse(0.0, req, (t, t + 1)))
        assert accepted == (fail_first and self.version == 1)

    @precondition(lambda self: self.model.linear_layers()
                  and any(n not in self.model.lives for n in NAMES))
    @rule()
    def admit_without_states(self):
        """(v3) A fresh life sent every KV it needs and admitted without its states:
        STATE-3. Other spans in flight are failed and every writer fenced first (legal), so
        the producer has a free slot."""
        model = self.model
        for req, life in sorted(model.lives.items()):
            for span in sorted(life.flying, key=str):
                assert self.do(ev.Fail(0.0, req, span, "e"))
        for span, (req, _, _) in sorted(model.unfenced.items(), key=lambda p: str(p[0])):
            assert self.do(ev.Fence(0.0, req, span))
        name = next(n for n in NAMES if n not in model.lives)
        if len(model.free) < 2 or not self.do(ev.Reserve(0.0, name, 2 * PAGE_TOKENS, 0, tuple(
                sorted(model.free)[:2]), "p0", model.free_slot("p0"))):
            return
        life = model.lives[name]
        self.do(ev.Computed(0.0, name, (0, self.L), (0, life.prompt)))
        for layer in range(self.L):
            if model.kind(layer) == "linear":
                continue
            lo = model.window_lo(life, layer) if model.kind(layer) == "sliding" else 0
            sent = self._issue(name, None, (layer, layer + 1), (lo, life.prompt), 0)
            assert sent is not None and self.do(ev.Land(0.0, name, sent[1]))
        assert self.do(ev.Produced(0.0, name, 1))
        assert not self.do(ev.Admit(0.0, name))

    @precondition(lambda self: any(self.model.clips(life) for life in self.model.lives.values()))
    @rule(data=st.data())
    def issue_unclipped(self, data):
        """(v3) A KV span over a sliding layer from the prefix, whose bytes count the tokens
        below the window: SLIDE-1 (a writer that forgot the window)."""
        req = data.draw(st.sampled_from(sorted(r for r, life in self.model.lives.items()
                                               if self.model.clips(life))))
        life = self.model.lives[req]
        layer = data.draw(st.sampled_from(self.model.clips(life)))
        self._issue(req, None, (layer, layer + 1), (life.prefix, life.prompt), 0, clip=False)

    @rule(req=st.sampled_from(NAMES) | reqs, kind=st.sampled_from(
        ["stage", "computed", "issue", "land", "fail", "reuse", "produced", "admit", "release",
         "abort"]))
    def any_name(self, req, kind):
        """Any event for any name, live or not (REQ-1 unless it is live)."""
        self.do({
            "stage": ev.Stage(0.0, req, "compute", 0.0),
            "computed": ev.Computed(0.0, req, (0, 1), (0, 1)),
            "issue": ev.Issue(0.0, req, f"g{self.next_span}", (0, 0), (0, 0), 0),
            "land": ev.Land(0.0, req, 0),
            "fail": ev.Fail(0.0, req, 0, "e"),
            "reuse": ev.Reuse(0.0, req, (0, 0)),
            "produced": ev.Produced(0.0, req, 1),
            "admit": ev.Admit(0.0, req),
            "release": ev.Release(0.0, req),
            "abort": ev.Abort(0.0, req, "x"),
        }[kind])

    # --- spans ------------------------------------------------------------------------------

    def _issue(self, req, span, layers, tokens, extra_bytes, clip=True):
        life = self.model.lives.get(req)
        if life is None:
            size = self.model.bpt * max(0, layers[1] - layers[0]) * max(0, tokens[1] - tokens[0])
        else:
            size = self.model.bpt * self.model.carried(life, layers, tokens, clip)
        if span is None:
            span = self.next_span
            self.next_span += 1
        if self.do(ev.Issue(0.0, req, span, layers, tokens, size + extra_bytes)):
            return (req, span)
        return None

    @precondition(lambda self: self.model.lives)
    @rule(target=spans, other=st.sampled_from(NAMES) | reqs, data=st.data(),
          old=st.none() | st.none() | spans, extra_bytes=st.sampled_from([0, 0, 0, 0, 1]),
          clip=st.sampled_from([True, True, True, False]))
    def issue(self, other, data, old, extra_bytes, clip):
        """Issue a mostly-inside span, sometimes with a used id, wrong bytes or (v3) the
        bytes of a sliding layer's whole range (no window)."""
        req = self.pick(data, other)
        life = self.model.lives.get(req)
        layers = self.rng_in(data, 0, self.L)
        tokens = self.rng_in(data, life.prefix if life else 0, life.prompt if life else 40)
        return (self._issue(req, old[1] if old else None, layers, tokens, extra_bytes, clip)
                or multiple())

    @precondition(lambda self: self.model.linear_layers() and self.model.lives)
    @rule(target=spans, other=st.sampled_from(NAMES) | reqs, data=st.data(),
          old=st.none() | st.none() | spans)
    def issue_state(self, other, data, old):
        """(v3) A state span: mostly one linear layer at the prompt's end with its state
        bytes, sometimes any layers, position or size, or a used id."""
        req = self.pick(data, other)
        life = self.model.lives.get(req)
        prompt = life.prompt if life else MAX_PROMPT
        layer = data.draw(st.sampled_from(sorted(self.model.linear_layers())), "layer")
        layers = (layer, layer + 1)
        if data.draw(st.integers(0, 4), "any layers?") == 0:
            layers = self.rng_in(data, 0, self.L)
        at = prompt if data.draw(st.integers(0, 4), "mid-prompt?") else data.draw(small)
        size = sum(self.model.kinds[la][1] for la in range(layers[0], min(layers[1], self.L))
                   if self.model.kind(la) == "linear") + data.draw(st.sampled_from([0, 0, 0, 1]))
        span = old[1] if old else self.next_span
        if old is None:
            self.next_span += 1
        if self.do(ev.Issue(0.0, req, span, layers, (at, at), size, True)):
            return (req, span)
        return multiple()

    @precondition(lambda self: any(
        life.prefix < life.prompt for life in self.model.lives.values()))
    @rule(target=spans, data=st.data())
    def issue_gap(self, data):
        """Mostly-legal issue: a run of cells neither landed nor in flight."""
        req = data.draw(st.sampled_from(sorted(r for r, life in self.model.lives.items()
                                               if life.prefix < life.prompt)))
        life = self.model.lives[req]
        busy = life.landed.union(*life.flying.values())
        free = sorted(self.model.suffix(life) - busy)
        if not free:  # every cell is taken: a certain overlap
            return self._issue(req, None, (0, self.L), (life.prefix, life.prompt), 0) or multiple()
        la, t = free[data.draw(st.integers(0, min(3, len(free) - 1)))]
        b = t + 1
        while b < life.prompt and (la, b) not in busy and data.draw(st.integers(0, 5)) > 0:
            b += 1
        lz = la + 1
        while lz < self.L and not cells((lz, lz + 1), (t, b)) & busy and data.draw(st.booleans()):
            lz += 1
        return self._issue(req, None, (la, lz), (t, b), 0) or multiple()

    @precondition(lambda self: self.model.lives)
    @rule(data=st.data(), send_states=st.sampled_from(["once", "once", "none", "twice"]))
    def rush(self, data, send_states):
        """A whole legal-looking life for one request: compute, send every gap and (v3,
        mostly) every state once, admit (without the states: STATE-3; a state sent twice:
        STATE-2)."""
        req = data.draw(st.sampled_from(sorted(self.model.lives)))
        life = self.model.lives[req]
        self.do(ev.Computed(0.0, req, (0, self.L), (0, life.prompt)))
        while req in self.model.lives:
            busy = life.landed.union(*life.flying.values())
            free = sorted(self.model.suffix(life) - busy)
            if not free:
                break
            la, t = free[0]
            b = t + 1
            while b < life.prompt and (la, b) not in busy:
                b += 1
            lz = la + 1
            while lz < self.L and not cells((lz, lz + 1), (t, b)) & busy:
                lz += 1
            span = self.next_span
            if self._issue(req, None, (la, lz), (t, b), 0) is None:
                return
            self.do(ev.Land(0.0, req, span))
        todo = sorted(self.model.linear_layers() - life.states) if send_states != "none" else []
        for layer in todo + todo[:1] * (send_states == "twice"):
            span = self.next_span
            self.next_span += 1
            size = self.model.kinds[layer][1]
            if not self.do(ev.Issue(0.0, req, span, (layer, layer + 1),
                                    (life.prompt, life.prompt), size, True)):
                break
            self.do(ev.Land(0.0, req, span))
        self.do(ev.Produced(0.0, req, 1))
        self.do(ev.Admit(0.0, req))

    @rule(pair=spans, other=st.none() | reqs)
    def land(self, pair, other):
        """Land any span ever accepted, sometimes naming another request."""
        self.do(ev.Land(0.0, other or pair[0], pair[1]))

    @precondition(lambda self: any(life.flying for life in self.model.lives.values()))
    @rule(data=st.data())
    def land_in_flight(self, data):
        """Land a span that is in flight."""
        pairs = sorted(((r, s) for r, life in self.model.lives.items() for s in life.flying),
                       key=str)
        req, span = data.draw(st.sampled_from(pairs))
        self.do(ev.Land(0.0, req, span))

    @precondition(lambda self: any(life.flying for life in self.model.lives.values()))
    @rule(data=st.data())
    def fail_in_flight(self, data):
        """Fail a span that is in flight: accepted (v2: it is unfenced until its fence)."""
        pairs = sorted(((r, s) for r, life in self.model.lives.items() for s in life.flying),
                       key=str)
        req, span = data.draw(st.sampled_from(pairs))
        assert self.do(ev.Fail(0.0, req, span, "e"))

    @rule(pair=spans, other=st.none() | reqs)
    def fail(self, pair, other):
        """Fail any span ever accepted, sometimes naming another request."""
        self.do(ev.Fail(0.0, other or pair[0], pair[1], "e"))

    @precondition(lambda self: self.version >= 2)
    @rule(pair=spans, other=st.none() | reqs)
    def fence(self, pair, other):
        """(v2) Fence any span ever accepted, sometimes naming another request."""
        self.do(ev.Fence(0.0, other or pair[0], pair[1]))

    @precondition(lambda self: self.model.unfenced)
    @rule(data=st.data())
    def fence_unfenced(self, data):
        """(v2) Fence a span whose writer is unfenced: it must be accepted."""
        span = data.draw(st.sampled_from(sorted(self.model.unfenced, key=str)))
        assert self.do(ev.Fence(0.0, self.model.unfenced[span][0], span))

    @precondition(lambda self: self.version >= 2 and self.model.quarantined())
    @rule(data=st.data(), req=st.sampled_from(NAMES))
    def reserve_quarantined(self, data, req):
        """(v2) A reservation that takes a quarantined page: COPY-5 unless refused earlier."""
        page = data.draw(st.sampled_from(sorted(self.model.quarantined())))
        self.do(ev.Reserve(0.0, req, PAGE_TOKENS, 0, (page,), "p0"))

    @invariant()
    def models_agree(self):
        """After every step both models hold the same state."""
        check_invariants(self.state, self.model, self.L)

    @invariant()
    def fast_monitor_agrees(self):
        """After every step the FastMonitor's mirror is the specification's state, its
        queries answer as the state's, and it never deferred a legal event."""
        fast, s = self.fast, self.state
        assert fast.mirror.snapshot() == s and fast.deferred_legal == 0
        for req in NAMES:
            assert fast.can_admit(req) == s.can_admit(req)
            assert set(fast.unfenced(req)) == set(s.unfenced_of(req))
        for producer in PRODUCERS:
            assert fast.can_issue(producer) == s.can_issue(producer)
            assert fast.pending(producer) == s.pending_of(producer)
        for prompt in (1, 9, MAX_PROMPT):
            assert fast.can_reserve(prompt, 0) == s.can_reserve(prompt, 0)
        assert fast.free_pages == s.free_pages
        assert fast.quarantined_pages == s.pool.quarantined_pages
        self._landing_agrees(fast, s)

    def _landing_agrees(self, fast, s):
        """`landing` of every span id ever issued, under every name: the same answer from
        both monitors, a Span exactly when the specification would accept that land."""
        slow = Monitor(self.header)
        slow.state = s
        for span in s.spans_used:
            for req in NAMES:
                accepted = verdict_of(lambda e: apply(s, e), ev.Land(0.0, req, span)) is None
                got = fast.landing(req, span)
                assert got == slow.landing(req, span)
                assert (got is not None) == accepted, (req, span, got)
                assert got is None or got.span == span


def edge_of(v: Violation, event) -> str:
    """The event kind a refusal was at; a reuse refused for an unfenced span (not one in
    flight) apart, the edge issue 38's hand-made mirror bug hid behind."""
    if v.code == "COPY-3" and " unfenced reads " in v.message:
        return "reuse unfenced"
    return event.kind


def verdict_of(emit, event) -> tuple[str, str] | None:
    """(code, message) of the Violation `emit(event)` raises, None when it accepts."""
    try:
        emit(event)
    except Violation as v:
        return v.code, v.message
    return None


TestApplyVsSimple = ApplyVsSimple.TestCase
TestApplyVsSimple.settings = settings(max_examples=300, stateful_step_count=50, deadline=None)

# Every rule's illegal cases the machine must reach, per version and event kind: each
# (code, event) pair of protocol.md's check-order table that random events can break.
REACHED = {
    ("CFG-1", "header"), ("SLAB-1", "reserve"), ("SLAB-2", "reserve"), ("REQ-1", "reserve"),
    ("REQ-1", "issue"), ("REQ-1", "land"), ("REQ-1", "fail"), ("REQ-1", "computed"),
    ("COV-1", "issue"), ("COV-2", "issue"), ("COV-2", "land"), ("COV-3", "admit"),
    ("COPY-1", "issue"), ("COPY-2", "issue"), ("COPY-3", "reuse"), ("COPY-4", "issue"),
    ("PROD-1", "computed"), ("PROD-1", "produced"), ("ADM-1", "admit"), ("LIFE-1", "release"),
}
REACHED_V2 = {("COPY-5", "reserve"), ("REQ-1", "fence"), ("COPY-3", "reuse unfenced")}


REACHED_V3 = {("STATE-1", "issue"), ("STATE-2", "issue"), ("STATE-3", "admit"),
              ("STATE-4", "reserve"), ("STATE-4", "computed"), ("SLIDE-1", "issue")}


@pytest.fixture(scope="module", autouse=True)
def _edges_reached():
    """After the machine ran (with its own settings, all of them), every rule's edge was
    reached: each version 1 rule in some version, version 2's in version 2, 3 or 4, version
    3's in version 3 or 4 (version 4 without its cache events means version 3)."""
    yield
    if sum(EDGES.values()) < 1000:  # the machine did not run in full (-k, a failure)
        return
    for versions, wanted in (((1, 2, 3, 4), REACHED), ((2, 3, 4), REACHED_V2),
                             ((3, 4), REACHED_V3)):
        seen = {(code, kind) for code, v, kind in EDGES if v in versions}
        assert wanted <= seen, f"versions {versions}: never reached {sorted(wanted - seen)}"

