"""pdgpu/serve/clock.py: a producer's clock related to the decoder's by round trips."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pdgpu.serve import clock
from pdgpu.serve.launch import measure_offset
from pdgpu.serve.members import Peer
from pdgpu.serve.transport import Message


def test_offset_is_the_middle_of_the_round_trip():
    """A probe sent at 10.0, answered 2.0 by the producer, back at 10.4: offset 8.2 (+-0.2)."""
    sample = clock.ClockSample(10.0, 2.0, 10.4)
    assert sample.round_trip == pytest.approx(0.4)
    assert sample.offset == pytest.approx(8.2)


def test_the_shortest_round_trip_wins():
    """Of several probes the fastest bounds the offset best; none at all is an error."""
    slow, fast = clock.ClockSample(0.0, 5.0, 1.0), clock.ClockSample(2.0, 6.1, 2.02)
    assert clock.best([slow, fast, slow]) is fast
    with pytest.raises(ValueError, match="no round trip"):
        clock.best([])


class SkewedProducer:
    """A transport to one producer whose clock reads the decoder's minus `skew`, on a fake
    decoder clock (`now`) that each message advances by its delay: a probe takes 0.4 ms out
    and 0.6 ms back, except the first answer, held `first_delay` on its way back (queued
    behind something)."""

    def __init__(self, skew: float, first_delay: float) -> None:
        self.skew, self.delays, self.pending, self.t = skew, [first_delay], [], 1000.0

    def now(self) -> float:
        return self.t

    def send(self, rank, op, body, tensors=()):
        assert op == "clock"
        self.t += 0.0004  # the probe on its way
        self.pending.append(Message(rank, "clock", {"now": self.t - self.skew}, ()))
        self.t += self.delays.pop() if self.delays else 0.0006  # the answer on its way back

    def get(self, timeout):
        return self.pending.pop(0) if self.pending else None


def test_a_queued_answer_does_not_skew_the_offset(monkeypatch):
    """The first answer held 0.3 s on its way back (as a `ready` read late was): the estimate
    is the true skew to within 0.1 ms (half the 0.2 ms asymmetry of the fast probes), where
    that probe alone would put it 0.15 s off and a one-way reading 0.3 s."""
    transport = SkewedProducer(skew=123.0, first_delay=0.3)
    monkeypatch.setattr(clock, "time", SimpleNamespace(perf_counter=transport.now))
    offset = measure_offset(transport, 1, timeout_s=5.0, check_peers=lambda: None)
    assert offset == pytest.approx(123.0001, abs=1e-9)


def test_a_rejoined_producer_keeps_its_best_round_trip():
    """Answers to a rejoined producer's probes, oldest first: the shortest round trip sets
    its offset, a later slower one does not."""
    peer = Peer(1, offset=99.0, probes=[10.0, 10.001, 10.002])
    peer.on_clock(now=5.0, received=10.010)  # round trip 10 ms: offset 5.005
    peer.on_clock(now=5.0, received=10.003)  # sent at 10.001: 2 ms, offset 5.002
    peer.on_clock(now=5.0, received=10.052)  # 50 ms: ignored
    assert peer.offset == pytest.approx(5.002) and not peer.probes
    peer.on_clock(now=7.0, received=11.0)  # an answer to no probe: ignored
    assert peer.offset == pytest.approx(5.002)

