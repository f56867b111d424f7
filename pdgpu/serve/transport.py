"""Point-to-point messages between the serving processes, over torch.distributed.

One small interface (`Transport`: send, get, close) so another backend (NIXL, UCX ...) can be
added later. `GlooTransport` is the CPU one: every message is three or more blocking
`torch.distributed.send`s (a fixed-size length header, a JSON body, then each tensor), guarded
by a lock so messages from several threads never interleave. A receiving thread per peer
does the matching blocking `recv`s and queues whole messages: the owner polls the queue
(gloo's `irecv` cannot be polled for completion), and a sender never waits on the peer's main
loop, only on its receiving thread. KV payloads travel as tensors through the same channel.
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


class Transport(Protocol):
    rank: int
    world_size: int

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
    may run several in turn). Connects in a helper thread while `alive()` checks the peers
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


class GlooTransport:
    """torch.distributed point-to-point over gloo, in a process group of `world_size` ranks.

    Sends wait at most the connect timeout (a live peer's receiving thread always waits for
    the next message); receives wait up to IDLE_WAIT (a producer may idle a long time)."""

    def __init__(self, store, rank: int, world_size: int, timeout_s: float = 60.0,
                 alive=lambda: None) -> None:
        self.rank, self.world_size = rank, world_size
        self.pg = connect_gloo(store, rank, world_size, timeout_s, alive)
        self.inbox: queue.Queue = queue.Queue()
        self.closing = threading.Event()
        self._send_lock = threading.Lock()
        self._threads = [threading.Thread(target=self._receive, args=(peer,), daemon=True,
                                          name=f"pdgpu-recv-{peer}") for peer in self.peers()]
        for thread in self._threads:
            thread.start()

    def peers(self) -> list[int]:
        return [r for r in range(self.world_size) if r != self.rank]

    def send(self, dst: int, op: str, body: dict | None = None, tensors=()) -> None:
        """One whole message to `dst`; blocks until its bytes are handed to the peer."""
        tensors = [t.contiguous() for t in tensors]
        meta = {"op": op, "body": body or {},
                "tensors": [[str(t.dtype), list(t.shape)] for t in tensors]}
        raw = torch.frombuffer(bytearray(orjson.dumps(meta)), dtype=torch.uint8)  # [n]
        header = torch.tensor([raw.numel(), len(tensors)], dtype=torch.int64)  # [2]
        try:
            with self._send_lock:
                for t in (header, raw, *tensors):
                    if t.numel():
                        self.pg.send([t], dst, 0).wait()
        except Exception as e:  # noqa: BLE001
            raise TransportError(f"send to {peer_name(dst)} failed: {_first_line(e)}") from None

    def get(self, timeout: float | None = None) -> Message | None:
        """The next message from any peer; None when none came within `timeout` seconds."""
        try:
            item = self.inbox.get(timeout=timeout) if timeout != 0 else self.inbox.get_nowait()
        except queue.Empty:
            return None
        if isinstance(item, TransportError):
            raise item
        return item

    def close(self, wait_s: float = 5.0) -> bool:
        """Quiet the receiving threads and wait until each one's peer hung up (call once the
        peers are told to stop or are stopped); False when one is still blocked."""
        self.closing.set()
        deadline = time.monotonic() + wait_s
        for thread in self._threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in self._threads)

    def _receive(self, peer: int) -> None:
        try:
            while True:
                self.inbox.put(self._receive_one(peer))
        except Exception as e:  # noqa: BLE001 - the link broke: tell the owner once
            if not self.closing.is_set():
                self.inbox.put(TransportError(f"link to {peer_name(peer)} broke: "
                                              f"{_first_line(e)}"))

    def _receive_one(self, peer: int) -> Message:
        header = torch.zeros(HEADER_LEN, dtype=torch.int64)  # [2]
        self._recv(header, peer, IDLE_WAIT)
        raw = torch.empty(int(header[0]), dtype=torch.uint8)  # [n]
        self._recv(raw, peer)
        meta = orjson.loads(raw.numpy().tobytes())
        tensors = []
        for dtype, shape in meta["tensors"]:
            t = torch.empty(shape, dtype=DTYPES[dtype])
            if t.numel():
                self._recv(t, peer)
            tensors.append(t)
        return Message(peer, meta["op"], meta["body"], tuple(tensors))

    def _recv(self, tensor: torch.Tensor, peer: int, wait: timedelta | None = None) -> None:
        work = self.pg.recv([tensor], peer, 0)
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
