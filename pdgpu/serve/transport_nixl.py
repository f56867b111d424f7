"""KV between two serving processes through NVIDIA NIXL (lane `nixl`, `--kv-lane nixl`).

Why: vLLM, SGLang and Dynamo move disaggregated KV with NIXL (UCX underneath: cross-memory
attach or TCP on one host, CUDA IPC and RDMA with GPUs and NICs); this lane lets our protocol
and checks run on that transfer layer. Only the bytes move here: every message's header and
JSON (issue, land, fence, handshake, beats) stay on the link's gloo group, as for `shm`.
- Each link has a NIXL agent at each end (created at connect, removed when the link is
  dropped: a dead producer's agent goes with its link). The decoder (the link's rank 0, the
  reader) registers a ring of SLOTS staging slots once; the producer (rank 1, the writer)
  registers a local ring of the same shape and gathers a span straight into a local slot.
- WRITE, not READ (measured on this 2-core box, 4 MiB transfers over UCX `cma`: p50 0.4-0.6
  ms per WRITE, 0.4-0.5 ms per READ, equal within noise): with WRITE the producer stays the
  writer (the contract's fence is about it), and the decoder's loop never waits on a transfer.
- A message's bytes go by one WRITE into the same slot of the decoder's ring, with a NIXL
  notification; the producer sends the control message only once NIXL reports the transfer
  DONE, and the decoder's receiving thread takes it only once that notification arrived (NIXL
  delivers it after the data), so `land` never sees bytes in flight. The slot is the
  decoder's until its owner copied the tensors out (`done`): a notification `free` hands it
  back. A slot too small for a message is replaced first (`grow`, asked over gloo, answered
  through the link's store with the new slot's registration).
- No wait is unbounded: a killed peer makes NIXL raise (nixlRemoteDisconnectError), but a
  stopped one never errors, so every wait has the connect timeout as its deadline and gives up
  when the link is dropped. A transfer past it is released (NIXL cancels it) and the link
  fails: the producer exits and is fenced as dead (specs/contract.md, 'writer stopped').
- The progress thread is off (`enable_prog_thread=False`: the default one spun ~65% of a core
  and cut throughput 3-6x here), so each end polls its agent every POLL_S in a thread of its
  own; one lock per agent (an agent is not thread-safe without a listener thread).
- On CUDA both rings are device memory ("VRAM" descriptors): KV goes device to device where
  UCX can (not yet run on a GPU: scripts/gpu_check.sh).
"""

from __future__ import annotations

import importlib
import logging
import logging.config
import os
import threading
import time
from contextlib import suppress

import attrs
import orjson
import torch

from pdgpu.serve.link import Link, Message
from pdgpu.serve.rendezvous import NIXL, TransportError, first_line, peer_name
from pdgpu.serve.transport import GlooTransport

SLOTS = 8  # per link, like the shm ring (max_pending bounds it in practice)
SLOT_BYTES = 1 << 20  # a slot's first size; `grow` doubles past what a message needs
ALIGN = 64
POLL_S = 0.001  # between polls of an idle agent
WAIT_S = 0.0001  # between looks at a transfer in flight
GROW = "nixl-grow"  # a control message the decoder's receiving thread answers itself


def nixl_module():
    """The NIXL package (nixl-cu13, or the `nixl` meta package), or None. Imported without
    its logging set-up: that one runs logging.config.dictConfig, which closes every handler
    of the process, and prints INFO lines on stdout (into `--json`). Its warnings go to
    stderr (Python's last-resort handler)."""
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # its C++ core's level
    for name in ("nixl_cu13", "nixl"):
        real, logging.config.dictConfig = logging.config.dictConfig, lambda config: None
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        finally:
            logging.config.dictConfig = real
        logging.getLogger("nixl").setLevel(logging.WARNING)
        return module
    return None


def nixl_missing() -> str | None:
    """Why `--kv-lane nixl` cannot run here, in one line; None when it can."""
    if nixl_module() is None:
        return ("nixl needs the NIXL package, which is not installed: pip install --no-deps "
                "nixl-cu13 (or pip install '.[nixl]')")
    return None


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

    def __init__(self, name: str, device: torch.device) -> None:
        api = nixl_module()
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
            with self.arrived:
                if want in self.notes:
                    self.notes.remove(want)
                    return
                self.arrived.wait(POLL_S)
            self.take_notes()
            _check(broken(), deadline, f"NIXL notification {want.decode()!r}")

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
                _check(broken(), deadline, "NIXL WRITE")
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


def _check(why: str | None, deadline: float, what: str) -> None:
    if why is not None:
        raise TransportError(f"{what}: {why}")
    if time.monotonic() > deadline:
        raise TransportError(f"{what}: not done in time (a stopped peer never errors)")


class NixlTransport(GlooTransport):
    """GlooTransport whose links take NIXL for the producer's tensors when both ends offer
    it (rendezvous.choose_lane); everything else is GlooTransport's."""

    def __init__(self, store, rank: int, timeout_s: float = 60.0, device: str = "cpu") -> None:
        super().__init__(store, rank, timeout_s, shm=False)
        self.device = torch.device(device)
        self.serial = 0  # names this end's transfers and grows
        self.placing = threading.local()  # `via`s of the message the calling thread sends

    def descriptor(self) -> dict:
        return {"device": str(self.device), "gpu": None, "nixl": True}

    def _end(self, link: Link) -> NixlEnd | None:
        return getattr(link, "nixl", None)

    # -- connect and teardown -----------------------------------------------------------------

    def _open_data(self, link: Link, store) -> None:
        """Both agents, the rings, each other's metadata, then a first WRITE and a first
        notification back: a link that cannot carry NIXL fails at connect."""
        if link.lane != NIXL:
            return
        name = f"pdgpu-{self.rank}-{link.peer}-{link.generation}-{os.getpid()}"
        link.nixl = end = NixlEnd(name, self.device)
        store.set(f"nixl/md/{link.me}", end.metadata())
        if link.me == 0:
            store.set("nixl/ring", orjson.dumps([end.describe(i) for i in range(SLOTS)]))
        end.add_peer(store.get(f"nixl/md/{link.other}"))
        deadline = time.monotonic() + self.timeout_s
        if link.me == 1:
            for slot, remote in zip(end.slots, orjson.loads(store.get("nixl/ring")),
                                    strict=True):
                slot.remote = tuple(remote)
            end.write(0, ALIGN, b"hello", deadline, lambda: None)
            end.wait_note(b"ready", deadline, lambda: None)
        else:
            end.wait_note(b"hello", deadline, lambda: None)
            end.notify(b"ready")

    def _abort_data(self, link: Link) -> None:
        end = self._end(link)
        if end is not None and not end.closed.is_set():
            end.close()

    # -- the writer ---------------------------------------------------------------------------

    def _writes(self, link: Link | None) -> bool:
        return link is not None and link.me == 1 and self._end(link) is not None

    def staging(self, dst: int, specs, device) -> list[torch.Tensor]:
        """Views of a free local slot (the producer gathers straight into it: `send` then
        WRITEs it as it is), else GlooTransport's."""
        link = self.links.get(dst)
        if not self._writes(link) or not all(torch.Size(s).numel() for s, _ in specs):
            return super().staging(dst, specs, device)
        shells = [torch.empty(shape, dtype=dtype, device="meta") for shape, dtype in specs]
        offsets, nbytes = layout(shells)
        index = self._acquire(link, nbytes)
        memory = self._end(link).slots[index].memory
        views = [_view(memory, o, t.dtype, t.shape) for t, o in zip(shells, offsets, strict=True)]
        link.staged = (index, views)
        return list(views)

    def send(self, dst: int, op: str, body: dict | None = None, tensors=()) -> None:
        """A message whose tensors go by NIXL: WRITten (on the caller's thread) before its
        control message is queued, each tensor's `via` naming slot and offset."""
        link = self.links.get(dst)
        tensors = [t.contiguous() for t in tensors]
        if not (self._writes(link) and link.error is None and any(t.numel() for t in tensors)):
            return super().send(dst, op, body, tensors)
        self.placing.vias = iter(self._place(link, [t for t in tensors if t.numel()]))
        try:
            return super().send(dst, op, body, tensors)
        finally:
            self.placing.vias = None

    def _place(self, link: Link, tensors) -> list[str]:
        end = self._end(link)
        index, views = getattr(link, "staged", None) or (None, ())
        link.staged = None
        offsets, nbytes = layout(tensors)
        if index is None or [v.data_ptr() for v in views] != [t.data_ptr() for t in tensors]:
            if index is not None:
                end.free.add(index)  # staged, then not sent: free again
            index = self._acquire(link, nbytes)
            for t, offset in zip(tensors, offsets, strict=True):
                _view(end.slots[index].memory, offset, t.dtype, t.shape).copy_(t)
        if end.device.type == "cuda":  # the gather or copy into the slot ran on a stream
            torch.cuda.current_stream(end.device).synchronize()
        self.serial += 1
        try:
            end.write(index, nbytes, b"w%d" % self.serial, self._deadline(),
                      lambda: self._broken(link))
        except Exception as e:  # noqa: BLE001 - NIXL raises its own types: the link broke
            raise TransportError(f"send to {peer_name(link.peer)} failed: {first_line(e)}") \
                from None
        return [f"{NIXL}:{index}:{o}:{self.serial}" for o in offsets]

    def _acquire(self, link: Link, nbytes: int) -> int:
        """A free slot of at least `nbytes` (grown first if smaller), now the message's."""
        end = self._end(link)
        deadline = self._deadline()
        while not end.free:
            with end.arrived:
                end.arrived.wait(POLL_S)
            self._take_frees(end)
            _check(self._broken(link), deadline, "no NIXL slot came back")
        index = min(end.free)
        end.free.discard(index)
        if end.slots[index].memory.numel() < nbytes:
            self._grow(link, index, nbytes)
        return index

    def _take_frees(self, end: NixlEnd) -> None:
        end.take_notes()
        with end.arrived:
            frees = [n for n in end.notes if n.startswith(b"free")]
            end.notes = [n for n in end.notes if not n.startswith(b"free")]
        end.free.update(int(n[4:]) for n in frees)

    def _grow(self, link: Link, index: int, nbytes: int) -> None:
        """Both ends replace slot `index` by a larger one; the decoder's new registration
        comes back through the link's store (its agent metadata, loaded again here)."""
        end = self._end(link)
        end.replace(index, nbytes)
        self.serial += 1
        key = f"nixl/grow/{self.serial}"
        super().send(link.peer, GROW, {"slot": index, "bytes": end.slots[index].memory.numel(),
                                       "key": key})
        answer = orjson.loads(self._link_store(link).get(key))
        end.add_peer(bytes.fromhex(answer["md"]))
        end.slots[index].remote = tuple(answer["slot"])

    def _link_store(self, link: Link):
        import torch.distributed as dist
        low, high = sorted((self.rank, link.peer))
        return dist.PrefixStore(f"link/{low}/{high}/{link.generation}", self.store)

    def _deadline(self) -> float:
        return time.monotonic() + self.timeout_s

    def _via(self, link: Link, tensor: torch.Tensor) -> str | None:
        vias = getattr(self.placing, "vias", None)
        if vias is not None and tensor.numel():
            return next(vias)
        return super()._via(link, tensor)

    def _send_payload(self, link: Link, tensor: torch.Tensor, via: str | None) -> None:
        if via is None or not via.startswith(NIXL):  # else: already in the decoder's slot
            super()._send_payload(link, tensor, via)

    # -- the reader ---------------------------------------------------------------------------

    def _receive_one(self, link: Link) -> Message:
        """GlooTransport's, after the message's NIXL notification came; a `grow` is
        answered here (the owner never sees it)."""
        link.viewed = {}
        msg = super()._receive_one(link)
        while msg.op == GROW:
            self._answer_grow(link, msg.body)
            msg = super()._receive_one(link)
        if not link.viewed:
            return msg
        end = self._end(link)
        for serial in sorted(set(link.viewed.values())):
            end.wait_note(b"w%d" % serial, self._deadline(), lambda: self._broken(link))
        return attrs.evolve(msg, slots=tuple(sorted(link.viewed)))

    def _answer_grow(self, link: Link, body: dict) -> None:
        end = self._end(link)
        end.replace(body["slot"], body["bytes"])
        self._link_store(link).set(body["key"], orjson.dumps(
            {"md": end.metadata().hex(), "slot": end.describe(body["slot"])}))

    def _recv_payload(self, link: Link, dtype: torch.dtype, shape, via: str | None):
        if via is None or not via.startswith(NIXL):
            return super()._recv_payload(link, dtype, shape, via)
        _, index, offset, serial = via.split(":")
        link.viewed[int(index)] = int(serial)
        return _view(self._end(link).slots[int(index)].memory, int(offset), dtype, shape)

    def done(self, msg: Message) -> None:
        """The owner copied `msg`'s tensors out: their slots go back to the writer."""
        link = self.links.get(msg.src)
        end = self._end(link) if link is not None else None
        if end is None:
            return super().done(msg)
        if link.generation != msg.generation:
            return None
        if msg.slots and end.device.type == "cuda":  # the owner's copy out ran on a stream
            torch.cuda.current_stream(end.device).synchronize()
        for index in msg.slots:
            with suppress(Exception):  # the writer died meanwhile: its link is dropped
                end.notify(b"free%d" % index)


def _view(memory: torch.Tensor, offset: int, dtype: torch.dtype, shape) -> torch.Tensor:
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    return memory[offset:offset + nbytes].view(dtype).view(shape)
