"""The block-hash prefix index against a plain model: hits, holders, LRU eviction, budget."""

from __future__ import annotations

import hashlib
import itertools
import subprocess
import sys

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pdgpu import prefix_index
from pdgpu.prefix_index import PrefixIndex, page_keys

PT = 2  # tokens a page: small, so random sequences share pages often
sequences = st.lists(st.integers(0, 1), max_size=5 * PT)


def test_a_page_is_found_only_after_the_same_tokens_before_it():
    """Keys chain: the same page of tokens after a different prefix is another key."""
    a, b = page_keys([1, 2, 3, 4], 2), page_keys([9, 9, 3, 4], 2)
    assert a[1] != b[1] and a[0] != b[0]
    assert page_keys([1, 2, 3, 4, 5], 2) == a  # the partial last page has no key
    assert page_keys([1, 2, 3, 4], 2, root=b"m") != a


def test_keys_are_the_same_in_another_process_and_need_no_torch():
    """A key does not depend on the process (no salted hash()) and the index imports no torch."""
    code = ("import sys; from pdgpu.prefix_index import page_keys; "
            "assert 'torch' not in sys.modules, 'torch imported'; "
            "print(page_keys(list(range(8)), 4)[1].hex())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == page_keys(list(range(8)), 4)[1].hex()


def test_a_hit_stops_at_the_first_missing_page_and_within_the_limit():
    """lookup returns the leading held pages only, whole pages, up to `limit` tokens."""
    index = PrefixIndex(page_tokens=2, budget=8)
    tokens = [5, 6, 7, 8, 9, 10, 11]
    index.insert(tokens, (0, 4), ["a", "b"])
    index.insert(tokens, (6, 6), [])
    assert index.lookup(tokens) == ("a", "b")
    assert index.lookup(tokens, limit=3) == ("a",)
    assert index.lookup(tokens, start=2) == ("b",)
    assert index.missing(tokens, 0, 6) == [(4, 6)]
    assert index.lookup([5, 6, 0, 0]) == ("a",)


def test_a_key_chain_hashes_each_page_once_however_often_it_is_asked(monkeypatch):
    """A kept KeyChain gives page_keys's keys, growing as asked, each page hashed once: a
    request looked up on many turns (and then cached) costs one hash a page."""
    calls = []
    real = hashlib.blake2b
    monkeypatch.setattr(prefix_index.hashlib, "blake2b",
                        lambda data, **kw: calls.append(data) or real(data, **kw))
    tokens = list(range(41))
    index = PrefixIndex(page_tokens=4, budget=20)
    chain = index.chain(tokens)
    assert index.lookup(chain, limit=9) == () and len(calls) == 2
    for _ in range(5):
        assert index.lookup(chain, limit=40) == ()
    assert len(calls) == 10
    index.insert(chain, (0, 40), list(range(10)))
    assert index.lookup(chain) == tuple(range(10)) and len(calls) == 10
    assert chain.upto(41) == page_keys(tokens, 4)  # (hashed afresh: 10 more)


def test_a_chain_of_another_paging_is_refused():
    """An index refuses a chain made for other pages or another root: its keys differ."""
    with pytest.raises(ValueError, match="key chain"):
        PrefixIndex(page_tokens=2, budget=4).lookup(PrefixIndex(4, 4).chain([1, 2, 3, 4]))
    with pytest.raises(ValueError, match="key chain"):
        PrefixIndex(2, 4, root=b"m").lookup(PrefixIndex(2, 4).chain([1, 2]))


def test_a_page_with_a_snapshot_takes_its_cost_and_goes_with_it():
    """Costs count in the budget: a run over it is refused; room evicts the LRU idle pages
    until their costs free enough; `used` follows inserts, withdrawals and evictions."""
    index = PrefixIndex(page_tokens=2, budget=6)
    tokens = [1, 2, 3, 4, 5, 6, 7, 8]
    with pytest.raises(ValueError, match="budget"):
        index.insert(tokens, (0, 4), ["a", "b"], [1, 6])
    with pytest.raises(ValueError, match="at least 1"):
        index.insert(tokens, (0, 2), ["a"], [0])
    index.insert(tokens, (0, 4), ["a", "b"], [1, 4])
    assert index.used == 5
    index.release(["a", "b"])  # b (its snapshot) is evicted first
    assert index.room_for([1, 1]) == (("b",), 2) and index.used == 1
    index.insert(tokens, (2, 6), ["c", "d"], [1, 1])
    index.withdraw(["d"])
    assert index.used == 2 and index.room_for([3, 3, 1]) == (("a",), 1)
    assert index.idle_count() == 0 and index.idle_count(["c"]) == 0


def test_bad_uses_are_refused():
    """Inserting over budget, twice, off page boundaries, releasing an unheld page: ValueError."""
    index = PrefixIndex(page_tokens=2, budget=2)
    with pytest.raises(ValueError, match="budget"):
        index.insert([1, 2, 3, 4, 5, 6], (0, 6), [0, 1, 2])
    with pytest.raises(ValueError, match="page boundary"):
        index.insert([1, 2, 3, 4], (1, 3), [0])
    index.insert([1, 2], (0, 2), [0])
    index.release([0])
    with pytest.raises(ValueError, match="held by nobody"):
        index.release([0])
    with pytest.raises(ValueError, match="cached already"):
        index.insert([1, 2], (0, 2), [1])
    with pytest.raises(ValueError, match="not cached"):
        index.acquire([7])
    index.acquire([0])
    index.acquire([0])
    with pytest.raises(ValueError, match="held by others"):
        index.withdraw([0])


class IndexMachine(RuleBasedStateMachine):
    """Random inserts, hits, releases and evictions against dicts and a list (LRU order)."""

    def __init__(self) -> None:
        super().__init__()
        self.index = PrefixIndex(page_tokens=PT, budget=5)
        self.pages: dict = {}  # page id -> [prefix tokens through its end, first, refs]
        self.idle: list = []  # least recently used first
        self.holds: list = []  # one entry per hold taken by a "life"
        self.names = 0

    def _held_prefixes(self) -> dict:
        return {tuple(p[0]): page for page, p in self.pages.items()}

    def _used(self) -> int:
        return sum(v[3] for v in self.pages.values())

    def _model_room(self, want: int) -> list:
        """LRU idle pages out until `want` more units fit (or none is idle)."""
        gone = []
        while self.idle and self._used() + want > self.index.budget:
            gone.append(self.idle.pop(0))
            del self.pages[gone[-1]]
        return gone

    def _model_evict(self, count: int) -> list:
        gone = self.idle[:count]
        self.idle = self.idle[count:]
        for page in gone:
            del self.pages[page]
        return gone

    @rule(tokens=sequences, data=st.data())
    def cache(self, tokens, data):
        """Put the missing whole pages of a range in, each taking 1..3 units of the budget (a
        snapshot kept with it), making room by LRU like the owners do; the tokens given as
        they are or as a kept key chain."""
        whole = len(tokens) // PT
        end = data.draw(st.integers(0, whole)) * PT
        start = data.draw(st.integers(0, end // PT)) * PT
        held = self._held_prefixes()
        want = [k for k in range(start // PT, end // PT)
                if tuple(tokens[:(k + 1) * PT]) not in held]
        keys = self.index.chain(tokens) if data.draw(st.booleans()) else tokens
        runs = self.index.missing(keys, start, end)
        assert [k for a, b in runs for k in range(a // PT, b // PT)] == want
        for a, b in runs:
            n = (b - a) // PT
            costs = data.draw(st.lists(st.integers(1, 3), min_size=n, max_size=n))
            evicted, fit = self.index.room_for(costs)
            assert list(evicted) == self._model_room(sum(costs))
            free = self.index.budget - self._used()
            assert fit == len([c for c in itertools.accumulate(costs) if c <= free])
            ids = list(range(self.names, self.names + fit))
            self.names += fit
            self.index.insert(keys, (a, a + fit * PT), ids, costs[:fit])
            for i, page in enumerate(ids):
                self.pages[page] = [tokens[:a + (i + 1) * PT], a + i * PT, 1, costs[i]]
            self.holds += ids

    @rule(tokens=sequences)
    def hit(self, tokens):
        """A hit is the leading pages held, in order; the life then holds them."""
        held, expect = self._held_prefixes(), []
        for k in range(len(tokens) // PT):
            page = held.get(tuple(tokens[:(k + 1) * PT]))
            if page is None:
                break
            expect.append(page)
        pages = self.index.lookup(tokens)
        assert list(pages) == expect
        assert [self.pages[p][1] for p in pages] == [k * PT for k in range(len(pages))]
        self.index.acquire(pages)
        for page in pages:
            self.pages[page][2] += 1
            if page in self.idle:
                self.idle.remove(page)
        self.holds += pages

    @precondition(lambda self: self.holds)
    @rule(data=st.data())
    def release(self, data):
        """Letting go of a run of holds; pages nobody holds queue up tail first."""
        count = data.draw(st.integers(1, len(self.holds)))
        run, self.holds = self.holds[:count], self.holds[count:]
        self.index.release(run)
        for page in reversed(run):
            self.pages[page][2] -= 1
            if not self.pages[page][2]:
                self.idle.append(page)

    @precondition(lambda self: any(v[2] == 1 for v in self.pages.values()))
    @rule(data=st.data())
    def withdraw(self, data):
        """A page only its one holder holds may leave without an eviction."""
        page = data.draw(st.sampled_from(sorted(p for p, v in self.pages.items() if v[2] == 1)))
        self.index.withdraw([page])
        del self.pages[page]
        self.holds.remove(page)

    @rule(count=st.integers(0, 4))
    def evict(self, count):
        """Eviction takes idle pages only, least recently used first."""
        assert list(self.index.evict(count)) == self._model_evict(count)

    @invariant()
    def agrees_with_the_model(self):
        entries = self.index.entries()
        assert {p: (e.first, e.refs) for p, e in entries.items()} == \
            {p: (v[1], v[2]) for p, v in self.pages.items()}
        assert list(self.index.idle()) == self.idle
        assert self.index.used == self._used() <= self.index.budget
        assert sorted(p for p, v in self.pages.items() if v[2] == 0) == sorted(self.idle)
        held = {}
        for page in self.holds:
            held[page] = held.get(page, 0) + 1
        assert held == {p: v[2] for p, v in self.pages.items() if v[2]}  # nothing leaked


TestIndexMachine = IndexMachine.TestCase
TestIndexMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
