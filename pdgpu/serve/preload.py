"""Imported once by the forkserver that forks every local producer (launch.START_METHOD):
torch, the serving modules, and torch's lazily imported meta-device machinery (the first
meta-device op imports torch._refs, ~2 s), so each producer forks with them loaded."""

import torch

import pdgpu.serve.launch  # noqa: F401 - loaded here so that forked producers have it

torch.empty(1, device="meta").normal_()
