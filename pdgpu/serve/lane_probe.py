"""KV bytes per second between two processes through one link's lane, against a same-size
copy in one process (bench/serve.py, scripts/gpu_check.sh, the tests).

Both processes copy with one thread, like serving ranks (--threads 1); so does the baseline.
A writer process sends `count` messages of one `nbytes` tensor each (its own tensor, copied
into a slot; or with `staged` one produced in the slot, as the producer's gather is); this
process (the reader, rank 0 like the decoder) copies each into its own buffer, as the decoder
copies a span into its pool, and hands it back (`done`). The rate is timed from the first message
after `warm` (by default every slot of the ring made and mapped once, as in a serving run,
which reuses them for all its spans) to the last one consumed. The baseline is what the
bytes would cost with no second process: a memcpy on CPU; on CUDA one d2h copy into pinned
memory (the pinned copy bandwidth, issue 24's yardstick; the lane does a d2h and an h2d, in
two processes).
"""

from __future__ import annotations

import os
import statistics
import time

import torch
import torch.multiprocessing as mp

from pdgpu.serve.link import rows_into
from pdgpu.serve.rendezvous import Endpoint, open_store
from pdgpu.serve.transport_nccl import open_transport
from pdgpu.serve.transport_shm import MAX_SLOTS
from pdgpu.streams import compute_threads

HOST = "127.0.0.1"
TIMEOUT_S = 60.0


def _writer(port: int, lane: str, device: str, nbytes: int, count: int, staged: bool) -> None:
    code = 1
    torch.set_num_threads(1)  # like a serving rank (--threads 1): 2 processes, 2 copy threads
    try:
        store = open_store(Endpoint(HOST, port), 1, None, TIMEOUT_S)
        transport = open_transport(store, 1, device, TIMEOUT_S, lane)
        transport.connect(0, 0)
        payload = torch.ones(nbytes, dtype=torch.uint8, device=device)  # [nbytes]
        transport.get(timeout=TIMEOUT_S)  # go
        for _ in range(count):  # staged: the bytes were produced in the slot, as a gather
            tensors = transport.staging(0, [((nbytes,), torch.uint8)], device) if staged \
                else (payload,)
            transport.send(0, "bytes", {}, tensors)
        transport.get(timeout=TIMEOUT_S)  # bye
        transport.close(wait_s=0.0)
        code = 0
    finally:
        os._exit(code)  # gloo's receiving thread may still block in recv


def transfer_rate(lane: str, nbytes: int, count: int, device: str = "cpu",
                  warm: int = MAX_SLOTS + 2, staged: bool = False) -> tuple[float, str]:
    """(bytes/s the lane carried, the lane the link agreed on) from a writer process;
    `staged`: the writer fills `staging` buffers (in a shared slot: no copy in) rather than
    sending a tensor of its own."""
    store = open_store(Endpoint(HOST, 0), 0, 2, TIMEOUT_S)
    proc = mp.get_context("spawn").Process(target=_writer, daemon=True,
                                           args=(store.port, lane, device, nbytes, count,
                                                 staged))
    proc.start()
    transport = open_transport(store, 0, device, TIMEOUT_S, lane)
    try:
        transport.connect(1, 0)
        with compute_threads("cpu", 1):
            seconds = _read(transport, nbytes, count, device, warm)
        transport.send(1, "bye")
        agreed = transport.lanes()[1]
    finally:
        proc.join(timeout=10)
        transport.close(wait_s=1.0)
    return (count - 1 - warm) * nbytes / seconds, agreed


def _read(transport, nbytes: int, count: int, device: str, warm: int) -> float:
    """Seconds from the first timed message to the last one consumed."""
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)  # [nbytes]: the "pool"
    transport.send(1, "go")
    start = None
    for i in range(count):
        msg = transport.get(timeout=TIMEOUT_S)
        if msg is None or msg.op != "bytes":
            raise RuntimeError(f"lane probe: expected bytes, got {msg and msg.op}")
        if i == warm:
            start = time.perf_counter()
        rows_into(dst, msg.tensors[0])  # NIXL: READ straight into dst
        transport.done(msg)
    return time.perf_counter() - start


def copy_rate(nbytes: int, device: str = "cpu", repeats: int = 5) -> float:
    """Bytes/s of the same bytes with no second process: memcpy (CPU), or a d2h into pinned
    memory (CUDA); the median of `repeats`."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)  # [nbytes]
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device != "cpu")
    dst = torch.empty_like(src)
    times = []
    with compute_threads("cpu", 1):
        for _ in range(repeats + 1):
            times.append(_copy_once(src, host, dst))
    return nbytes / statistics.median(times[1:])


def _copy_once(src: torch.Tensor, host: torch.Tensor, dst: torch.Tensor) -> float:
    start = time.perf_counter()
    if src.device.type == "cpu":
        dst.copy_(src)
    else:
        host.copy_(src)
        torch.cuda.synchronize(src.device)
    return time.perf_counter() - start
