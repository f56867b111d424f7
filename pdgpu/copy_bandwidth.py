"""The raw copy bandwidth of a device, each direction (`pdgpu run`'s metrics, benchmarks):
best-of copies through the kind of host memory the copier stages in (pinned on CUDA), on a
copy stream of their own."""

from __future__ import annotations

import contextlib
import time

import torch


def _best_copy_s(stream, dst: torch.Tensor, src: torch.Tensor, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            dst.copy_(src, non_blocking=True)
        if stream is not None:
            stream.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def measure_copy_bandwidth(device, nbytes: int = 256 << 20, repeats: int = 5) -> dict:
    """Best-of-`repeats` GB/s of device->host and host->device copies through the staging
    kind of host memory the copier uses (pinned on CUDA), on a copy stream."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    stream = torch.cuda.Stream(device=device) if cuda else None
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)  # [nbytes]
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)  # [nbytes]
    return {
        "d2h_gbps": nbytes / _best_copy_s(stream, host, dev, repeats) / 1e9,
        "h2d_gbps": nbytes / _best_copy_s(stream, dev, host, repeats) / 1e9,
        "bytes": nbytes,
        "pinned": cuda and bool(host.is_pinned()),
    }
