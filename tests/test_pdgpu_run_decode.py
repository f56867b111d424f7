"""`pdgpu run`'s decoder admits a request as the serving decoder does: one copy of its context
into decode memory (its prefix's K/V and its slab's gathered straight into its row), nothing
of its state (read where it landed); the tokens still equal `pdgpu generate`'s."""

from __future__ import annotations

import pytest
import torch
from admission_helpers import context_bytes

from pdgpu import run_decode
from pdgpu.engine import Engine
from pdgpu.generate import generate
from pdgpu.model import build_model
from pdgpu.op_count import bytes_copied
from pdgpu.workload import EngineConfig, Request
from pdref.events import Mode
from pdref.models import load_model

CHUNK = 16
LENGTHS = (40, 57)  # longer than tiny-gemma3's window (16)


class _Admitted(Exception):
    """Raised by the first decode step: what ran before it was the admission."""


def _stop(*args, **kwargs):
    raise _Admitted


def _admission_bytes(decode, engine, args) -> int:
    """The floating-point bytes `Engine._decode` copies up to its first decode step."""
    def admit_only():
        try:
            decode(engine, *args)
        except _Admitted:
            return
        raise AssertionError("no decode step ran")
    return bytes_copied(admit_only)[1]


@pytest.mark.parametrize("prefix", [0, 16])
@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen3.5", "tiny-gemma3"])
def test_admission_copies_the_context_once_into_decode_memory(monkeypatch, preset, prefix):
    """Each request's admission (counted again once its decode ran, so the decoder's
    prefix cache is warm and nothing is computed) copies exactly its context's K/V once (a
    sliding layer's window), its state not at all; the run's tokens equal generate's."""
    model = build_model(load_model(preset), seed=0)
    decode, copied = Engine._decode, []

    def counted(self, *args):
        tokens = decode(self, *args)
        with monkeypatch.context() as m:
            m.setattr(run_decode, "decode_tokens", _stop)
            copied.append(_admission_bytes(decode, self, args))
        return tokens
    monkeypatch.setattr(Engine, "_decode", counted)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in LENGTHS]
    requests = [Request(f"r{i}", p, prefix) for i, p in enumerate(prompts)]
    config = EngineConfig(Mode.CHUNK, chunk=CHUNK, output_tokens=3, warmup=False)
    result = Engine(model, config).run(requests)
    assert copied == [context_bytes(preset, n) for n in LENGTHS]
    for prompt, outcome in zip(prompts, result.outcomes, strict=True):
        assert list(outcome.tokens) == generate(model, prompt, 3, chunk=CHUNK, prefix=prefix)
