"""The transport of CUDA processes: KV tensors over NCCL, control messages over gloo.

The backend follows the device (`open_transport`): a CPU process gets `GlooTransport` as
before; a CUDA process gets `NcclTransport`, the same interface and the same links. Why
two groups per link and not NCCL alone:
- NCCL carries device memory only, and cannot see a dead peer: a receive from a process
  that died waits on the GPU for ever, while gloo's socket reports the close. So every
  message's header and JSON body stay on the link's gloo group (its receiving thread, its
  `lost`), and only CUDA tensors go over a second two-rank group, an NCCL one, made when the
  link connects under the link's own store prefix (`link/A/B/GENERATION/nccl`: a rejoining
  producer's new generation gets a new NCCL group too) and tried once with a one-element
  send, so a link that cannot carry NCCL fails at connect, not at its first span.
- NCCL sends and receives between two ranks run on one NCCL stream in the order posted, so
  tensors flowing both ways could deadlock (each end's send queued behind its receive). NCCL
  carries only what the higher rank of a link sends (producer -> decoder: the KV); a CUDA
  tensor sent the other way crosses through host memory over gloo.
- Both ends post matching operations: the receiver learns each tensor's dtype, shape and
  lane from the message's JSON (sent first over gloo) and allocates it on its own device.
- No wait on NCCL is unbounded: a posted operation is polled (`Work.is_completed`) and
  abandoned, its group aborted, when the link is dropped (the decoder declared the peer dead:
  its gloo link broke, its process exited, or it went silent) or after the connect timeout.
  The process must not die with it, so NCCL's watchdog is told not to tear the process down
  (TORCH_NCCL_ASYNC_ERROR_HANDLING=0 unless set: the transport aborts groups itself).
- NCCL cannot join two processes on one GPU; such a link (same GPU UUID at both ends) is
  `shm-pinned` on one machine (the producer's CUDA tensors d2h into page-locked shared memory,
  the decoder h2d out of it: transport_shm.py), else `gloo-staged` (they cross through host
  memory over gloo; rendezvous.choose_lane).
Each process sets its CUDA device before any NCCL group is made (and in each thread that
posts NCCL work). Only the lanes are new: framing, generations, `lost` are GlooTransport's.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from pdgpu.serve.devices import kind
from pdgpu.serve.rendezvous import NCCL, TransportError, peer_name
from pdgpu.serve.transport import GlooTransport, Link

POLL_S = 0.0002  # between polls of a posted NCCL operation
ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"


def backend_for(device: str) -> str:
    """The process group a device's tensors need: gloo for CPU, NCCL for CUDA."""
    return "gloo" if kind(device) == "cpu" else "nccl"


def open_transport(store, rank: int, device: str, timeout_s: float = 60.0,
                   kv_lane: str = "gloo") -> GlooTransport:
    """This process's transport for its device; `kv_lane` "shm" offers shared memory to
    peers on this machine (a link takes it when both ends offer it), "nixl" NIXL (on CPU
    or CUDA: transport_nixl.py, imported only then)."""
    if kv_lane == "nixl":
        from pdgpu.serve.transport_nixl import NixlTransport
        return NixlTransport(store, rank, timeout_s, device)
    shm = kv_lane == "shm"
    if backend_for(device) == "gloo":
        return GlooTransport(store, rank, timeout_s, shm)
    return NcclTransport(store, rank, device, timeout_s, shm)


def gpu_identity(device: torch.device) -> str:
    """A GPU's UUID: equal at two ends of a link only when they share one GPU."""
    uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
    return str(uuid) if uuid is not None else f"{socket.gethostname()}/{device}"


def nccl_group(store, me: int, timeout_s: float, name: str):
    """A two-rank NCCL group of its own (no torch.distributed global state)."""
    os.environ.setdefault(ERROR_HANDLING, "0")  # read when the group is made
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timedelta(seconds=2 * timeout_s)  # the transport's own deadline first
    options.is_high_priority_stream = False
    if hasattr(options, "group_name"):  # only names it in NCCL's logs
        options.group_name = name
    return dist.ProcessGroupNCCL(dist.PrefixStore("nccl", store), me, 2, options)


class NcclTransport(GlooTransport):
    def __init__(self, store, rank: int, device: str, timeout_s: float = 60.0,
                 shm: bool = False) -> None:
        super().__init__(store, rank, timeout_s, shm)
        self.device = torch.device(device)
        self._check_backend()
        self._on_device()
        self.identity = self._identity()
        self.abort_lock = threading.Lock()
        self.aborters: list[threading.Thread] = []

    # -- what ties it to CUDA and NCCL (tests on CPU replace these) ---------------------------

    def _check_backend(self) -> None:
        if not dist.is_nccl_available():
            raise TransportError(f"device {self.device}: this torch {torch.__version__} has "
                                 "no NCCL (torch.distributed.is_nccl_available() is false)")

    def _on_device(self) -> None:
        """Make this transport's device current in the calling thread (CUDA's is per thread)."""
        torch.cuda.set_device(self.device)

    def _identity(self) -> dict:
        return {"device": str(self.device), "gpu": gpu_identity(self.device)}

    def _data_group(self, store, me: int, name: str):
        return nccl_group(store, me, self.timeout_s, name)

    @staticmethod
    def _in_device_memory(tensor: torch.Tensor) -> bool:
        return tensor.is_cuda

    # -- the lanes ------------------------------------------------------------------------------

    def descriptor(self) -> dict:
        return self.identity

    def _open_data(self, link: Link, store) -> None:
        if link.lane != NCCL:
            return
        self._on_device()  # this is the connecting thread
        low, high = sorted((self.rank, link.peer))
        link.data = self._data_group(store, link.me, f"pdgpu-link-{low}-{high}-{link.generation}")
        probe = torch.full((1,), float(link.me), device=self.device)  # [1]
        if link.me == 1:
            self._wait(link, link.data.send([probe], 0, 0), "NCCL's first send")
        else:
            self._wait(link, link.data.recv([probe], 1, 0), "NCCL's first receive")
            if probe.item() != 1.0:
                raise TransportError(f"NCCL link to {peer_name(link.peer)}: the first "
                                     f"exchange carried {probe.item()}, not 1")

    def _via(self, link: Link, tensor: torch.Tensor) -> str | None:
        """NCCL for a CUDA tensor the higher rank sends on an NCCL link; else as GlooTransport
        (shared memory, or gloo)."""
        if link.lane == NCCL and link.me == 1 and self._in_device_memory(tensor):
            return NCCL
        return super()._via(link, tensor)

    def _send_payload(self, link: Link, tensor: torch.Tensor, via: str | None) -> None:
        if via != NCCL:
            return super()._send_payload(link, tensor, via)
        self._on_device()
        self._wait(link, link.data.send([tensor], link.other, 0),
                   f"NCCL send to {peer_name(link.peer)}")

    def _recv_payload(self, link: Link, dtype: torch.dtype, shape, via: str | None):
        if via != NCCL:
            return super()._recv_payload(link, dtype, shape, via)
        self._on_device()
        tensor = torch.empty(shape, dtype=dtype, device=self.device)
        if tensor.numel():
            self._wait(link, link.data.recv([tensor], link.other, 0),
                       f"NCCL receive from {peer_name(link.peer)}")
        return tensor

    def _wait(self, link: Link, work, what: str) -> None:
        """Until `work` is done on the GPU; TransportError (the group aborted) when the link
        is dropped or the connect timeout passes first."""
        deadline = time.monotonic() + self.timeout_s
        while not work.is_completed():
            if link.aborted.is_set():
                raise TransportError(f"{what}: the link was dropped (its NCCL group aborted)")
            if time.monotonic() > deadline:
                self._abort_data(link)
                raise TransportError(f"{what}: not done within {self.timeout_s:g} s (NCCL "
                                     "cannot see a dead peer; its group was aborted)")
            time.sleep(POLL_S)
        work.wait()  # done: orders the tensor's later use after the NCCL stream

    def _abort_data(self, link: Link) -> None:
        """Stop every wait on the link's NCCL group at once (`aborted`), and abort the group
        in a thread of its own: whoever drops a link (the decoder's loop) never blocks on
        NCCL tearing a communicator down."""
        with self.abort_lock:
            if link.data is None or link.aborted.is_set():
                return
            link.aborted.set()
        aborter = threading.Thread(target=_abort_quietly, args=(link.data,), daemon=True,
                                   name=f"pdgpu-abort-{link.peer}")
        aborter.start()
        self.aborters.append(aborter)

    def close(self, wait_s: float = 5.0, flush_s: float = 2.0) -> bool:
        """GlooTransport's close, then up to `wait_s` for the NCCL groups to be aborted."""
        quiet = super().close(wait_s, flush_s)
        deadline = time.monotonic() + wait_s
        for aborter in self.aborters:
            aborter.join(timeout=max(0.0, deadline - time.monotonic()))
        return quiet


def _abort_quietly(group) -> None:
    try:
        group.abort()
    except Exception:  # noqa: BLE001 - aborting a broken group may raise: it is gone either way
        pass
