"""Properties of the page pool: never more than the pool, ids never collide, all come back."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, multiple, rule
from vacuity_helpers import Vacuity

from pdref.pool import Pool, PoolError, _runs_of, page_runs

POOL = 24
VACUOUS = Vacuity()


@pytest.fixture(scope="module", autouse=True)
def _few_vacuous_examples():
    """After the module: no property may have mostly tested nothing."""
    yield
    VACUOUS.check()


def free_ids(pool: Pool) -> set[int]:
    out: set[int] = set()
    for a, b in pool.free:
        out |= set(range(a, b))
    return out


class PoolMachine(RuleBasedStateMachine):
    """Random allocate/take/give_back against a set of free ids and a dict of held slabs."""

    slabs = Bundle("slabs")

    def __init__(self) -> None:
        super().__init__()
        self.pool = Pool(POOL)
        self.free = set(range(POOL))
        self.held: dict[int, tuple[int, ...]] = {}
        self.next = 0

    def _hold(self, pages):
        self.next += 1
        self.held[self.next] = pages
        return self.next

    @rule(target=slabs, count=st.integers(0, 10))
    def allocate(self, count):
        """allocate(n) gives the n lowest free ids, or refuses when fewer are free."""
        if count > len(self.free):
            with pytest.raises(PoolError):
                self.pool.allocate(count)
            return multiple()
        self.pool, pages = self.pool.allocate(count)
        assert pages == tuple(sorted(self.free)[:count])
        self.free -= set(pages)
        return self._hold(pages)

    @rule(target=slabs, pages=st.lists(st.integers(-2, POOL + 2), max_size=8))
    def take(self, pages):
        """take(ids) succeeds exactly when the ids are distinct, inside the pool and free."""
        pages = tuple(pages)
        ok = (len(set(pages)) == len(pages) and set(pages) <= self.free)
        if not ok:
            with pytest.raises(PoolError):
                self.pool.take(pages)
            return multiple()
        self.pool = self.pool.take(pages)
        self.free -= set(pages)
        return self._hold(pages)

    @rule(slab=consumes(slabs))
    def give_back(self, slab):
        """give_back returns every page of a held slab."""
        pages = self.held.pop(slab)
        self.pool = self.pool.give_back(pages)
        self.free |= set(pages)

    @invariant()
    def matches_model(self):
        """Free ids, the free count and the held slabs partition the pool exactly."""
        assert free_ids(self.pool) == self.free
        assert self.pool.free_pages == len(self.free) == self.pool.free.size
        held = [p for pages in self.held.values() for p in pages]
        assert len(held) == len(set(held))  # ids never collide
        assert set(held) | self.free == set(range(POOL))
        assert not set(held) & self.free
        assert len(held) + self.pool.free_pages == POOL


TestPool = PoolMachine.TestCase
TestPool.settings = settings(max_examples=80, stateful_step_count=30, deadline=None)


@given(st.lists(st.integers(0, 40), unique=True))
def test_page_runs(pages):
    """page_runs coalesces distinct ids into sorted, maximal half-open runs."""
    runs = page_runs(tuple(pages))
    assert [p for a, b in runs for p in range(a, b)] == sorted(pages)
    assert all(b0 < a1 for (_, b0), (a1, _) in zip(runs, runs[1:], strict=False))


def test_take_names_the_bad_page():
    """A taken page, an id outside the pool and a repeated id are each refused with a reason."""
    pool = Pool(8).take((2, 3))
    with pytest.raises(PoolError, match="page 3 is held"):
        pool.take((3,))
    with pytest.raises(PoolError, match="outside"):
        pool.take((8,))
    with pytest.raises(PoolError, match="twice"):
        pool.take((5, 5))
    with pytest.raises(PoolError):
        Pool(2).allocate(3)


def _outcome(pool: Pool, pages: tuple[int, ...]):
    try:
        return pool.take(pages)
    except PoolError as e:
        return type(e), str(e)


@given(st.data(), st.integers(1, 40), st.integers(1, 40), st.sets(st.integers(0, 39)))
def test_allocated_pages_take_as_their_copy(data, size, other_size, other_held):
    """Pages from allocate (whose runs the pool remembers) are taken, refused (same message)
    and given back exactly as an equal tuple it never made, on any pool."""
    held = data.draw(st.sets(st.integers(0, size - 1), max_size=size - 1), "held")
    pool = Pool(size).take(tuple(sorted(held)))  # at least one page stays free
    count = data.draw(st.integers(1, pool.free_pages), "count")  # within the free pages
    if not VACUOUS.tally("take_as_copy", count <= pool.free_pages):
        return
    _, pages = pool.allocate(count)
    assert _runs_of(pages) == page_runs(pages)
    other = Pool(other_size).take(tuple(sorted(p for p in other_held if p < other_size)))
    copy = tuple(list(pages))
    assert copy is not pages and _runs_of(copy) is None
    outcome = _outcome(other, pages)
    assert outcome == _outcome(other, copy)
    if isinstance(outcome, Pool):
        assert outcome.give_back(pages) == outcome.give_back(copy) == other
