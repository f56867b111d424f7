"""What a transport is made of (transport.py): the message, the interface a backend
implements, and one connected peer's link with its lane's ends."""

from __future__ import annotations

import queue
import threading
from collections import Counter
from typing import Protocol

import attrs
import torch

from pdgpu.serve import transport_shm as shared
from pdgpu.serve.rendezvous import GLOO


@attrs.frozen
class Message:
    src: int
    op: str
    body: dict
    tensors: tuple = ()  # torch.Tensor, or a NIXL lane's RemoteSlice: `rows_into`, `local`
    generation: int = 0  # of the link it came over
    slots: tuple[int, ...] = ()  # shared-memory slots its tensors sit in (until `done`)


def rows_into(dst: torch.Tensor, src, index: torch.Tensor | None = None) -> None:
    """dst[:, :, index] = src (all of dst when `index` is None). A tensor is copied; bytes
    still in the producer's memory (the NIXL lane's RemoteSlice) are READ straight into
    dst (TransportError when that fails)."""
    if not isinstance(src, torch.Tensor):
        src.copy_into(dst, index)
    elif index is None:
        dst.copy_(src)
    else:
        dst.index_copy_(2, index, src.to(dst.device))


def local(src, device) -> torch.Tensor:
    """A message's tensor on `device` (a RemoteSlice READ into a new one)."""
    return src.to(device) if isinstance(src, torch.Tensor) else src.read(device)


class Transport(Protocol):
    rank: int

    def peers(self) -> list[int]: ...

    def lanes(self) -> dict[int, str]: ...

    def connect(self, peer: int, generation: int = 0, alive=lambda: None) -> None: ...

    def connect_async(self, peer: int, generation: int) -> None: ...

    def drop(self, peer: int) -> None: ...

    def send(self, dst: int, op: str, body: dict | None = None, tensors=()) -> None: ...

    def done(self, msg: Message) -> None: ...

    def staging(self, dst: int, specs, device) -> list[torch.Tensor]: ...

    def get(self, timeout: float | None) -> Message | None: ...

    def close(self) -> None: ...



class Link:
    """One connected peer: a two-rank gloo group (this side's rank in it is `me`), the lane
    both ends agreed on, and the group that carries its tensors when that is not gloo."""

    def __init__(self, pg, me: int, peer: int, generation: int, lane: str = GLOO) -> None:
        self.pg, self.me, self.peer, self.generation = pg, me, peer, generation
        self.lane = lane
        self.data = None  # a tensor lane's own process group (transport_nccl.py)
        self.ring: shared.WriterRing | None = None  # shared-memory lane, the sending end
        self.views: shared.ReaderViews | None = None  # shared-memory lane, the receiving end
        self.aborted = threading.Event()  # its data group was aborted: stop waiting on it
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()  # frames to send; None: stop
        self.error: str | None = None  # the link broke
        self.thread: threading.Thread | None = None  # receiving
        self.sender: threading.Thread | None = None
        self.received: Counter = Counter()  # lane -> tensor bytes received (its thread's)
        self.said_no_room = False  # a message found no room in /dev/shm (said once)

    @property
    def other(self) -> int:
        return 1 - self.me
