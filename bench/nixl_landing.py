"""A span's digests READ over the NIXL lane (issue 34): into the reader's landing buffer,
registered once per link (what `RemoteSlice.read` does), against into a fresh tensor
registered and deregistered for each read (what it did before), alternating read by read
over two NIXL transports of this process joined by one link (DRAM on CPU, VRAM on CUDA).

Reports the median microseconds per read of each and their ratio, and the reader's
registrations each way.

    python bench/nixl_landing.py                 # CPU DRAM, 400 reads of 64 rows' digests
    python bench/nixl_landing.py --rows 4096 --device cuda:0
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import torch

from pdgpu.serve.digest import row_digests
from pdgpu.serve.lane_probe import HOST, TIMEOUT_S
from pdgpu.serve.rendezvous import Endpoint, open_store
from pdgpu.serve.transport_nixl import NixlTransport, nixl_missing


def _args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=64, help="token rows whose digests are read")
    p.add_argument("--reads", type=int, default=400)
    p.add_argument("--device", default="cpu")
    return p.parse_args()


def _pair(device: str) -> list[NixlTransport]:
    """Two NIXL transports of this process joined by one link (rank 1 writes)."""
    master = open_store(Endpoint(HOST, 0), 0, 2, TIMEOUT_S)
    ends = [NixlTransport(store, rank, TIMEOUT_S, device) for rank, store in
            enumerate((master, open_store(Endpoint(HOST, master.port), 1, 2, TIMEOUT_S)))]
    joiner = threading.Thread(target=ends[1].connect, args=(0, 0))
    joiner.start()
    ends[0].connect(1, 0)
    joiner.join(timeout=TIMEOUT_S)
    return ends


def fresh_read(remote) -> torch.Tensor:
    """The old way: a new tensor, registered, READ into, deregistered."""
    out = torch.empty(remote.shape, dtype=remote.dtype, device=remote.end.device)
    try:
        remote.copy_into(out)
    finally:
        remote.end.untarget(out)
    return out


def main() -> None:
    args = _args()
    why = nixl_missing()
    if why is not None:
        raise SystemExit(f"nixl_landing: {why}")
    reader, writer = _pair(args.device)
    end = reader.links[1].nixl
    registered = {"landing": 0, "fresh": 0}
    real = end.agent.register_memory
    way = {"now": "landing"}

    def counted(*a):
        registered[way["now"]] += 1
        return real(*a)
    end.agent.register_memory = counted
    times: dict[str, list[float]] = {"landing": [], "fresh": []}
    digests = row_digests(torch.randn(args.rows, 2, 8, 128, device=args.device))  # [rows, 2]
    try:
        for i in range(args.reads):
            writer.send(0, "span", {}, (digests,))
            msg = reader.get(timeout=20)
            for name in ("landing", "fresh") if i % 2 else ("fresh", "landing"):
                way["now"] = name
                start = time.perf_counter()
                got = msg.tensors[0].read() if name == "landing" else fresh_read(msg.tensors[0])
                times[name].append(time.perf_counter() - start)
                assert torch.equal(got, digests)
            reader.done(msg)
    finally:
        for t in (reader, writer):
            t.close(wait_s=0.0, flush_s=1.0)
    med = {k: 1e6 * statistics.median(v) for k, v in times.items()}
    print(f"{args.rows} rows' digests ({digests.numel() * digests.element_size()} B), "
          f"{args.reads} reads each, {args.device}, alternating")
    print("| read into | median us | registrations (reader) |")
    print("|---|---|---|")
    for k in ("landing", "fresh"):
        print(f"| {'landing buffer' if k == 'landing' else 'fresh tensor'} | {med[k]:.1f} | "
              f"{registered[k]} |")
    print(f"landing / fresh: {med['landing'] / med['fresh']:.2f}")


if __name__ == "__main__":
    main()
