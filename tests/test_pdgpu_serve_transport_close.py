"""Closing against what is still in flight: a transport's join waiting for a peer that never
comes (a restarted producer stopped before it reached the rendezvous) ends with the close, a
first connect given up because a peer died leaves no connecting thread behind, and a
producer's span sender waiting for a slot ends with its close."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch.distributed as dist
from wait_helpers import wait_for

from pdgpu.serve.span_sender import SpanSender
from pdgpu.serve.transport import GlooTransport, TransportError

WAIT_S = 20.0  # the connect timeout: far longer than any of these tests waits


def _store():
    return dist.TCPStore("127.0.0.1", 0, 2, is_master=True, timeout=timedelta(seconds=WAIT_S),
                         wait_for_workers=False)


def _published(store, key: str) -> None:
    """Until this end's descriptor is in the store: its connect is waiting for the peer."""
    deadline = time.monotonic() + WAIT_S
    while not store.check([key]):
        assert time.monotonic() < deadline, f"{key} never published"
        time.sleep(0.01)


def _connecting() -> list[str]:
    return [t.name for t in threading.enumerate()
            if t.name in ("pdgpu-join-1", "pdgpu-connect") and t.is_alive()]


def test_a_join_waiting_for_a_peer_that_never_comes_ends_with_the_close():
    """connect_async to a producer that never reaches the rendezvous, then close(): no
    joining or connecting thread of it is left once close returns."""
    store = _store()
    end = GlooTransport(store, 0, WAIT_S)
    end.connect_async(1, 1)
    _published(store, "link/0/1/1/pdgpu-device/0")
    end.close(wait_s=0.0, flush_s=0.0)
    assert _connecting() == [] and end.links == {}


def test_a_first_connect_given_up_for_a_dead_peer_leaves_no_connecting_thread():
    """connect's `alive` raises (the producer died) while it waits for the peer: the error
    comes up and the connecting thread has ended by then."""
    store = _store()
    end = GlooTransport(store, 0, WAIT_S)

    def alive():
        if store.check(["link/0/1/0/pdgpu-device/0"]):
            raise RuntimeError("producer p1 exited with code -9")

    with pytest.raises(RuntimeError, match="exited"):
        end.connect(1, 0, alive)
    assert _connecting() == []
    end.close(wait_s=0.0, flush_s=0.0)


def test_a_peer_that_never_comes_fails_the_connect_within_its_timeout():
    """No peer at all: connect raises TransportError naming the wait, after its timeout."""
    store = _store()
    end = GlooTransport(store, 0, 0.2)
    with pytest.raises(TransportError, match="no peer came within 0.2 s"):
        end.connect(1, 0)
    end.close(wait_s=0.0, flush_s=0.0)


def test_a_span_waiting_for_a_slot_ends_with_the_senders_close():
    """Every slot taken (no ack will come) and a span queued: close() returns with the
    sender's thread ended, not left polling for a slot."""
    producer = SimpleNamespace(_send=None, transport=SimpleNamespace(staging=None),
                               config=SimpleNamespace(max_pending=1), geometry=None,
                               cache=None, device="cpu", bugs=None, now=time.perf_counter)
    sender = SpanSender(producer)
    assert sender.slots.acquire(timeout=1)  # the one slot, never given back
    sender.outbox.put(("a job", "a region"))  # looked at only once a slot is free
    wait_for(sender.outbox.empty)  # the thread took it: it waits for a slot now
    sender.close()
    assert not sender.thread.is_alive() and sender.error is None
