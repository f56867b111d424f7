"""The reader's landing buffer on a link's NIXL lane (nixl_end.py): where a message's tensor
that has no place of its own yet (a span's digests, a state span's tensors, the connect
check) is READ, before it is copied out.

A READ lands only in memory registered with the reader's agent. Registering a fresh tensor
for each such read and deregistering it after cost two registrations per span (each a UCX
memory map, and with CUDA an IPC handle); the landing buffer is registered once per link end
and reused. It grows by doubling past the largest read asked for (the new region registered
before the old one goes, so no address is registered twice at once), and it is deregistered
with the agent at close.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

LANDING_BYTES = 1 << 16  # a first size that holds the digests of most spans


class Landing:
    """One registered uint8 region of a NIXL end, lent to one read at a time."""

    def __init__(self, end) -> None:
        self.end = end  # a NixlEnd: its `target` / `untarget` register memory with its agent
        self.memory: torch.Tensor | None = None
        self.lock = threading.Lock()

    @contextmanager
    def lent(self, nbytes: int) -> Iterator[torch.Tensor]:
        """Its first `nbytes` bytes (uint8, registered), the caller's until it leaves."""
        with self.lock:
            if self.memory is None or self.memory.numel() < nbytes:
                self._grow(nbytes)
            yield self.memory[:nbytes]

    def _grow(self, nbytes: int) -> None:
        old = self.memory
        size = max(nbytes, LANDING_BYTES, 0 if old is None else 2 * old.numel())
        self.memory = torch.ones(size, dtype=torch.uint8, device=self.end.device)  # touched
        self.end.target(self.memory)
        if old is not None:
            self.end.untarget(old)
