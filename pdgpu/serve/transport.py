"""Point-to-point messages between the serving processes, over torch.distributed.

One small interface (`Transport`: connect, send, get, drop, close) so another backend (NIXL,
UCX ...) can be added later. `GlooTransport` is the CPU one. Each pair of processes that talk
(the decoder and one producer) has a *link* of its own: a two-rank gloo process group
rendezvoused under its own store prefix `link/A/B/GENERATION`. gloo cannot re-add a rank to
a group, so a producer that died is replaced by a new process joining a new link (generation
+ 1) while the other links keep serving; the dead link is dropped and anything still queued
from it is discarded. `send` only queues a message: a sending thread per link makes it three
or more blocking gloo `send`s (a fixed-size length header, a JSON body, then each tensor), so
messages never interleave and no caller blocks on a peer that hangs (a stopped process stops
reading, and gloo's send then waits for it). A receiving thread per link does the matching
blocking `recv`s and queues whole messages: the owner polls the queue (gloo's `irecv` cannot
be polled for completion). A broken link (the peer died: gloo sees its socket close) is
reported once as a message `lost` from that peer. KV payloads travel as tensors through the
same channel; at connect both ends agree on the link's lane (rendezvous.py): on one machine the
producer's tensors cross through shared memory (transport_shm.py; the owner calls `done(msg)`
once it copied them out), and a subclass may carry some of its tensors another way
(transport_nccl.py: CUDA tensors over NCCL).
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from collections import Counter
from datetime import timedelta

import orjson
import torch
import torch.distributed as dist

from pdgpu.serve import transport_shm as shared
from pdgpu.serve.link import Link, Message, Transport  # noqa: F401 - imported from here
from pdgpu.serve.rendezvous import (  # noqa: F401 - Endpoint, open_store...: imported from here
    GLOO,
    SHARED,
    SHM,
    SHM_PINNED,
    Endpoint,
    TransportError,
    choose_lane,
    connect_in_thread,
    exchange_descriptors,
    first_line,
    open_store,
    parse_init_method,
    peer_name,
)

HEADER_LEN = 2  # [json bytes, number of tensors]
DTYPES = {str(t): t for t in (torch.float32, torch.bfloat16, torch.float16, torch.int64,
                              torch.int32, torch.uint8)}
IDLE_WAIT = timedelta(days=7)  # a receiving thread may wait this long for the next message
HANG_UP_TAG = 1  # no message uses it (all go on tag 0): an operation on it never completes
HANG_UP_WAIT = timedelta(milliseconds=1)
HANG_UP_JOIN_S = 5.0  # a hung-up link's threads end at once; this only bounds the wait


class GlooTransport:
    """torch.distributed point-to-point over gloo, one two-rank group per link.

    Sends wait at most the connect timeout (a live peer's receiving thread always waits for
    the next message); receives wait up to IDLE_WAIT (a producer may idle a long time).
    `shm`: offer shared memory to a peer on this machine (transport_shm.py)."""

    def __init__(self, store, rank: int, timeout_s: float = 60.0, shm: bool = False) -> None:
        self.store, self.rank, self.timeout_s = store, rank, timeout_s
        self.token = shared.shm_token(shm)  # names the segments of the links this end reads
        self.links: dict[int, Link] = {}
        self.generations: dict[int, int] = {}  # peer -> its current link's generation
        self.dropped: list[Link] = []  # kept: a group is not destroyed under a blocked recv
        self.inbox: queue.Queue = queue.Queue()
        self.closing = threading.Event()
        self.closed = False  # set by close(): a link that finishes joining after it is hung up
        self.registry = threading.Lock()  # close() against a late join's registration
        self.joins: list[threading.Thread] = []  # connect_async's, waited for by close()

    def peers(self) -> list[int]:
        return sorted(self.links)

    def received_bytes(self) -> dict[str, int]:
        """Tensor bytes this end received, by the lane that carried them (a shared-memory
        link's message that found no room in /dev/shm came over gloo)."""
        total: Counter = Counter()
        for link in list(self.links.values()) + self.dropped:
            total.update(link.received)
        return dict(sorted(total.items()))

    def lanes(self) -> dict[int, str]:
        """peer -> the lane its link's tensors take (rendezvous.py)."""
        return {peer: link.lane for peer, link in sorted(self.links.items())}

    def descriptor(self) -> dict:
        """What the other end of a link needs to pick the lane."""
        return {"device": "cpu", "gpu": None}

    def connect(self, peer: int, generation: int = 0, alive=lambda: None) -> None:
        """Join the link to `peer` (both sides call this with the same generation)."""
        self.generations[peer] = generation
        low, high = sorted((self.rank, peer))
        store = dist.PrefixStore(f"link/{low}/{high}/{generation}", self.store)
        me = 0 if self.rank == low else 1
        link = connect_in_thread(lambda given_up: self._open(store, me, peer, generation,
                                                             given_up), self.rank, alive)
        link.thread = threading.Thread(target=self._receive, args=(link,), daemon=True,
                                       name=f"pdgpu-recv-{peer}")
        link.sender = threading.Thread(target=self._send_loop, args=(link,), daemon=True,
                                       name=f"pdgpu-send-{peer}")
        with self.registry:
            if self.closed:  # close() already ran: no thread of it may start now
                self._abort_data(link)
                hang_up(link.pg, link.other)
                shared.close_ends(link.ring, link.views)
                return
            if self.generations.get(peer) != generation:  # given up while it connected
                self._abort_data(link)
                self.dropped.append(link)
                return
            self.links[peer] = link
            link.thread.start()
            link.sender.start()

    def _open(self, store, me: int, peer: int, generation: int, given_up) -> Link:
        """The lane both ends agree on (their descriptors first: waiting for a peer that never
        comes ends once this transport closes or `given_up` is set), the gloo group, and that
        lane's own group if any."""
        mine = {**self.descriptor(), "host": shared.host_id(), "shm": self.token}
        theirs = exchange_descriptors(store, me, mine, self.timeout_s,
                                      lambda: self.closed or given_up.is_set())
        pg = dist.ProcessGroupGloo(store, me, 2, timedelta(seconds=self.timeout_s))
        link = Link(pg, me, peer, generation, choose_lane(mine, theirs))
        if link.lane in SHARED:  # the reader's (rank 0's) stem names the link's segments
            stem = (mine, theirs)[me]["shm"]
            link.ring, link.views = shared.shared_ends(link.lane == SHM_PINNED, me, f"{stem}-"
                                                f"{min(self.rank, peer)}-{max(self.rank, peer)}"
                                                f"-{generation}")
        self._open_data(link, store)
        return link

    def _open_data(self, link: Link, store) -> None:
        """Make the group of a lane other than gloo (none here)."""

    def _abort_data(self, link: Link) -> None:
        """Abort a link's tensor group so nothing waits on it any more (none here)."""

    def connect_async(self, peer: int, generation: int) -> None:
        """Connect in the background; a message `joined` (or `lost`) from `peer` says when."""
        self.generations[peer] = generation

        def run() -> None:
            try:
                self.connect(peer, generation)
            except TransportError as e:
                self.inbox.put(Message(peer, "lost", {"error": str(e)}, (), generation))
                return
            self.inbox.put(Message(peer, "joined", {}, (), generation))

        join = threading.Thread(target=run, daemon=True, name=f"pdgpu-join-{peer}")
        with self.registry:
            self.joins = [t for t in self.joins if t.is_alive()] + [join]
        join.start()

    def drop(self, peer: int) -> None:
        """Tear down the link to `peer`: nothing more is sent over it or taken from it."""
        self.generations.pop(peer, None)
        link = self.links.pop(peer, None)
        if link is not None:
            link.outbox.put(None)
            self._abort_data(link)  # a receive waiting on a dead peer's tensor gives up
            shared.close_ends(link.ring, link.views)  # a dead writer's slots: unmapped, swept
            self.dropped.append(link)

    def send(self, dst: int, op: str, body: dict | None = None, tensors=()) -> None:
        """Queue one whole message to `dst` (the tensors are not copied: hand over tensors
        nobody writes any more); TransportError when the link is gone or broke."""
        link = self.links.get(dst)
        if link is None or link.error is not None:
            raise TransportError(f"send to {peer_name(dst)} failed: "
                                 f"{'no link' if link is None else link.error}")
        tensors = [t.contiguous() for t in tensors]
        vias = [self._via(link, t) for t in tensors]
        placed = None
        if link.ring is not None and tensors and SHM not in vias:  # (the stager's thread:
            shared.unstage(link.ring)  # control messages from others never touch staging)
        if SHM in vias:  # waits for a free slot and copies in: the caller is held, not the link
            placed = self._place(link, [t for t, v in zip(tensors, vias, strict=True)
                                        if v == SHM])
            vias = vias if placed else [None if v == SHM else v for v in vias]
        meta = {"op": op, "body": body or {},
                "tensors": [[str(t.dtype), list(t.shape), via]
                            for t, via in zip(tensors, vias, strict=True)]}
        if placed:
            meta["shm"] = placed
        raw = torch.frombuffer(bytearray(orjson.dumps(meta)), dtype=torch.uint8)  # [n]
        header = torch.tensor([raw.numel(), len(tensors)], dtype=torch.int64)  # [2]
        link.outbox.put((header, raw, tuple((t, v) for t, v in zip(tensors, vias, strict=True)
                                            if v != SHM)))

    def _place(self, link: Link, tensors):
        try:
            return shared.place(link.ring, tensors, lambda: self._broken(link))
        except shared.NoRoom as e:  # this message goes over gloo: said once per link
            if not link.said_no_room:
                link.said_no_room = True
                print(f"pdgpu: kv lane {link.lane} to {peer_name(link.peer)}: {e}; such "
                      "messages go over gloo (the summary's kv_bytes_by_lane counts them)",
                      file=sys.stderr, flush=True)
            return None
        except shared.SlotError as e:
            raise TransportError(f"send to {peer_name(link.peer)} failed: {e}") from None

    def staging(self, dst: int, specs, device) -> list[torch.Tensor]:
        """Buffers to fill for the next message's tensors [(shape, dtype)]: views of a shared
        slot its `send` takes without a copy when this end writes a shared lane and they live
        on the CPU (a producer's gather lands in shared memory), else new tensors on
        `device`."""
        link = self.links.get(dst)
        if link is None or link.ring is None or torch.device(device).type != "cpu" or \
                not all(torch.Size(shape).numel() for shape, _ in specs):
            return [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in specs]
        try:
            return shared.stage(link.ring, specs, lambda: self._broken(link))
        except shared.NoRoom:
            return [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in specs]
        except shared.SlotError as e:
            raise TransportError(f"send to {peer_name(link.peer)} failed: {e}") from None

    def _broken(self, link: Link) -> str | None:
        gone = self.closing.is_set() or self.links.get(link.peer) is not link
        return link.error or ("the link was dropped" if gone else None)

    def _via(self, link: Link, tensor: torch.Tensor) -> str | None:
        """How a tensor travels: through shared memory when this end writes a shared lane,
        else None over the gloo group (a CUDA one through host memory)."""
        return SHM if link.ring is not None and tensor.numel() else None

    def done(self, msg: Message) -> None:
        """The owner copied `msg`'s tensors out: the shared slots they sit in go back to
        the writer (before this they are never written again). Nothing for other lanes."""
        link = self.links.get(msg.src)
        if msg.slots and link is not None and link.generation == msg.generation:
            link.views.release(msg.slots)

    def _send_loop(self, link: Link) -> None:
        try:
            while (frames := link.outbox.get()) is not None:
                header, raw, payload = frames
                for t in (header, raw):
                    link.pg.send([t], link.other, 0).wait()
                for t, via in payload:
                    if t.numel():
                        self._send_payload(link, t, via)
        except Exception as e:  # noqa: BLE001 - the link broke: tell the owner once
            link.error = first_line(e)
            if not self.closing.is_set():
                self.inbox.put(Message(link.peer, "lost", {
                    "error": f"send to {peer_name(link.peer)} failed: {link.error}"},
                    (), link.generation))

    def _send_payload(self, link: Link, tensor: torch.Tensor, via: str | None) -> None:
        link.pg.send([tensor.cpu()], link.other, 0).wait()  # gloo sends host memory

    def get(self, timeout: float | None = None) -> Message | None:
        """The next message from a current link; None when none came within `timeout`."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                msg = self.inbox.get(timeout=left) if left != 0 else self.inbox.get_nowait()
            except queue.Empty:
                return None
            if self.generations.get(msg.src) == msg.generation:
                return msg  # else from a dropped link: discarded

    def close(self, wait_s: float = 5.0, flush_s: float = 2.0) -> bool:
        """Send what is queued (up to `flush_s`), then quiet the receiving threads and wait
        until each one's peer hung up (call once the peers are told to stop or are stopped);
        False when one is still blocked. Then every tensor group is aborted and every link
        still blocked is hung up from this side, so no thread of the transport outlives it
        (its peer sees the link break, as it would at this process's exit). A link that
        finishes joining after this (a restarted producer's) is hung up at once."""
        with self.registry:
            self.closed = True
            links = list(self.links.values())
        deadline = time.monotonic() + flush_s
        for link in links:
            link.outbox.put(None)
        for link in links:
            link.sender.join(timeout=max(0.0, deadline - time.monotonic()))
        self.closing.set()
        deadline = time.monotonic() + wait_s
        for link in links:
            link.thread.join(timeout=max(0.0, deadline - time.monotonic()))
        quiet = not any(link.thread.is_alive() for link in links)
        for link in links + self.dropped:
            self._abort_data(link)  # first: a thread waiting on a tensor lane ends too
        self._hang_up(links + self.dropped)
        for link in links + self.dropped:  # once no receiving thread reads its slots
            shared.close_ends(link.ring, link.views)
        self._end_joins()
        return quiet

    def _end_joins(self) -> None:
        """Wait for the joins still in flight: one waiting for its peer gives up at `closed`,
        one that finishes is hung up (connect); HANG_UP_JOIN_S at most."""
        deadline = time.monotonic() + HANG_UP_JOIN_S
        for join in self.joins:
            join.join(timeout=max(0.0, deadline - time.monotonic()))

    def _hang_up(self, links: list[Link]) -> None:
        """End the threads of links whose peer did not hang up: a blocked gloo operation
        cannot be cancelled (the group's abort does not reach it), but one that times out
        closes the link's connection, which fails every other pending on it at once, both
        ends'. Waits HANG_UP_JOIN_S at most for the threads to see it."""
        blocked = [link for link in links if _alive(link.thread) or _alive(link.sender)]
        for link in blocked:
            hang_up(link.pg, link.other)
        deadline = time.monotonic() + HANG_UP_JOIN_S
        for link in blocked:
            for thread in (link.sender, link.thread):
                if _alive(thread):
                    thread.join(timeout=max(0.0, deadline - time.monotonic()))

    def _receive(self, link: Link) -> None:
        try:
            while True:
                self.inbox.put(self._receive_one(link))
        except Exception as e:  # noqa: BLE001 - the link broke: tell the owner once
            if not self.closing.is_set():
                self.inbox.put(Message(link.peer, "lost", {
                    "error": f"link to {peer_name(link.peer)} broke: {first_line(e)}"},
                    (), link.generation))

    def _receive_one(self, link: Link) -> Message:
        header = torch.zeros(HEADER_LEN, dtype=torch.int64)  # [2]
        self._recv(link, header, IDLE_WAIT)
        raw = torch.empty(int(header[0]), dtype=torch.uint8)  # [n]
        self._recv(link, raw)
        meta = orjson.loads(raw.numpy().tobytes())
        shared = meta.get("shm")
        offsets = iter(shared["offsets"] if shared else ())
        tensors = [link.views.view(shared, next(offsets), DTYPES[dtype], shape) if via == [SHM]
                   else self._recv_payload(link, DTYPES[dtype], shape, via[0] if via else None)
                   for dtype, shape, *via in meta["tensors"]]
        for (_, _, *via), t in zip(meta["tensors"], tensors, strict=True):
            lane = link.lane if via == [SHM] else (via[0] if via and via[0] else GLOO)
            link.received[lane] += t.nbytes  # (a NIXL RemoteSlice has its nbytes too)
        return Message(link.peer, meta["op"], meta["body"], tuple(tensors), link.generation,
                       (shared["slot"],) if shared else ())

    def _recv_payload(self, link: Link, dtype: torch.dtype, shape, via: str | None):
        """One tensor of a message; over gloo it arrives in host memory."""
        t = torch.empty(shape, dtype=dtype)
        if t.numel():
            self._recv(link, t)
        return t

    @staticmethod
    def _recv(link: Link, tensor: torch.Tensor, wait: timedelta | None = None) -> None:
        work = link.pg.recv([tensor], link.other, 0)
        if wait is None:
            work.wait()
        else:
            work.wait(wait)


def hang_up(pg, other: int) -> None:
    """Close a two-rank gloo group's connection from this side: a receive that cannot
    complete times out, and gloo closes the connection on a timeout."""
    try:
        pg.recv([torch.zeros(1)], other, HANG_UP_TAG).wait(HANG_UP_WAIT)
    except RuntimeError:  # the timeout (or the connection was already closed): hung up
        pass


def _alive(thread: threading.Thread | None) -> bool:
    return thread is not None and thread.is_alive()
