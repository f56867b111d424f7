"""pdgpu on CUDA: the same engine with copy streams, readiness events and pinned staging."""

from __future__ import annotations

import threading

import attrs
import pytest
import torch

from pdgpu.copier import measure_copy_bandwidth
from pdgpu.engine import Engine
from pdgpu.generate import generate
from pdgpu.model import build_model
from pdgpu.streams import CudaLane
from pdgpu.workload import EngineConfig, Request
from pdref import events as ev
from pdref.check import check_lines
from pdref.models import load_model
from pdref.trace import dumps

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
TINY = attrs.evolve(load_model("tiny"), dtype="float32")


def _tokens(n: int) -> tuple[int, ...]:
    return tuple(torch.randint(0, TINY.vocab, (n,), generator=torch.Generator().manual_seed(0))
                 .tolist())


def _check(result) -> bool:
    lines = [dumps(ev.header_to_json(result.header)).encode()]
    lines += [dumps(ev.event_to_json(e)).encode() for e in result.events]
    return check_lines(lines).ok


@pytest.mark.parametrize("decoder", ["cpu", "cuda"])
def test_cuda_modes_are_bit_identical_and_traces_check(decoder):
    """On CUDA, chunk and layer handoff land whole's exact KV and first token."""
    model = build_model(TINY, device="cuda", seed=0)
    request = [Request("r", _tokens(200), 32)]
    runs = {}
    for mode in ("whole", "chunk", "layer"):
        engine = Engine(model, EngineConfig(mode, chunk=48, device="cuda",
                                            decoder_device=decoder, keep_kv=True))
        runs[mode] = engine.run(request)
        assert all(isinstance(engine.copier.backend.lanes[n], CudaLane) for n in ("gather", "d2h"))
        assert isinstance(engine.copier.backend.lanes["h2d"], CudaLane) == (decoder == "cuda")
        assert all(r.host.is_pinned() for r in engine.copier.rings)
        assert _check(runs[mode]), mode
    base = runs["whole"].outcomes[0]
    for mode, result in runs.items():
        assert torch.equal(result.outcomes[0].kv, base.kv), mode
        assert result.outcomes[0].first_token == base.first_token, mode


def test_cuda_matches_cpu_within_tolerance():
    """The CUDA run's decoder KV is the CPU run's within float32 tolerance."""
    request = [Request("r", _tokens(100), 0)]
    kv = {}
    for device in ("cpu", "cuda"):
        model = build_model(TINY, device=device, seed=0)
        config = EngineConfig("chunk", chunk=32, device=device, keep_kv=True)
        kv[device] = Engine(model, config).run(request).outcomes[0].kv
    assert torch.allclose(kv["cpu"], kv["cuda"], atol=1e-4)


def test_cuda_failure_and_retry_is_exact():
    """A failed CUDA copy aborts, returns pages, and the retry lands exact KV."""
    model = build_model(TINY, device="cuda", seed=0)
    request = [Request("r", _tokens(128), 0)]
    runs = [Engine(model, EngineConfig("chunk", chunk=32, device="cuda", keep_kv=True,
                                       fail_span=fail)).run(request) for fail in (None, 1)]
    assert runs[1].outcomes[0].attempts == 2
    assert torch.equal(runs[0].outcomes[0].kv, runs[1].outcomes[0].kv)
    assert _check(runs[1])


def test_pinned_copy_bandwidth_is_measured():
    """The pinned-memory probe reports pinned staging and a plausible bandwidth."""
    bw = measure_copy_bandwidth("cuda", 64 << 20, repeats=3)
    assert bw["pinned"] and bw["d2h_gbps"] > 1 and bw["h2d_gbps"] > 1


@pytest.mark.parametrize("decoder", ["cpu", "cuda"])
@pytest.mark.parametrize("mode", ["whole", "chunk"])
def test_cuda_export_only_lands_the_payload_exactly(mode, decoder):
    """--no-compute on CUDA: the payload lands byte-exact (checked by the engine) and the
    trace checks, whole and chunked, to a CPU or CUDA decoder."""
    model = build_model(TINY, device="cuda", seed=0)
    config = EngineConfig(mode, chunk=64, device="cuda", decoder_device=decoder,
                          no_compute=True)
    result = Engine(model, config).run([Request("r", (0,) * 500, 0)])
    assert result.metrics["bytes"] == TINY.geometry(16).region_bytes((0, TINY.layers), (0, 500))
    assert _check(result)


@pytest.mark.parametrize("decoder", ["cpu", "cuda"])
@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen3.5"])
def test_cuda_run_decodes_from_a_decoder_pool_on_either_device(preset, decoder):
    """`pdgpu run` on CUDA decodes from what crossed, its decoder pool on the CPU (the slab
    gathered there and copied across once, the state copied into the decode cache's own
    slots) or on the model's GPU (gathered straight into the row, the state read where it
    landed): the tokens equal `pdgpu generate`'s, with a prefix."""
    model = build_model(load_model(preset), device="cuda", seed=0)
    prompt = _tokens(150)
    config = EngineConfig("chunk", chunk=32, device="cuda", decoder_device=decoder,
                          output_tokens=5)
    result = Engine(model, config).run([Request("r", prompt, 32)])
    assert _check(result)
    assert list(result.outcomes[0].tokens) == generate(model, list(prompt), 5, 32, prefix=32)


def test_cuda_step_loop_never_synchronizes_the_host(monkeypatch):
    """While the step loop launches chunks, the compute thread waits for no CUDA event or
    stream (only the copy watcher and lanes wait; the end of prefill may wait)."""
    model = build_model(TINY, device="cuda", seed=0)
    engine = Engine(model, EngineConfig("chunk", chunk=16, device="cuda", decoder_device="cuda"))
    launched, steps, waits = [0], 256 // 16, []
    compute = Engine._compute

    def counting(self, loop, step):
        compute(self, loop, step)
        launched[0] += 1

    def logged(original):
        def wait(*args):
            waits.append((threading.current_thread().name, launched[0]))
            return original(*args)
        return wait

    monkeypatch.setattr(Engine, "_compute", counting)
    for owner in (torch.cuda.Event, torch.cuda.Stream):
        monkeypatch.setattr(owner, "synchronize", logged(owner.synchronize))
    monkeypatch.setattr(torch.cuda, "synchronize", logged(torch.cuda.synchronize))
    result = engine.run([Request("r", _tokens(256), 0)])
    assert _check(result)
    in_loop = [w for w in waits if w[0] == "MainThread" and 0 < w[1] < steps]
    assert in_loop == []
    assert any(name == "pdgpu-watcher" for name, _ in waits)
