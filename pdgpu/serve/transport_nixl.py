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
from pdgpu.serve.nixl_end import (  # noqa: F401 - SLOTS, SLOT_BYTES: imported from here
    ALIGN,
    POLL_S,
    SLOT_BYTES,
    SLOTS,
    NixlEnd,
    check_wait,
    layout,
    view,
)
from pdgpu.serve.rendezvous import NIXL, TransportError, first_line, peer_name
from pdgpu.serve.transport import GlooTransport

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
        link.nixl = end = NixlEnd(nixl_module(), name, self.device)
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
        if getattr(link, "staged", None):  # staged before and never sent: free again
            self._end(link).free.add(link.staged[0])
            link.staged = None
        index = self._acquire(link, nbytes)
        memory = self._end(link).slots[index].memory
        views = [view(memory, o, t.dtype, t.shape) for t, o in zip(shells, offsets, strict=True)]
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
                view(end.slots[index].memory, offset, t.dtype, t.shape).copy_(t)
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
            check_wait(self._broken(link), deadline, "no NIXL slot came back")
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
        try:
            answer = orjson.loads(self._link_store(link).get(key))
        except Exception as e:  # noqa: BLE001 - the store's errors: the decoder is gone
            raise TransportError(f"NIXL slot {index} not grown: {first_line(e)}") from None
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
        return view(self._end(link).slots[int(index)].memory, int(offset), dtype, shape)

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
