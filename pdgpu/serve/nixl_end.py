"""One end of a link's NIXL lane (transport_nixl.py): its agent, its registered ring of
staging slots (the producer's), the thread that keeps UCX progressing, the notifications, and
the READ (the decoder's) of bytes in the other end's slot straight into its own memory: a
`RemoteSlice` is a message's tensor still in the producer's slot, read into the decoder's
pool rows by `copy_into` (one descriptor per page run and layer plane), or by `read` into
the end's landing buffer (registered once: nixl_landing.py) and copied out. The NIXL package
is passed in (transport_nixl.nixl_module), so nothing here imports it."""

from __future__ import annotations

import threading
import time
from contextlib import suppress

import attrs
import numpy as np
import torch

from pdgpu.serve.nixl_landing import Landing
from pdgpu.serve.rendezvous import TransportError

SLOTS = 8  # per link, like the shm ring (max_pending bounds it in practice)
SLOT_BYTES = 1 << 20  # a slot's first size; `grow` doubles past what a message needs
ALIGN = 64
POLL_S = 0.001  # between polls of an idle agent
WAIT_S = 0.0001  # between looks at a transfer in flight


def layout(tensors) -> tuple[list[int], int]:
    """Byte offsets of `tensors` packed in one slot, and the bytes they need."""
    offsets, end = [], 0
    for t in tensors:
        offsets.append(end)
        end += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
    return offsets, end


@attrs.define
class Slot:
    memory: torch.Tensor  # uint8 [capacity], registered with this end's agent
    reg: object  # its registration (deregistered when replaced or closed)


class NixlEnd:
    """One end of a link's NIXL lane: its agent, its ring, the poller, the notifications."""

    def __init__(self, api, name: str, device: torch.device, slots: int) -> None:
        self.name, self.device = name, device
        self.mem = "DRAM" if device.type == "cpu" else "VRAM"
        self.dev_id = (device.index or 0) if device.type == "cuda" else 0
        self.agent = api.nixl_agent(name, api.nixl_agent_config(enable_prog_thread=False,
                                                                backends=["UCX"]))
        self.lock = threading.Lock()  # every call into the agent
        self.arrived = threading.Condition()  # notifications came
        self.notes: list[bytes] = []
        self.free: set[int] = set(range(slots))  # producer: slots it may fill
        self.slots: list[Slot] = [self._slot(SLOT_BYTES) for _ in range(slots)]
        self.retired: list[torch.Tensor] = []  # replaced slots' memory, kept (`replace`)
        self.peer: str | None = None  # the other end's agent name, once added
        self.remote: dict[int, tuple[int, int, int]] = {}  # decoder: the producer's slots
        self.grown: list[tuple[bytes, int, tuple]] = []  # (metadata, slot, desc) to load
        self.targets: dict[tuple[int, int], object] = {}  # decoder: (address, bytes) -> reg
        self.landing = Landing(self)  # decoder: where `RemoteSlice.read` READs
        self.closed = threading.Event()
        self.poller = threading.Thread(target=self._poll, daemon=True, name=f"{name}-poll")
        self.poller.start()

    def _slot(self, nbytes: int) -> Slot:
        memory = torch.ones(nbytes, dtype=torch.uint8, device=self.device)  # pages touched
        with self.lock:  # (a first write into untouched pages ran 20x slower over cma)
            reg = self.agent.register_memory([(memory.data_ptr(), nbytes, self.dev_id, "")],
                                             self.mem)
        return Slot(memory, reg)

    def _poll(self) -> None:
        """Keep UCX progressing (no progress thread) and collect notifications."""
        while not self.closed.wait(POLL_S):
            self.take_notes()

    def take_notes(self) -> None:
        with self.lock:
            if self.closed.is_set():
                return
            notes = self.agent.get_new_notifs()
        new = [n for msgs in notes.values() for n in msgs]
        if new:
            with self.arrived:
                self.notes.extend(new)
                self.arrived.notify_all()

    def wait_note(self, want: bytes, deadline: float, broken) -> None:
        """Until notification `want` came (it is consumed); TransportError past `deadline`
        or when `broken()` names a reason."""
        while True:
            self.take_notes()  # first: the note is usually in already (no poll interval)
            with self.arrived:
                if want in self.notes:
                    self.notes.remove(want)
                    return
                self.arrived.wait(POLL_S)
            check_wait(broken(), deadline, f"NIXL notification {want.decode()!r}")

    def metadata(self) -> bytes:
        with self.lock:
            return self.agent.get_agent_metadata()

    def add_peer(self, metadata: bytes) -> None:
        with self.lock:
            self.peer = self.agent.add_remote_agent(metadata)

    def notify(self, message: bytes) -> None:
        with self.lock:
            self.agent.send_notif(self.peer, message)

    def describe(self, index: int) -> list[int]:
        memory = self.slots[index].memory
        return [memory.data_ptr(), memory.numel(), self.dev_id]

    def replace(self, index: int, nbytes: int) -> None:
        """A larger slot `index` (the old one is free: nothing reads it). The old memory is
        deregistered but kept until close: a peer that loads this agent's metadata again
        keeps the old region too (NIXL adds, never drops), and a stale region overlapping a
        new one at a reused address hides it (createXferReq: NIXL_ERR_NOT_FOUND, seen in a
        serving run), so no address of this agent's is ever registered twice."""
        old = self.slots[index]
        self.slots[index] = self._slot(max(nbytes, 2 * old.memory.numel()))
        self.retired.append(old.memory)
        with self.lock:
            self.agent.deregister_memory(old.reg)

    def target(self, memory: torch.Tensor) -> None:
        """Register the storage under `memory` (the decoder's pool) once: READs land in it."""
        key = _storage(memory)
        if key not in self.targets:
            with self.lock:
                self.targets[key] = self.agent.register_memory([(*key, self.dev_id, "")],
                                                               self.mem)

    def untarget(self, memory: torch.Tensor) -> None:
        with self.lock:
            reg = self.targets.pop(_storage(memory), None)
            if reg is not None and self.agent is not None:
                self.agent.deregister_memory(reg)

    def load_grown(self) -> None:
        """The producer's grown slots, loaded on the caller's (the READer's) thread: never
        while a READ of this agent is in flight."""
        with self.lock:
            grown, self.grown = self.grown, []
        for metadata, index, desc in grown:
            self.add_peer(metadata)
            self.remote[index] = desc

    def read(self, local: np.ndarray, remote: np.ndarray, deadline: float, broken) -> None:
        """READ the producer's `remote` descriptors ([N, 3]: address, bytes, device) into
        this end's `local` ones; returns once NIXL reports it DONE. Past `deadline` (or the
        link broken) the handle is released, which cancels it, and TransportError says why;
        where the release fails, the agent goes (close): nothing more lands from it."""
        with self.lock:
            if self.agent is None:
                raise TransportError("the link's NIXL agent is closed")
            handle = self.agent.initialize_xfer(
                "READ", self.agent.get_xfer_descs(local, self.mem),
                self.agent.get_xfer_descs(remote, self.mem), self.peer)
            state = self.agent.transfer(handle)
        try:
            while state == "PROC":
                check_wait(broken(), deadline, "NIXL READ")
                time.sleep(WAIT_S)
                with self.lock:
                    state = self.agent.check_xfer_state(handle)
            if state != "DONE":
                raise TransportError(f"NIXL READ from {self.peer}: state {state}")
        finally:
            self._release(handle)

    def _release(self, handle) -> None:
        try:
            with self.lock:
                handle.release()  # a transfer still in flight is cancelled (or it raises)
        except Exception as e:  # noqa: BLE001 - NIXL could not cancel: the agent goes
            self.close()
            raise TransportError(f"NIXL READ not cancelled, agent closed: {e}") from None

    def close(self) -> None:
        """Stop polling, remove the peer's agent (the link's UCX endpoint goes), deregister
        every registration and let the agent go. The slots' memory stays as long as the
        Link: a READ not known to have stopped can never read memory reused meanwhile."""
        self.closed.set()
        if threading.current_thread() is not self.poller:
            self.poller.join(timeout=2)
        with self.lock:
            if self.agent is None:
                return
            if self.peer is not None:
                with suppress(Exception):  # a dead peer's endpoint may already be gone
                    self.agent.remove_remote_agent(self.peer)
            for reg in [slot.reg for slot in self.slots] + list(self.targets.values()):
                with suppress(Exception):
                    self.agent.deregister_memory(reg)
            for slot in self.slots:
                slot.reg = None
            self.targets.clear()
            self.agent = None

    @property
    def registered(self) -> int:
        return sum(slot.reg is not None for slot in self.slots) + len(self.targets)


def check_wait(why: str | None, deadline: float, what: str) -> None:
    if why is not None:
        raise TransportError(f"{what}: {why}")
    if time.monotonic() > deadline:
        raise TransportError(f"{what}: not done in time (a stopped peer never errors)")


def view(memory: torch.Tensor, offset: int, dtype: torch.dtype, shape) -> torch.Tensor:
    return memory[offset:offset + _nbytes(dtype, shape)].view(dtype).view(shape)


def _nbytes(dtype: torch.dtype, shape) -> int:
    return torch.Size(shape).numel() * dtype.itemsize


def _storage(memory: torch.Tensor) -> tuple[int, int]:
    """(address, bytes) of the storage under `memory`: what a registration covers."""
    storage = memory.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


class RemoteSlice:
    """A message's tensor still in the producer's slot `index` at byte `offset`: what the
    decoder's receiving thread hands on (nothing is copied before the owner asks)."""

    def __init__(self, end: NixlEnd, index: int, offset: int, dtype: torch.dtype, shape,
                 deadline_s: float, broken) -> None:
        self.end, self.index, self.offset = end, index, offset
        self.dtype, self.shape = dtype, torch.Size(shape)
        self.deadline_s, self.broken = deadline_s, broken
        self.nbytes = _nbytes(dtype, self.shape)

    def read(self, device=None) -> torch.Tensor:
        """The bytes, READ into this end's landing buffer (the memory type its agent
        registers: DRAM or VRAM; registered once per link) and copied out into a new tensor
        on `device` (default: this end's)."""
        with self.end.landing.lent(self.nbytes) as memory:
            landed = view(memory, 0, self.dtype, self.shape)
            self.copy_into(landed)
            return landed.to(device or self.end.device, copy=True)

    def copy_into(self, dst: torch.Tensor, index: torch.Tensor | None = None) -> None:
        """dst = the bytes (same shape, contiguous); with `index`: dst[:, :, index] = them,
        dst being pool rows [nl, 2, S, KVH, D] (each token's row contiguous) and the slice
        [nl, 2, nt, KVH, D]: one READ of one descriptor per layer plane and run of
        consecutive slots. TransportError when the READ fails or is past its deadline."""
        self.end.load_grown()
        self.end.target(dst)
        local, remote = self._descriptors(dst, index)
        self.end.read(local, remote, time.monotonic() + self.deadline_s, self.broken)

    def _descriptors(self, dst: torch.Tensor, index) -> tuple[np.ndarray, np.ndarray]:
        if dst.dtype != self.dtype:  # bytes are copied as they are: never reinterpreted
            raise ValueError(f"READ of {self.dtype} into {dst.dtype}")
        address, size, device = self.end.remote[self.index]
        if self.offset + self.nbytes > size:
            raise TransportError(f"NIXL slot {self.index} holds {size} bytes, not "
                                 f"{self.offset + self.nbytes}")
        base = address + self.offset
        if index is None:
            if not dst.is_contiguous() or dst.shape != self.shape:
                raise ValueError(f"READ into {list(dst.shape)}: wants {list(self.shape)}")
            return (np.array([[dst.data_ptr(), self.nbytes, self.end.dev_id]]),
                    np.array([[base, self.nbytes, device]]))
        starts, lengths, slots = _runs(index.cpu().numpy())
        row, planes, at = _rows(dst, self.shape), self.shape[0] * 2, dst.data_ptr()
        es = dst.element_size()
        plane_at = (np.arange(self.shape[0])[:, None] * dst.stride(0)
                    + np.arange(2)[None, :] * dst.stride(1)).reshape(-1) * es  # [P]
        local = at + plane_at[:, None] + (slots * dst.stride(2) * es)[None, :]  # [P, R]
        remote = base + (np.arange(planes) * self.shape[2] * row)[:, None] \
            + (starts * row)[None, :]  # [P, R]
        sizes = np.broadcast_to(lengths * row, local.shape)
        return (_descs(local, sizes, self.end.dev_id), _descs(remote, sizes, device))


def _runs(index: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Runs of consecutive values in `index`: (start position, length, first value)."""
    starts = np.concatenate([[0], np.flatnonzero(np.diff(index) != 1) + 1])
    lengths = np.diff(np.concatenate([starts, [len(index)]]))
    return starts, lengths, index[starts]


def _rows(dst: torch.Tensor, shape: torch.Size) -> int:
    """Bytes of one token's row; refuses pool rows that are not contiguous rows."""
    row = shape[3:].numel() * dst.element_size()
    if dst.dim() != 5 or tuple(dst.shape[3:]) != tuple(shape[3:]) or \
            dst.shape[:2] != shape[:2] or dst.stride(2) * dst.element_size() != row or \
            not dst[0, 0, 0].is_contiguous():
        raise ValueError(f"READ into pool rows {list(dst.shape)}: wants [nl, 2, S, "
                         f"{', '.join(map(str, shape[3:]))}] with contiguous rows")
    return row


def _descs(addresses: np.ndarray, sizes: np.ndarray, device: int) -> np.ndarray:
    return np.stack([addresses.ravel(), sizes.ravel(),
                     np.full(addresses.size, device)], axis=1).astype(np.int64)  # [N, 3]
