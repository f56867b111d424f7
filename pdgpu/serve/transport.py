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
same channel.
"""

from __future__ import annotations

import queue
import re
import threading
import time
from datetime import timedelta
from typing import Protocol
from urllib.parse import urlparse

import attrs
import orjson
import torch
import torch.distributed as dist

HEADER_LEN = 2  # [json bytes, number of tensors]
DTYPES = {str(t): t for t in (torch.float32, torch.bfloat16, torch.float16, torch.int64,
                              torch.int32, torch.uint8)}


class TransportError(RuntimeError):
    """The link to a peer broke or could not be made; the message says which and why."""


@attrs.frozen
class Message:
    src: int
    op: str
    body: dict
    tensors: tuple[torch.Tensor, ...] = ()
    generation: int = 0  # of the link it came over


class Transport(Protocol):
    rank: int

    def peers(self) -> list[int]: ...

    def connect(self, peer: int, generation: int = 0, alive=lambda: None) -> None: ...

    def connect_async(self, peer: int, generation: int) -> None: ...

    def drop(self, peer: int) -> None: ...

    def send(self, dst: int, op: str, body: dict | None = None, tensors=()) -> None: ...

    def get(self, timeout: float | None) -> Message | None: ...

    def close(self) -> None: ...


@attrs.frozen
class Endpoint:
    host: str
    port: int


def parse_init_method(text: str) -> Endpoint:
    """`tcp://HOST:PORT` -> Endpoint; ValueError naming the rule otherwise."""
    url = urlparse(text)
    try:
        port = url.port
    except ValueError:
        port = None
    if url.scheme != "tcp" or not url.hostname or port is None:
        raise ValueError(f"init-method must be tcp://HOST:PORT, got {text!r}")
    return Endpoint(url.hostname, port)


def open_store(endpoint: Endpoint, rank: int, world_size: int, timeout_s: float):
    """The rendezvous store; rank 0 serves it (port 0: any free port, see `.port`)."""
    return dist.TCPStore(endpoint.host, endpoint.port, world_size, is_master=rank == 0,
                         timeout=timedelta(seconds=timeout_s), wait_for_workers=False)


IDLE_WAIT = timedelta(days=7)  # a receiving thread may wait this long for the next message


def connect_gloo(store, rank: int, world_size: int, timeout_s: float, alive=lambda: None):
    """A gloo process group of its own (no torch.distributed global state, so one process
    may run several at once). Connects in a helper thread while `alive()` checks the peers
    (it raises when one died); TransportError after `timeout_s`."""
    result: dict = {}

    def connect() -> None:
        try:
            result["pg"] = dist.ProcessGroupGloo(store, rank, world_size,
                                                 timedelta(seconds=timeout_s))
        except Exception as e:  # noqa: BLE001 - torch raises several types for one cause
            result["error"] = e

    thread = threading.Thread(target=connect, daemon=True, name="pdgpu-connect")
    thread.start()
    while thread.is_alive():
        thread.join(timeout=0.1)
        alive()
    if "error" in result:
        raise TransportError(f"rank {rank}: cannot join the process group "
                             f"({_first_line(result['error'])})")
    return result["pg"]


class Link:
    """One connected peer: a two-rank gloo group (this side's rank in it is `me`)."""

    def __init__(self, pg, me: int, peer: int, generation: int) -> None:
        self.pg, self.me, self.peer, self.generation = pg, me, peer, generation
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()  # frames to send; None: stop
        self.error: str | None = None  # the link broke
        self.thread: threading.Thread | None = None  # receiving
        self.sender: threading.Thread | None = None

    @property
    def other(self) -> int:
        return 1 - self.me


class GlooTransport:
    """torch.distributed point-to-point over gloo, one two-rank group per link.

    Sends wait at most the connect timeout (a live peer's receiving thread always waits for
    the next message); receives wait up to IDLE_WAIT (a producer may idle a long time)."""

    def __init__(self, store, rank: int, timeout_s: float = 60.0) -> None:
        self.store, self.rank, self.timeout_s = store, rank, timeout_s
        self.links: dict[int, Link] = {}
        self.generations: dict[int, int] = {}  # peer -> its current link's generation
        self.dropped: list[Link] = []  # kept: a group is not destroyed under a blocked recv
        self.inbox: queue.Queue = queue.Queue()
        self.closing = threading.Event()

    def peers(self) -> list[int]:
        return sorted(self.links)

    def connect(self, peer: int, generation: int = 0, alive=lambda: None) -> None:
        """Join the link to `peer` (both sides call this with the same generation)."""
        self.generations[peer] = generation
        low, high = sorted((self.rank, peer))
        store = dist.PrefixStore(f"link/{low}/{high}/{generation}", self.store)
        me = 0 if self.rank == low else 1
        link = Link(connect_gloo(store, me, 2, self.timeout_s, alive), me, peer, generation)
        link.thread = threading.Thread(target=self._receive, args=(link,), daemon=True,
                                       name=f"pdgpu-recv-{peer}")
        link.sender = threading.Thread(target=self._send_loop, args=(link,), daemon=True,
                                       name=f"pdgpu-send-{peer}")
        if self.generations.get(peer) != generation:  # given up while it connected
            self.dropped.append(link)
            return
        self.links[peer] = link
        link.thread.start()
        link.sender.start()

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

        threading.Thread(target=run, daemon=True, name=f"pdgpu-join-{peer}").start()

    def drop(self, peer: int) -> None:
        """Tear down the link to `peer`: nothing more is sent over it or taken from it."""
        self.generations.pop(peer, None)
        link = self.links.pop(peer, None)
        if link is not None:
            link.outbox.put(None)
            self.dropped.append(link)

    def send(self, dst: int, op: str, body: dict | None = None, tensors=()) -> None:
        """Queue one whole message to `dst` (the tensors are not copied: hand over tensors
        nobody writes any more); TransportError when the link is gone or broke."""
        link = self.links.get(dst)
        if link is None or link.error is not None:
            raise TransportError(f"send to {peer_name(dst)} failed: "
                                 f"{'no link' if link is None else link.error}")
        tensors = [t.contiguous() for t in tensors]
        meta = {"op": op, "body": body or {},
                "tensors": [[str(t.dtype), list(t.shape)] for t in tensors]}
        raw = torch.frombuffer(bytearray(orjson.dumps(meta)), dtype=torch.uint8)  # [n]
        header = torch.tensor([raw.numel(), len(tensors)], dtype=torch.int64)  # [2]
        link.outbox.put((header, raw, *tensors))

    def _send_loop(self, link: Link) -> None:
        try:
            while (frames := link.outbox.get()) is not None:
                for t in frames:
                    if t.numel():
                        link.pg.send([t], link.other, 0).wait()
        except Exception as e:  # noqa: BLE001 - the link broke: tell the owner once
            link.error = _first_line(e)
            if not self.closing.is_set():
                self.inbox.put(Message(link.peer, "lost", {
                    "error": f"send to {peer_name(link.peer)} failed: {link.error}"},
                    (), link.generation))

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
        False when one is still blocked."""
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
        return not any(link.thread.is_alive() for link in links)

    def _receive(self, link: Link) -> None:
        try:
            while True:
                self.inbox.put(self._receive_one(link))
        except Exception as e:  # noqa: BLE001 - the link broke: tell the owner once
            if not self.closing.is_set():
                self.inbox.put(Message(link.peer, "lost", {
                    "error": f"link to {peer_name(link.peer)} broke: {_first_line(e)}"},
                    (), link.generation))

    def _receive_one(self, link: Link) -> Message:
        header = torch.zeros(HEADER_LEN, dtype=torch.int64)  # [2]
        self._recv(link, header, IDLE_WAIT)
        raw = torch.empty(int(header[0]), dtype=torch.uint8)  # [n]
        self._recv(link, raw)
        meta = orjson.loads(raw.numpy().tobytes())
        tensors = []
        for dtype, shape in meta["tensors"]:
            t = torch.empty(shape, dtype=DTYPES[dtype])
            if t.numel():
                self._recv(link, t)
            tensors.append(t)
        return Message(link.peer, meta["op"], meta["body"], tuple(tensors), link.generation)

    @staticmethod
    def _recv(link: Link, tensor: torch.Tensor, wait: timedelta | None = None) -> None:
        work = link.pg.recv([tensor], link.other, 0)
        if wait is None:
            work.wait()
        else:
            work.wait(wait)


def peer_name(rank: int) -> str:
    """Rank 0 is the decoder, rank r >= 1 is producer p<r>."""
    return "the decoder" if rank == 0 else f"producer p{rank}"


def _first_line(e: Exception) -> str:
    """The cause in one line, without gloo's source-file prefix."""
    lines = str(e).strip().splitlines()
    text = re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", lines[0]) if lines else ""
    return text[:160] or type(e).__name__
