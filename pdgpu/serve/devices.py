"""The devices of a serving run, checked before any process starts (bad input: one line).

`--device` is the producers' device (with `--role`, this process's own); `--decoder-device`
the decoder's in a local run (default: `--device`). Every process is on CPU (gloo) or every
one on CUDA (NCCL between distinct GPUs; transport_nccl.py): mixed devices are refused.
"""

from __future__ import annotations

import re

import torch

from pdgpu.workload import WorkloadError

DEVICE = re.compile(r"^(cpu|cuda)(:(\d+))?$")


def check_device(text: str, field: str = "device") -> str:
    """A device this machine has, written fully (`cuda` -> `cuda:0`); WorkloadError naming
    the field and the rule otherwise."""
    match = DEVICE.match(text)
    if match is None or (match[1] == "cpu" and match[2]):
        raise WorkloadError(f"{field}: must be cpu, cuda or cuda:N, got {text!r}")
    if match[1] == "cpu":
        return "cpu"
    if not torch.cuda.is_available():
        raise WorkloadError(f"{field}: {text} needs CUDA, but torch.cuda.is_available() is "
                            f"false here (torch {torch.__version__}); use --{field} cpu")
    index = int(match[3] or 0)
    if index >= torch.cuda.device_count():
        raise WorkloadError(f"{field}: {text} is not a device here (CUDA devices: "
                            f"{torch.cuda.device_count()})")
    return f"cuda:{index}"


def serve_devices(device: str, decoder_device: str | None, role: str | None):
    """(producers' device, decoder's device) of a run, checked: with --role each process
    names only its own; mixed CPU and CUDA is refused."""
    if role is not None and decoder_device is not None:
        raise WorkloadError("decoder-device: only for a local run (with --role, each "
                            "process's --device is its own)")
    producers = check_device(device, "device")
    decoder = producers if decoder_device is None else check_device(decoder_device,
                                                                    "decoder-device")
    reason = mixed_devices(decoder, producers)
    if reason is not None:
        raise WorkloadError(f"decoder-device: {reason}")
    return producers, decoder


def kind(device: str) -> str:
    return torch.device(device).type


def mixed_devices(decoder: str, producer: str, name: str = "the producers") -> str | None:
    """Why a decoder and a producer on these devices cannot be served together, or None."""
    if kind(decoder) == kind(producer):
        return None
    return (f"mixed devices are not served ({name} on {producer}, the decoder on {decoder}): "
            "every process on cpu (gloo) or every one on cuda (NCCL)")


def use_device(device: str) -> None:
    """Make a CUDA device this process's current one (before its model and NCCL groups)."""
    if kind(device) == "cuda":
        torch.cuda.set_device(torch.device(device))
