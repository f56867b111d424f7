"""KV between two processes on one host through shared memory (lanes `shm` and `shm-pinned`).

Why: over gloo a span's bytes cross loopback TCP (framed, copied through the kernel on both
sides); through a shared mapping they cross with one memcpy on each side. Only the bytes move
here: every message's header and JSON stay on the link's gloo group (order, `lost`).
- The writer (the link's higher rank: the producer) owns a ring of slots, each a file in
  /dev/shm mapped by both processes. A message with tensors takes one free slot (a new one
  while fewer than MAX_SLOTS exist, else it waits for one), its tensors are copied in by the
  sender's thread before the message is queued (or the producer gathered them straight into
  the slot, `staging`: then nothing is copied in), and its JSON names slot, file and offsets:
  the slot is handed over by the control message, on gloo.
- The reader maps a slot's file the first time it sees it and unlinks it at once: from then on
  the memory lives only as long as the two mappings (a killed process's goes with it). The
  message's tensors are views of the mapping; the owner copies them out (into its pool) and
  calls `done(msg)`, and only then is the slot handed back: its state word (the slot's first
  bytes) goes from OUT to FREE, which the writer polls. Bytes the reader has not consumed are
  never overwritten. Why a word and not a message back: gloo carrying small messages both ways
  on one link ran 151 messages/s against 3,554 one way (lane_probe, this 2-core box), and the
  state is written after the reader's copy returned (x86 keeps the two stores in order; an
  h2d out of a slot is synchronous).
- A slot too small for a message is replaced by a larger file (a new name).
- Files a reader never mapped (a writer killed between making and announcing one) are swept by
  name: the reader removes its link's prefix when it drops the link or closes, the writer its
  own files when it closes.
- On one GPU (`shm-pinned`) both mappings are page-locked (streams.pin_host): the producer's
  d2h and the decoder's h2d run at pinned-copy speed, the seed's d2h -> h2d path.
"""

from __future__ import annotations

import itertools
import os
import secrets
import socket
import sys
import threading
import time
from contextlib import suppress
from pathlib import Path

import attrs
import torch

from pdgpu.streams import pin_host, unpin_host

SHM_DIR = Path("/dev/shm")
MAX_SLOTS = 8  # a link's slots at most (the producer's max_pending bounds it in practice)
GRAIN = 1 << 20  # slot sizes are powers of two of at least this many bytes
ALIGN = 64  # each tensor's offset in a slot (any dtype's view is aligned)
FREE, OUT = 0, 1  # a slot's state word: the writer may fill it | the reader's until done
POLL_S = 0.0002  # between looks at the slots' states while a writer waits for one


class SlotError(RuntimeError):
    """A slot cannot be had: the link broke while waiting, or the reader named a bad one."""


def shm_token(enabled: bool) -> str | None:
    """This process's name stem for the segments of the links it reads; None when shared
    memory is not wanted, this machine has no /dev/shm, or it cannot hold a link's slots
    at their smallest (said on stderr: the link then agrees on gloo, which the trace header
    and the summary name)."""
    if not enabled or not SHM_DIR.is_dir():
        return None
    free, need = free_bytes(), MAX_SLOTS * GRAIN
    if free < need:
        print(f"pdgpu: kv lane shm refused: {SHM_DIR} has {free >> 20} MiB free, less than "
              f"{MAX_SLOTS} slots of {GRAIN >> 20} MiB ({need >> 20} MiB); KV goes over gloo",
              file=sys.stderr, flush=True)
        return None
    return f"pdgpu-kv-{os.getpid()}-{secrets.token_hex(4)}"


def free_bytes() -> int:
    """Bytes /dev/shm can still give an unprivileged writer."""
    stats = os.statvfs(SHM_DIR)
    return stats.f_bavail * stats.f_frsize


def host_id() -> str:
    """Equal at both ends of a link only when they share a machine (and its /dev/shm)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


class NoRoom(SlotError):
    """/dev/shm cannot hold another slot of that size: the message goes over gloo instead."""


def map_segment(path: Path, nbytes: int, create: bool) -> torch.Tensor:
    """uint8 [nbytes] over a shared mapping of `path` (made first when `create`: its pages
    are allocated now, so a full /dev/shm is NoRoom here, not a SIGBUS at the first write
    into a sparse file)."""
    if create:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, nbytes)
        except OSError as e:
            path.unlink(missing_ok=True)
            raise NoRoom(f"{SHM_DIR} cannot hold {nbytes} more bytes ({e.strerror})") from None
        finally:
            os.close(fd)
    return torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)


def sweep(prefix: str) -> int:
    """Remove the segment files of `prefix` still in /dev/shm; how many there were."""
    removed = 0
    for path in SHM_DIR.glob(f"{prefix}-*"):
        with suppress(FileNotFoundError):
            path.unlink()
            removed += 1
    return removed


def layout(tensors) -> tuple[list[int], int]:
    """Byte offsets of `tensors` packed in one slot after its state word, and the bytes they
    need."""
    offsets, end = [], ALIGN
    for t in tensors:
        offsets.append(end)
        end += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
    return offsets, end


def in_slot(memory: torch.Tensor, offset: int, dtype: torch.dtype, shape) -> torch.Tensor:
    """The tensor of `dtype` and `shape` at byte `offset` of a slot's memory (a view)."""
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    return memory[offset:offset + nbytes].view(dtype).view(shape)


@attrs.define
class Slot:
    index: int
    name: str  # its file in SHM_DIR
    memory: torch.Tensor  # uint8 [capacity], the shared mapping

    @property
    def state(self) -> torch.Tensor:
        """int64 [1]: FREE or OUT, in the shared memory itself."""
        return self.memory[:8].view(torch.int64)


class WriterRing:
    """The writer's slots of one link. A slot is OUT from `acquire` until the reader's
    `release` of it: never handed out twice, never written while out."""

    def __init__(self, prefix: str, pinned: bool) -> None:
        self.prefix, self.pinned = prefix, pinned
        self.slots: list[Slot] = []
        self.staged: tuple | None = None  # (slot, views, offsets) handed out by `stage`
        self.serial = itertools.count()
        self.made: list[Path] = []
        self.lock = threading.Lock()

    def acquire(self, nbytes: int, broken) -> Slot:
        """A slot of at least `nbytes`, waiting for the reader to hand one back while
        MAX_SLOTS are out; SlotError naming `broken()` (the reason, or None) if it says the
        link cannot carry it any more."""
        while (slot := self.take(nbytes)) is None:
            why = broken()
            if why is not None:
                raise SlotError(f"no shared-memory slot: {why}")
            time.sleep(POLL_S)
        return slot

    def take(self, nbytes: int) -> Slot | None:
        """A FREE slot (a new one while fewer than MAX_SLOTS exist) now OUT, or None."""
        with self.lock:
            slot = next((s for s in self.slots if int(s.state[0]) == FREE), None)
            if slot is None and len(self.slots) < MAX_SLOTS:
                slot = self._new(len(self.slots), nbytes)
                self.slots.append(slot)
            if slot is not None and slot.memory.numel() < nbytes:
                slot = self._replace(slot, nbytes)
            if slot is not None:
                slot.state[0] = OUT
            return slot

    def _new(self, index: int, nbytes: int) -> Slot:
        path = SHM_DIR / f"{self.prefix}-{next(self.serial)}"
        self.made.append(path)
        memory = map_segment(path, max(GRAIN, 1 << max(0, nbytes - 1).bit_length()),
                             create=True)  # zeroed: its state is FREE
        if self.pinned:
            pin_host(memory)
        return Slot(index, path.name, memory)

    def _replace(self, slot: Slot, nbytes: int) -> Slot:
        """A larger file for the slot (the reader maps it on sight; the old one goes, once
        the new one could be made)."""
        new = self._new(slot.index, nbytes)
        self._forget(slot)
        self.slots[slot.index] = new
        return new

    def _forget(self, slot: Slot) -> None:
        if self.pinned:
            unpin_host(slot.memory)
        with suppress(FileNotFoundError):
            (SHM_DIR / slot.name).unlink()

    def close(self) -> None:
        with self.lock:
            for slot in self.slots:
                self._forget(slot)
            self.slots = []
            for path in self.made:
                with suppress(FileNotFoundError):
                    path.unlink()


class ReaderViews:
    """The reader's mappings of one link's slots, by slot index."""

    def __init__(self, prefix: str, pinned: bool) -> None:
        self.prefix, self.pinned = prefix, pinned
        self.mapped: dict[int, Slot] = {}

    def view(self, shm: dict, offset: int, dtype: torch.dtype, shape) -> torch.Tensor:
        """A tensor the writer placed in slot shm["slot"] (file shm["name"])."""
        slot = self.mapped.get(shm["slot"])
        if slot is None or slot.name != shm["name"]:
            slot = self._map(shm["slot"], shm["name"], shm["size"])
        return in_slot(slot.memory, offset, dtype, shape)

    def _map(self, index: int, name: str, size: int) -> Slot:
        if not name.startswith(f"{self.prefix}-") or "/" in name:
            raise SlotError(f"shared-memory slot {name!r} is not this link's")
        path = SHM_DIR / name
        memory = map_segment(path, size, create=False)
        path.unlink(missing_ok=True)  # only the two mappings hold it now
        if self.pinned:
            pin_host(memory)
        self._unmap(index)
        self.mapped[index] = Slot(index, name, memory)
        return self.mapped[index]

    def release(self, indices) -> None:
        """The reader consumed these slots (copied their tensors out): FREE for the writer."""
        for index in indices:
            slot = self.mapped.get(index)
            if slot is not None:
                slot.state[0] = FREE

    def _unmap(self, index: int) -> None:
        old = self.mapped.pop(index, None)
        if old is not None and self.pinned:
            unpin_host(old.memory)

    def close(self) -> None:
        for index in list(self.mapped):
            self._unmap(index)
        sweep(self.prefix)


def shared_ends(pinned: bool, me: int, prefix: str):
    """(writer ring, reader views) of this end of a shared lane: rank 1 of a link writes
    (the producer: only its tensors take the lane), rank 0 reads."""
    return (WriterRing(prefix, pinned), None) if me == 1 else (None, ReaderViews(prefix, pinned))


def close_ends(ring: WriterRing | None, views: ReaderViews | None) -> None:
    for end in (ring, views):
        if end is not None:
            end.close()


def stage(ring: WriterRing, specs, broken) -> list[torch.Tensor]:
    """Views in one slot for tensors of `specs` [(shape, dtype)] (numel > 0 each) that the
    caller fills and then sends: `place` takes them as they are, no copy in (the producer
    gathers a span straight into shared memory). One thread stages and sends."""
    shells = [torch.empty(shape, dtype=dtype, device="meta") for shape, dtype in specs]
    offsets, nbytes = layout(shells)
    unstage(ring)
    slot = ring.acquire(nbytes, broken)
    ring.staged = (slot, [in_slot(slot.memory, o, t.dtype, t.shape)
                          for t, o in zip(shells, offsets, strict=True)], offsets)
    return list(ring.staged[1])


def unstage(ring: WriterRing) -> None:
    """A staged slot the caller did not send (it sent other tensors) is FREE again."""
    if ring.staged is not None:
        ring.staged[0].state[0] = FREE
        ring.staged = None


def place(ring: WriterRing, tensors, broken) -> dict:
    """Put `tensors` (numel > 0 each) in one slot: the staged one when they are its views,
    else a slot they are copied into on the caller's thread (so the link's sending thread
    sends the previous message's header meanwhile); the JSON naming slot, file and offsets."""
    staged = ring.staged
    if staged is not None and len(staged[1]) == len(tensors) and all(
            t.data_ptr() == v.data_ptr() and t.shape == v.shape
            for t, v in zip(tensors, staged[1], strict=True)):
        ring.staged = None
        slot, offsets = staged[0], staged[2]
    else:
        unstage(ring)
        offsets, nbytes = layout(tensors)
        slot = ring.acquire(nbytes, broken)
        for t, offset in zip(tensors, offsets, strict=True):
            in_slot(slot.memory, offset, t.dtype, t.shape).copy_(t)
    return {"slot": slot.index, "name": slot.name, "size": slot.memory.numel(),
            "offsets": offsets}
