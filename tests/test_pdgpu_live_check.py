"""pdgpu.live_check: the checked-ledger core the Recorder and the serve Ledger both hold."""

from __future__ import annotations

import threading

import attrs
import pytest
import torch

from pdgpu.live_check import LiveCheck
from pdgpu.recorder import Recorder
from pdgpu.serve.ledger import Ledger
from pdref import events as ev
from pdref.models import load_model
from pdref.monitor import Monitor
from pdref.violations import Violation

TINY = attrs.evolve(load_model("tiny"), dtype="float32")
HEADER = ev.Header("pdgpu", "chunk", TINY.geometry(16), 8, 2)


class _RefusesReserve(Monitor):
    """The specification, but it refuses every reserve (the mirror accepts it)."""

    def emit(self, event):
        if event.kind == "reserve":
            raise Violation("SLAB-1", "the audit alone refuses this reserve", event)
        super().emit(event)


def test_both_shells_hold_the_one_core():
    """The engine's Recorder and the decoder's Ledger check through the same LiveCheck class,
    each with its own lock: the Recorder a re-entrant lock, the decoder none."""
    rec = Recorder(HEADER)
    ledger = Ledger(HEADER, "cpu", torch.float32)
    assert type(rec.live) is type(ledger.live) is LiveCheck
    assert isinstance(rec.live.lock, type(threading.RLock()))
    assert not isinstance(ledger.live.lock, type(threading.RLock()))
    ledger.close()
    rec.close()


def test_the_lock_is_held_while_the_mirror_decides_and_its_sink_records():
    """A sink called for an accepted event runs inside the lock given as a parameter."""
    lock = threading.RLock()
    held: list[bool] = []

    def sink(event) -> None:
        held.append(lock._is_owned())
    live = LiveCheck(HEADER, sink, lock=lock)
    live.ask("reserve", 0.0, "r", 32, 0)
    live.stop()
    assert held == [True]


def test_a_finding_is_raised_at_the_next_call_and_a_stop_drains_and_returns_it():
    """What the audit refuses is raised at the next call into the mirror; `stop` returns it,
    and from then on the mirror alone checks (the teardown's events reach the sink)."""
    seen: list = []
    live = LiveCheck(HEADER, seen.append, audit_monitor=_RefusesReserve)
    live.ask("reserve", 0.0, "r", 32, 0)
    found = live.stop()
    assert isinstance(found, Violation) and found.code == "SLAB-1"
    assert live.found(found)
    live.ask("emit", ev.Abort(0.1, "r", "stopped"))  # not raised again: the run has stopped
    assert [e.kind for e in seen] == ["reserve", "abort"]
    live2 = LiveCheck(HEADER, [].append, audit_monitor=_RefusesReserve)
    live2.ask("reserve", 0.0, "r", 32, 0)
    live2.audit.drain()
    with pytest.raises(Violation, match="audit alone"):
        live2.ask("can_admit", "r")
