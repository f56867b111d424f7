"""For the few tests that measure wall time: what they time should be the code's, not a pause
of the whole test process."""

from __future__ import annotations

import gc
from contextlib import contextmanager


@contextmanager
def no_gc_pauses():
    """Python's cyclic collector off while this process's runs are timed: in the whole
    suite's process (300k+ objects once torch is in) one full collection took 0.3 to 2 s at
    load 16 (gc.callbacks, 2026-12-05), stopping every thread, against tails of tens of ms
    and decode steps of a few."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
