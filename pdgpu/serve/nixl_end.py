"""One end of a link's NIXL lane (transport_nixl.py): its agent, its registered ring of
staging slots, the thread that keeps UCX progressing, the notifications, and the WRITE of one
slot into the other end's. The NIXL package is passed in (transport_nixl.nixl_module), so
nothing here imports it."""

from __future__ import annotations

import threading
import time
from contextlib import suppress

import attrs
import torch

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
    remote: tuple[int, int, int] | None = None  # the decoder's slot: (address, bytes, device)


class NixlEnd:
    """One end of a link's NIXL lane: its agent, its ring, the poller, the notifications."""

    def __init__(self, api, name: str, device: torch.device) -> None:
        self.name, self.device = name, device
        self.mem = "DRAM" if device.type == "cpu" else "VRAM"
        self.dev_id = (device.index or 0) if device.type == "cuda" else 0
        self.agent = api.nixl_agent(name, api.nixl_agent_config(enable_prog_thread=False,
                                                                backends=["UCX"]))
        self.lock = threading.Lock()  # every call into the agent
        self.arrived = threading.Condition()  # notifications came
        self.notes: list[bytes] = []
        self.free: set[int] = set(range(SLOTS))  # writer: slots it may fill
        self.slots: list[Slot] = [self._slot(SLOT_BYTES) for _ in range(SLOTS)]
        self.peer: str | None = None  # the other end's agent name, once added
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
        """A larger slot `index` (the old one is free: nothing writes it)."""
        old = self.slots[index]
        self.slots[index] = self._slot(max(nbytes, 2 * old.memory.numel()))
        with self.lock:
            self.agent.deregister_memory(old.reg)

    def write(self, index: int, nbytes: int, note: bytes, deadline: float, broken) -> None:
        """WRITE the first `nbytes` of local slot `index` into the decoder's slot `index`;
        returns once NIXL reports it DONE. Past `deadline` (or the link broken) the handle
        is released, which cancels it, and TransportError says why."""
        local, remote = self.slots[index].memory.data_ptr(), self.slots[index].remote
        with self.lock:
            handle = self.agent.initialize_xfer(
                "WRITE", self.agent.get_xfer_descs([(local, nbytes, self.dev_id)], self.mem),
                self.agent.get_xfer_descs([(remote[0], nbytes, remote[2])], self.mem),
                self.peer, note)
            state = self.agent.transfer(handle)
        try:
            while state == "PROC":
                check_wait(broken(), deadline, "NIXL WRITE")
                time.sleep(WAIT_S)
                with self.lock:
                    state = self.agent.check_xfer_state(handle)
            if state != "DONE":
                raise TransportError(f"NIXL WRITE to {self.peer}: state {state}")
        finally:
            with self.lock:
                handle.release()  # a transfer still in flight is cancelled (or it raises)

    def close(self) -> None:
        """Stop polling, remove the peer's agent (the link's UCX endpoint goes), deregister
        every slot and let the agent go. The slots' memory stays as long as the Link: a
        writer not known to have stopped can never write into reused memory."""
        self.closed.set()
        self.poller.join(timeout=2)
        with self.lock:
            if self.peer is not None:
                with suppress(Exception):  # a dead peer's endpoint may already be gone
                    self.agent.remove_remote_agent(self.peer)
            for slot in self.slots:
                with suppress(Exception):
                    self.agent.deregister_memory(slot.reg)
                slot.reg = None
            self.agent = None

    @property
    def registered(self) -> int:
        return sum(slot.reg is not None for slot in self.slots)


def check_wait(why: str | None, deadline: float, what: str) -> None:
    if why is not None:
        raise TransportError(f"{what}: {why}")
    if time.monotonic() > deadline:
        raise TransportError(f"{what}: not done in time (a stopped peer never errors)")


def view(memory: torch.Tensor, offset: int, dtype: torch.dtype, shape) -> torch.Tensor:
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    return memory[offset:offset + nbytes].view(dtype).view(shape)
