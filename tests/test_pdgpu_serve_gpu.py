"""pdgpu serve on CUDA (scripts/gpu_check.sh runs these): served tokens equal `pdgpu generate`
on CUDA in every mode with 1 and 2 producers, `--verify` on; a killed producer does not hang
the decoder. Producers on cuda:0; the decoder on cuda:1 when there are two GPUs (KV over
NCCL), else on cuda:0 too (NCCL cannot join two processes on one GPU: KV staged through host
memory over gloo). The summary's `transport` says which lane ran, and the tests check it."""

from __future__ import annotations

import json

import pytest
import torch
from serve_helpers import (
    drawn_prompts,
    events_of,
    reference,
    serve,
    trace_ok,
    write_sensitive_checkpoint,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
PRODUCERS = "cuda:0"
CHUNK = 16
PREFIX = 16


def _decoder() -> str:
    return "cuda:1" if torch.cuda.device_count() > 1 else "cuda:0"


def _lane() -> str:
    return "nccl" if torch.cuda.device_count() > 1 else "gloo-staged"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(write_sensitive_checkpoint(tmp_path_factory.mktemp("ckpt") / "sensitive"))


def _summary(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.mark.parametrize("producers", [1, 2])
@pytest.mark.parametrize("mode", ["whole", "chunk", "layer"])
def test_served_on_cuda_equals_generate_on_cuda(tmp_path, capsys, checkpoint, mode, producers):
    """KV computed on cuda:0, sent to the decoder's GPU, decoded there: every request's
    tokens equal generate's on cuda:0, every span lands verified, the lane is the expected."""
    prompts = drawn_prompts(tmp_path / "p.jsonl", 4, [37, 64, 50, 81], 256, PREFIX, 6)
    code, results, trace = serve(
        tmp_path, "--model", checkpoint, "--mode", mode, "--producers", str(producers),
        "--prompts", str(tmp_path / "p.jsonl"), "--prefix", str(PREFIX), "--chunk", str(CHUNK),
        "--verify", "--device", PRODUCERS, "--decoder-device", _decoder(), "--json")
    assert code == 0
    assert _summary(capsys)["transport"] == _lane()
    for line, result in zip(prompts, results, strict=True):
        want = reference(checkpoint, line["tokens"], line["output_tokens"], CHUNK, PREFIX,
                         device=PRODUCERS)
        assert result["status"] == "ok", result
        assert result["output"] == want, (line["req"], result["output"], want)
    trace_ok(trace)
    assert len(events_of(trace, "land")) >= 4 and not events_of(trace, "fail")


def test_a_killed_producer_does_not_hang_the_decoder(tmp_path, capsys):
    """A producer SIGKILLed mid-run (its spans paced, so some are in flight over its link):
    the decoder drops its link (aborting its NCCL group), retries its requests on the other
    producer, and every request ends ok with a legal trace."""
    code, results, trace = serve(
        tmp_path, "--model", "tiny", "--producers", "2", "--requests", "12", "--concurrency",
        "4", "--prompt-range", "200:400", "--output-tokens", "8", "--mode", "chunk", "--chunk",
        "32", "--link-gbps", "0.0005", "--verify", "--device", PRODUCERS, "--decoder-device",
        _decoder(), "--kill-producer", "0@0.3", "--json")
    summary = _summary(capsys)
    assert code == 0 and summary["transport"] == _lane()
    assert summary["producer_kills"] == 1 and summary["producer_deaths"] == 1
    assert [r["status"] for r in results] == ["ok"] * 12
    assert summary["leaked_pages"] == 0
    trace_ok(trace)
