"""How two serving processes find each other and agree on what a link between them carries.

The rendezvous is a TCPStore (the decoder, rank 0, serves it). Each link's two processes
publish a device descriptor under the link's store prefix and read the other's, so both pick
the same *lane* for its tensors without asking anyone: `shm` (both on CPU, on one machine,
both offering shared memory: transport_shm.py), `gloo` (both on CPU otherwise), `nccl` (both
on CUDA, on distinct GPUs), `shm-pinned` (both on one GPU, on one machine, both offering
shared memory: page-locked shared host memory, d2h then h2d) or `gloo-staged` (a CUDA process
at either end but neither NCCL nor shared memory: the same GPU, which NCCL refuses to join
twice, or a CPU peer, which the handshake then refuses as mixed devices; CUDA tensors cross
through host memory over gloo). A descriptor without `host`/`shm` (an older peer, or
`--kv-lane gloo`) never gets a shared-memory lane. `nixl` when both ends offer NIXL
(`--kv-lane nixl`, transport_nixl.py) on the same kind of device.
"""

from __future__ import annotations

import re
import threading
import time
from datetime import timedelta
from urllib.parse import urlparse

import attrs
import orjson
import torch.distributed as dist

GLOO, NCCL, STAGED = "gloo", "nccl", "gloo-staged"
SHM, SHM_PINNED = "shm", "shm-pinned"
SHARED = (SHM, SHM_PINNED)  # the shared-memory lanes
NIXL = "nixl"  # both ends offer NIXL (transport_nixl.py), on the same kind of device
POLL_S = 0.01  # a connecting end looks for the other's descriptor this often
GIVE_UP_JOIN_S = 5.0  # most a connect given up waits for its thread to see it


class TransportError(RuntimeError):
    """The link to a peer broke or could not be made; the message says which and why."""


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


def choose_lane(mine: dict, theirs: dict) -> str:
    """The lane of a link from both ends' descriptors {"device", "gpu", "host", "shm"}
    (symmetric, so both ends agree): NCCL needs two CUDA processes on two distinct GPUs,
    shared memory two processes on one machine that both offer it."""
    devices = (mine["device"], theirs["device"])
    if mine.get("nixl") and theirs.get("nixl") and len({d.split(":")[0] for d in devices}) == 1:
        return NIXL
    if all(d == "cpu" for d in devices):
        return SHM if _share_memory(mine, theirs) else GLOO
    if "cpu" in devices:
        return STAGED
    if mine["gpu"] == theirs["gpu"]:
        return SHM_PINNED if _share_memory(mine, theirs) else STAGED
    return NCCL


def _share_memory(mine: dict, theirs: dict) -> bool:
    """Both ends offer shared memory (a segment name stem) on the same machine."""
    return bool(mine.get("shm") and theirs.get("shm")) and mine.get("host") == theirs.get("host")


def exchange_descriptors(store, me: int, mine: dict, timeout_s: float,
                         given_up=lambda: False) -> dict:
    """Publish this end's descriptor under the link's prefix; the other end's, looked for
    every POLL_S up to `timeout_s`, TransportError once `given_up()` (a store's blocking wait
    holds its client until the key comes: nothing could end it, and a peer that never comes
    would keep it past the transport's close). Called before the link's process group is
    made, so that group's blocking rendezvous starts only once the peer has reached its own."""
    store.set(f"pdgpu-device/{me}", orjson.dumps(mine))
    theirs, deadline = f"pdgpu-device/{1 - me}", time.monotonic() + timeout_s
    while not store.check([theirs]):
        if given_up():
            raise TransportError("the connect was given up (the transport closed, or a peer "
                                 "died)")
        if time.monotonic() > deadline:
            raise TransportError(f"no peer came within {timeout_s:g} s")
        time.sleep(POLL_S)
    return orjson.loads(store.get(theirs))


def connect_in_thread(connect, rank: int, alive=lambda: None):
    """`connect(given_up)` (it joins process groups: blocking) in a helper thread while
    `alive()` checks the peers (it raises when one died); its result, or TransportError. When
    `alive()` raises, `given_up` is set and the thread waited for (GIVE_UP_JOIN_S at most), so
    no connect goes on behind the error."""
    result: dict = {}
    given_up = threading.Event()

    def run() -> None:
        try:
            result["link"] = connect(given_up)
        except Exception as e:  # noqa: BLE001 - torch raises several types for one cause
            result["error"] = e

    thread = threading.Thread(target=run, daemon=True, name="pdgpu-connect")
    thread.start()
    while thread.is_alive():
        thread.join(timeout=0.1)
        try:
            alive()
        except BaseException:
            given_up.set()
            thread.join(timeout=GIVE_UP_JOIN_S)
            raise
    if "error" in result:
        raise TransportError(f"rank {rank}: cannot join the process group "
                             f"({first_line(result['error'])})")
    return result["link"]


def peer_name(rank: int) -> str:
    """Rank 0 is the decoder, rank r >= 1 is producer p<r>."""
    return "the decoder" if rank == 0 else f"producer p{rank}"


def first_line(e: Exception) -> str:
    """The cause in one line, without gloo's source-file prefix."""
    lines = str(e).strip().splitlines()
    text = re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", lines[0]) if lines else ""
    return text[:160] or type(e).__name__
