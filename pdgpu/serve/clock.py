"""How a producer's clock relates to the decoder's: round trips, the fastest one kept.

Each producer times its stages on its own clock (seconds since it started); the decoder
writes them into the trace on its own, so it needs `offset` (producer time + offset =
decoder's perf_counter). One message from the producer gives that only up to the message's
delay, and a `ready` that waits in the decoder's queue while the decoder still loads its
model makes the delay hundreds of milliseconds. A probe instead: the decoder notes when it
sent `clock`, the producer answers with its time, the decoder notes when the answer came;
the producer's time then lies within that round trip, and its middle is the estimate (error
at most half the round trip). Of several probes the one with the shortest round trip wins.
"""

from __future__ import annotations

import time

import attrs

PROBES = 5  # round trips per producer at the handshake (a local one takes about a millisecond)


@attrs.frozen
class ClockSample:
    sent: float  # the decoder's perf_counter when the probe left
    remote: float  # the producer's clock in its answer
    received: float  # the decoder's perf_counter when the answer came

    @property
    def round_trip(self) -> float:
        return self.received - self.sent

    @property
    def offset(self) -> float:
        """Producer time + offset = decoder time, at most round_trip / 2 off."""
        return (self.sent + self.received) / 2 - self.remote


def best(samples: list[ClockSample]) -> ClockSample:
    """The sample with the shortest round trip (the tightest bound on the offset)."""
    if not samples:
        raise ValueError("clock: no round trip to estimate an offset from")
    return min(samples, key=lambda s: s.round_trip)


def probe(transport, rank: int, wait_answer) -> ClockSample:
    """One round trip to producer `rank`; `wait_answer()` returns its `clock` message."""
    sent = time.perf_counter()
    transport.send(rank, "clock", {})
    answer = wait_answer()
    return ClockSample(sent, answer.body["now"], time.perf_counter())
