"""Imported once by the forkserver that forks every local producer (launch.START_METHOD):
torch, the producer's modules, and torch's lazily imported meta-device machinery (the first
meta-device op imports torch._refs, ~2 s), so each producer forks with them loaded.

A Ctrl-C reaches the forkserver too (the terminal signals the whole process group); while it
loads, it then ends quietly: the command says in one line that it was interrupted."""

import sys

try:
    import torch

    # what a producer runs (its own modules, not the decoder's launch.py: launch imports this)
    import pdgpu.serve.producer_rank  # noqa: F401 - loaded here so that forked producers have it

    torch.empty(1, device="meta").normal_()
except KeyboardInterrupt:
    sys.exit(130)
