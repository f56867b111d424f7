"""The decode cache: rows in buckets hold exactly each request's K/V; steps are batch-invariant."""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    precondition,
    rule,
)

from pdgpu.decode_batch import DecodeBatch, decode_logits
from pdgpu.decode_kv import MIN_WIDTH, DecodeCache, width_for
from pdgpu.model import build_model
from pdgpu.op_count import peak_bytes
from pdref.models import load_model


def _rows(layers: list[torch.Tensor]) -> torch.Tensor:
    """A bucket's per-layer rows stacked -> [layers, 2, capacity, KVH, W, D]."""
    return torch.stack(layers)


def test_width_is_the_power_of_two_that_holds_the_tokens():
    """Widths: MIN_WIDTH up to it, then the next power of two."""
    assert [width_for(n) for n in (1, MIN_WIDTH, MIN_WIDTH + 1, 1000, 1024, 1025)] == \
        [MIN_WIDTH, MIN_WIDTH, 2 * MIN_WIDTH, 1024, 1024, 2048]


@pytest.fixture
def one_torch_thread():
    """torch on one thread for the test; the count it had is restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("padded", [False, True], ids=["exact", "padded"])
def test_decode_step_is_batch_invariant_across_buckets(one_torch_thread, padded):
    """A request's logits are bit-identical alone and in a batch whose others sit in other
    buckets, including one that moves to a wider bucket in this very step (groups exact, as
    on CPU, or padded to powers of two, as on CUDA)."""
    model = build_model(load_model("small"), seed=0)
    spec = model.spec
    gen = torch.Generator().manual_seed(0)
    lengths = (5, MIN_WIDTH, 300, 700)  # MIN_WIDTH: its next token needs the next bucket
    contexts = [torch.randn(spec.layers, 2, n, spec.kv_heads, spec.head_dim, generator=gen)
                for n in lengths]
    tokens = torch.tensor([7, 11, 13, 17])

    def step(indices):
        cache = DecodeCache.for_model(model, padded)
        batch = DecodeBatch([cache.add(contexts[i]) for i in indices])
        batch.feed(tokens[indices].tolist())
        with torch.no_grad():
            return decode_logits(model, batch)[batch.order]

    together = step([3, 0, 2, 1])
    for place, i in enumerate([3, 0, 2, 1]):
        assert torch.equal(step([i])[0], together[place])


def test_a_batch_must_hold_every_request_of_its_cache_once():
    """A partial or repeated batch is refused: its buckets' rows would not match it."""
    cache = DecodeCache(1, 1, 4, "cpu", torch.float32)
    a, b = cache.add(torch.randn(1, 2, 3, 1, 4)), cache.add(torch.randn(1, 2, 9, 1, 4))
    for seqs in ([a], [a, a], [a, b, b]):
        with pytest.raises(ValueError, match="every request of one decode cache"):
            DecodeBatch(seqs)
    cache.remove(b)
    DecodeBatch([a])
    with pytest.raises(ValueError, match="not in the cache"):
        cache.remove(b)


class CacheMachine(RuleBasedStateMachine):
    """Adds, removals and steps against a plain list of each request's K/V."""

    seqs = Bundle("seqs")

    def __init__(self) -> None:
        super().__init__()
        self.cache = DecodeCache(2, 1, 2, "cpu", torch.float32)
        self.expected: dict[int, tuple] = {}  # id -> (seq, K/V [L, 2, c, KVH, D])
        self.values = torch.Generator().manual_seed(0)

    def _kv(self, tokens: int) -> torch.Tensor:
        return torch.randn(2, 2, tokens, 1, 2, generator=self.values)

    @rule(target=seqs, tokens=st.integers(1, 3 * MIN_WIDTH))
    def add(self, tokens):
        context = self._kv(tokens)
        seq = self.cache.add(context)
        self.expected[id(seq)] = (seq, context)
        return seq

    @rule(seq=consumes(seqs))
    def remove(self, seq):
        self.cache.remove(seq)
        del self.expected[id(seq)]

    @precondition(lambda self: self.expected)
    @rule(grow=st.integers(1, MIN_WIDTH))
    def steps(self, grow):
        for _ in range(grow):
            seqs = [s for s, _ in self.expected.values()]
            DecodeBatch(seqs)  # moves a request that needs a wider row
            for seq in seqs:
                row = self._kv(1)  # [L, 2, 1, KVH, D]
                for layer, rows in enumerate(seq.bucket.kv):
                    rows[:, seq.row, :, seq.length] = row[layer, :, 0]
                self.expected[id(seq)] = (seq, torch.cat([self.expected[id(seq)][1], row], 2))
                seq.length += 1

    @invariant()
    def rows_hold_each_requests_kv(self):
        for seq, context in self.expected.values():
            assert seq.bucket.seqs[seq.row] is seq
            assert seq.bucket.width >= seq.length
            held = _rows(seq.bucket.kv)[:, :, seq.row, :, :seq.length].transpose(2, 3)
            assert torch.equal(held, context)
        assert self.cache.count == len(self.expected)
        assert all(b.seqs for b in self.cache.buckets.values())  # empty buckets are freed


TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = settings(max_examples=40, stateful_step_count=20, deadline=None)


def test_decode_memory_stays_within_what_is_running():
    """Rows double as requests join and halve as they leave: the bytes held never pass four
    rows per running request of its width, and nothing is held once all have left."""
    cache = DecodeCache(2, 1, 4, "cpu", torch.float32)
    row_bytes = {w: 2 * 2 * 1 * w * 4 * 4 for w in (MIN_WIDTH, 2 * MIN_WIDTH)}

    def bound():
        return sum(4 * len(b.seqs) * row_bytes[b.width] for b in cache.buckets.values())

    seqs = []
    for i in range(64):
        seqs.append(cache.add(torch.randn(2, 2, 10 + (i % 2) * 300, 1, 4)))
        assert cache.nbytes <= max(bound(), 2 * sum(row_bytes.values()))
    peak = cache.nbytes
    for seq in seqs[:60]:
        cache.remove(seq)
        assert cache.nbytes <= bound()
    assert cache.nbytes <= peak / 8
    for seq in seqs[60:]:
        cache.remove(seq)
    assert cache.nbytes == 0 and not cache.buckets


def test_a_ring_wider_than_every_bucket_gets_a_mask_of_its_window():
    """A sliding window (512) wider than the widest bucket (256): each row's ring mask spans
    the window, and a ring write and attention run (the step's key columns cover it)."""
    cache = DecodeCache(2, 1, 4, "cpu", torch.float32, windows=(None, 512))
    seq = cache.add(torch.randn(2, 2, 30, 1, 4))
    batch = DecodeBatch([seq])
    batch.feed([3])
    positions = batch.inputs[1]
    (full, ring), = batch.masks(positions, torch.float32)
    assert full[1].shape[-1] == 256 and ring[1].shape[-1] == 512
    q, k = torch.randn(batch.size, 2, 4), torch.randn(batch.size, 1, 4)
    out = batch.attend(1, q, k, k, batch.masks(positions, torch.float32))
    assert out.shape == (batch.size, 8) and torch.isfinite(out).all()


WINDOWS = (None, 8, 8, None)  # full layers around a run of sliding ones, window 8


def _assert_holds(seq, pool: torch.Tensor, slots: torch.Tensor) -> None:
    """seq's row holds the context at pool [L, 2, S, KVH, D]'s rows `slots` [length]: every
    token in the full layers, the last window's at position % 8 in the rings, zeros else."""
    length = slots.shape[0]
    for layer in (0, 3):
        held = seq.bucket.kv[layer // 3][:, seq.row]  # [2, KVH, W, D]
        assert torch.equal(held[:, :, :length], pool[layer][:, slots].transpose(1, 2))
        assert not held[:, :, length:].any()
    ring = _rows(seq.bucket.ring)[:, :, seq.row]  # [Ls, 2, KVH, window, D]
    written = {p % 8: p for p in range(max(0, length - 8), length)}
    for column in range(8):
        want = pool[1:3, :, slots[written[column]]] if column in written else 0
        assert torch.equal(ring[:, :, :, column], want + torch.zeros_like(ring[:, :, :, 0]))


@pytest.mark.parametrize("length", [5, 8, 19, 24])
def test_a_paged_context_lands_in_its_row_and_ring_as_a_whole_one_does(length):
    """A context gathered from scattered pool slots fills the request's row and ring
    exactly as the same context handed whole: every full-layer token, a sliding layer's
    last window at position % window."""
    gen = torch.Generator().manual_seed(length)
    pool = torch.randn(4, 2, 64, 1, 4, generator=gen)  # [L, 2, S, KVH, D]
    slots = torch.randperm(64, generator=gen)[:length]
    whole = DecodeCache(4, 1, 4, "cpu", torch.float32, windows=WINDOWS)
    paged = DecodeCache(4, 1, 4, "cpu", torch.float32, windows=WINDOWS)
    a = whole.add(pool.index_select(2, slots))
    b = paged.add_paged(((pool, slots),))
    assert torch.equal(_rows(a.bucket.kv), _rows(b.bucket.kv))
    assert torch.equal(_rows(a.bucket.ring), _rows(b.bucket.ring))
    _assert_holds(b, pool, slots)


@pytest.mark.parametrize("length", [5, 8, 19, 24])
def test_a_context_in_two_pieces_lands_as_if_it_were_one(length):
    """A context in two pieces, a prefix in a tensor of its own and the rest at scattered
    pool slots (`pdgpu run`'s admission), cut at every token: the window's ring columns
    wrap inside either piece or across the cut, and the row and ring hold it exactly."""
    gen = torch.Generator().manual_seed(length)
    pool = torch.randn(4, 2, 64, 1, 4, generator=gen)  # [L, 2, S, KVH, D]
    slots = torch.randperm(64, generator=gen)[:length]
    for cut in range(length + 1):
        prefix = pool.index_select(2, slots[:cut])  # [L, 2, cut, KVH, D], its own tensor
        cache = DecodeCache(4, 1, 4, "cpu", torch.float32, windows=WINDOWS)
        seq = cache.add_paged(((prefix, torch.arange(cut)), (pool, slots[cut:])))
        assert seq.length == length
        _assert_holds(seq, pool, slots)


@pytest.mark.parametrize("windows", [(None,) * 4, WINDOWS], ids=["full", "sliding"])
def test_a_growing_bucket_holds_one_old_layer_beside_its_new_rows(windows):
    """A full bucket doubling as a request joins holds at once at most its new rows and one
    old layer's (every live storage counted, op by op): not the old rows beside the new,
    three times what it held before; the rows hold every request's K/V after."""
    cache = DecodeCache(4, 1, 4, "cpu", torch.float32, windows=windows)
    contexts = [torch.randn(4, 2, 10, 1, 4) for _ in range(9)]
    seqs = [cache.add(c) for c in contexts[:8]]
    bucket = cache.buckets[MIN_WIDTH]
    before, layer = cache.nbytes, max(t.nbytes for t in bucket.kv + bucket.ring)
    seq, peak = peak_bytes(cache.add, contexts[8],
                           held=lambda: [t for b in cache.buckets.values() for t in b.kv + b.ring])
    assert cache.nbytes == 2 * before and bucket.capacity == 16
    assert peak <= cache.nbytes + layer + 1024  # (the gather's slot indices)
    assert layer <= before / 2
    for one, context in zip([*seqs, seq], contexts, strict=True):  # context [L, 2, 10, KVH, D]
        if windows == WINDOWS:
            _assert_holds(one, context, torch.arange(10))
        else:
            held = _rows(one.bucket.kv)[:, :, one.row, :, :10]
            assert torch.equal(held, context.transpose(2, 3))
