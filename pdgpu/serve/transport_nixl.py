"""KV between two serving processes through NVIDIA NIXL (lane `nixl`, `--kv-lane nixl`).

Why: vLLM, SGLang and Dynamo move disaggregated KV with NIXL (UCX underneath: cross-memory
attach or TCP on one host, CUDA IPC and RDMA with GPUs and NICs); this lane lets our protocol
and checks run on that transfer layer. Only the bytes move here: every message's header and
JSON (issue, land, fence, handshake, beats) stay on the link's gloo group, as for `shm`.
- Each link has a NIXL agent at each end (created at connect, removed when the link is
  dropped: a dead producer's agent goes with its link). The producer (the link's rank 1)
  registers a ring of SLOTS staging slots once and gathers a span straight into one; the
  decoder (rank 0) registers its pool the first time a span lands in it.
- READ by the decoder, straight into its slab pages, not WRITE by the producer. Both cost
  the same here (4 MiB over UCX `cma` on this 2-core box: p50 0.4-0.6 ms per WRITE, 0.4-0.5
  ms per READ); READ decides by safety: the decoder's Ledger starts it inside `land`, after
  pdref's `landing` check and before the `land` event, and it has ended (done, or its handle
  released) when `land` returns. So every byte written into a page is written by the one
  process that checks, for a span pdref holds in flight, and no producer, however stale,
  can write into a page freed and handed to another request meanwhile (a WRITE into the
  pool would need a grant per span from the decoder, one more round trip, to say the same).
- The producer's `span` message names the slot and offset of each tensor (`via`); the
  decoder's receiving thread hands the owner `RemoteSlice`s (nothing is copied before the
  owner asks). The slot is the decoder's until its owner is done with the message (`done`):
  a notification `free` hands it back. A slot too small for a message is replaced first
  (`grow`: its new registration rides a control message ahead of the span, loaded by the
  decoder's reading thread before its next READ).
- No wait is unbounded: a killed peer makes NIXL raise (nixlRemoteDisconnectError), but a
  stopped one never errors, so every wait has the connect timeout as its deadline and gives
  up when the link is dropped. A READ past it is released (NIXL cancels it) and its span
  fails; where NIXL cannot cancel, the agent goes (specs/contract.md, 'writer stopped').
  The decoder's loop waits on its READ (bounded): with `cma` or CUDA IPC that is a copy.
- The progress thread is off (`enable_prog_thread=False`: the default one spun ~65% of a core
  and cut throughput 3-6x here), so each end polls its agent every POLL_S in a thread of its
  own; one lock per agent (an agent is not thread-safe without a listener thread).
- On CUDA the slots and the pool are device memory ("VRAM" descriptors): KV goes device to
  device where UCX can (not yet run on a GPU: scripts/gpu_check.sh).
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
    POLL_S,
    SLOT_BYTES,
    SLOTS,
    NixlEnd,
    RemoteSlice,
    check_wait,
    layout,
    view,
)
from pdgpu.serve.rendezvous import NIXL, TransportError
from pdgpu.serve.transport import GlooTransport

GROW = "nixl-grow"  # a control message the decoder's receiving thread takes itself
HELLO = b"hello"  # READ from the producer's first slot at connect: the lane works


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
        self.placing = threading.local()  # `via`s of the message the calling thread sends

    def descriptor(self) -> dict:
        return {"device": str(self.device), "gpu": None, "nixl": True}

    def _end(self, link: Link) -> NixlEnd | None:
        return getattr(link, "nixl", None)

    # -- connect and teardown -----------------------------------------------------------------

    def _open_data(self, link: Link, store) -> None:
        """Both agents, the producer's ring, each other's metadata, then a first READ and a
        first notification back: a link that cannot carry NIXL fails at connect."""
        if link.lane != NIXL:
            return
        name = f"pdgpu-{self.rank}-{link.peer}-{link.generation}-{os.getpid()}"
        writer = link.me == 1
        link.nixl = end = NixlEnd(nixl_module(), name, self.device, SLOTS if writer else 0)
        store.set(f"nixl/md/{link.me}", end.metadata())
        if writer:
            end.slots[0].memory[:len(HELLO)].copy_(torch.frombuffer(bytearray(HELLO),
                                                                    dtype=torch.uint8))
            store.set("nixl/ring", orjson.dumps([end.describe(i) for i in range(SLOTS)]))
        end.add_peer(store.get(f"nixl/md/{link.other}"))
        if writer:
            end.wait_note(b"ready", self._deadline(), lambda: None)
            return
        end.remote = {i: tuple(d) for i, d in enumerate(orjson.loads(store.get("nixl/ring")))}
        hello = RemoteSlice(end, 0, 0, torch.uint8, (len(HELLO),), self.timeout_s,
                            lambda: None).read("cpu")
        if bytes(hello.numpy()) != HELLO:
            raise TransportError(f"NIXL lane check: read {bytes(hello.numpy())!r}")
        end.notify(b"ready")

    def _abort_data(self, link: Link) -> None:
        end = self._end(link)
        if end is not None and not end.closed.is_set():
            end.close()

    # -- the writer ---------------------------------------------------------------------------

    def _writes(self, link: Link | None) -> bool:
        return link is not None and link.me == 1 and self._end(link) is not None

    def staging(self, dst: int, specs, device) -> list[torch.Tensor]:
        """Views of a free local slot (the producer gathers straight into it, and `send`
        names it as it is for the decoder to READ), else GlooTransport's."""
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
        """A message whose tensors go by NIXL: each in a slot of this end's ring (staged
        there, or copied in on the caller's thread), its `via` naming slot and offset; the
        decoder READs them from there."""
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
            torch.cuda.current_stream(end.device).synchronize()  # (the decoder READs it next)
        return [f"{NIXL}:{index}:{o}" for o in offsets]

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
        """Slot `index` replaced by a larger one; its registration (this agent's metadata
        again) goes to the decoder ahead of the message that uses it."""
        end = self._end(link)
        end.replace(index, nbytes)
        super().send(link.peer, GROW, {"slot": index, "md": end.metadata().hex(),
                                       "desc": end.describe(index)})

    def _deadline(self) -> float:
        return time.monotonic() + self.timeout_s

    def _via(self, link: Link, tensor: torch.Tensor) -> str | None:
        vias = getattr(self.placing, "vias", None)
        if vias is not None and tensor.numel():
            return next(vias)
        return super()._via(link, tensor)

    def _send_payload(self, link: Link, tensor: torch.Tensor, via: str | None) -> None:
        if via is None or not via.startswith(NIXL):  # else: in this end's slot, READ there
            super()._send_payload(link, tensor, via)

    # -- the reader ---------------------------------------------------------------------------

    def _receive_one(self, link: Link) -> Message:
        """GlooTransport's, its tensors in the producer's slots left there (RemoteSlice); a
        `grow` is taken here (the owner never sees it)."""
        link.viewed = set()
        msg = super()._receive_one(link)
        while msg.op == GROW:
            end, body = self._end(link), msg.body
            with end.lock:
                end.grown.append((bytes.fromhex(body["md"]), body["slot"], tuple(body["desc"])))
            msg = super()._receive_one(link)
        return attrs.evolve(msg, slots=tuple(sorted(link.viewed))) if link.viewed else msg

    def _recv_payload(self, link: Link, dtype: torch.dtype, shape, via: str | None):
        if via is None or not via.startswith(NIXL):
            return super()._recv_payload(link, dtype, shape, via)
        _, index, offset = via.split(":")
        link.viewed.add(int(index))
        return RemoteSlice(self._end(link), int(index), int(offset), dtype, shape,
                           self.timeout_s, lambda: self._broken(link))

    def done(self, msg: Message) -> None:
        """The owner is done with `msg` (its slices READ, or dropped): their slots go back
        to the producer."""
        link = self.links.get(msg.src)
        end = self._end(link) if link is not None else None
        if end is None:
            return super().done(msg)
        if link.generation != msg.generation:
            return None
        for index in msg.slots:
            with suppress(Exception):  # the producer died meanwhile: its link is dropped
                end.notify(b"free%d" % index)
