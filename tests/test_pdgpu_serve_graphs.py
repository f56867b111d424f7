"""pdgpu serve's decode step replayed per layout (`--cuda-graphs`, decode_graph.py): the
decoder steps through the forward it is given, layouts captured and bounded while requests
join and leave; on CUDA the replayed tokens equal the eager ones."""

from __future__ import annotations

import json

import pytest
import torch
from graph_helpers import replay_eagerly
from serve_helpers import (
    drawn_prompts,
    events_of,
    reference,
    serve,
    trace_ok,
    write_sensitive_checkpoint,
)

from pdgpu.decode_batch import decode_logits
from pdgpu.decode_graph import GraphedStep, decode_forward, graph_problem, uses_graphs
from pdgpu.serve import launch

CHUNK = 16
LENGTHS = [250, 37, 120, 64, 240, 81]  # 250 and 240 cross into width 512 while decoding


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(write_sensitive_checkpoint(tmp_path_factory.mktemp("ckpt") / "sensitive"))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, checkpoint):
    """family -> a checkpoint whose tokens depend on their context (a Qwen3.5's on its gated
    DeltaNet states too: a capture's warm-up that left them advanced would change them)."""
    from test_pdgpu_serve_hybrid import save_sensitive
    folder = tmp_path_factory.mktemp("hybrid") / "qwen3_5"
    return {"dense": checkpoint, "qwen3_5": save_sensitive(folder, "qwen3_5")}


def test_the_mode_picks_the_step_by_the_decoders_device():
    """auto replays graphs on CUDA only, off never, on refuses a CPU decoder (one line)."""
    assert isinstance(decode_forward("auto", "cuda:0"), GraphedStep)
    assert decode_forward("auto", "cpu") is decode_logits
    assert decode_forward("off", "cuda:1") is decode_logits
    assert uses_graphs("on", "cuda") and not uses_graphs("auto", "cpu")
    assert "needs the decoder on a CUDA device, got cpu" in graph_problem("on", "cpu")
    assert "must be one of auto, on, off" in graph_problem("yes", "cuda")
    with pytest.raises(ValueError, match="cuda-graphs: on"):
        decode_forward("on", "cpu")


@pytest.mark.parametrize("family", ["dense", "qwen3_5"])
def test_served_tokens_through_a_replayed_step_equal_generate(tmp_path, checkpoints, capsys,
                                                              monkeypatch, family):
    """The decoder's every step goes through the forward it is given (here GraphedStep with
    the CPU stand-in capture, at most 2 graphs): as requests join, leave and cross into a
    wider bucket, new layouts are captured, at most 2 held, and every request's tokens equal
    generate's (a hybrid's too: each capture's warm-up put its states back); the summary
    counts the captures."""
    checkpoint = checkpoints[family]
    seen = {"held": 0, "replays": 0, "keys": set()}

    def capture(model, batch, pool):
        seen["held"] = max(seen["held"], len(step.graphs))
        seen["keys"].add(batch.key)
        replay, pool = replay_eagerly(model, batch, pool)

        def counted():
            seen["replays"] += 1
            return replay()
        return counted, pool
    step = GraphedStep(most=2, capture=capture)
    monkeypatch.setattr(launch, "decode_forward", lambda mode, device: step)
    prompts = drawn_prompts(tmp_path / "p.jsonl", 6, LENGTHS, 256, 0, 12)
    code, results, trace = serve(
        tmp_path, "--model", checkpoint, "--prompts", str(tmp_path / "p.jsonl"),
        "--chunk", str(CHUNK), "--concurrency", "3", "--json")
    assert code == 0
    for line, result in zip(prompts, results, strict=True):
        assert result["output"] == reference(checkpoint, line["tokens"], 12, CHUNK, 0)
    trace_ok(trace)
    decodes = [e for e in events_of(trace, "stage") if e["name"] == "decode"]
    assert seen["replays"] == len(decodes)  # every step through the given forward
    assert step.captures >= len(seen["keys"]) >= 4  # joins, leaves, a wider bucket
    assert seen["held"] <= 2 and len(step.graphs) <= 2
    assert step.dropped == step.captures - len(step.graphs)  # every other one was dropped
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["decode_graph_captures"] == step.captures
    assert json.loads(trace[0])["cuda_graphs"] is False  # the stand-in is not a CUDA graph


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_served_tokens_with_cuda_graphs_equal_eager_ones(tmp_path, checkpoint, capsys):
    """On CUDA: the same requests served with the decode step replayed as CUDA graphs and
    eager give the same tokens (and generate's), the header and summary say which ran."""
    decoder = "cuda:1" if torch.cuda.device_count() > 1 else "cuda:0"
    prompts = drawn_prompts(tmp_path / "p.jsonl", 6, LENGTHS, 256, 0, 12)
    outputs = {}
    for mode in ("on", "off"):
        code, results, trace = serve(
            tmp_path, "--model", checkpoint, "--prompts", str(tmp_path / "p.jsonl"),
            "--chunk", str(CHUNK), "--concurrency", "3", "--device", "cuda:0",
            "--decoder-device", decoder, "--cuda-graphs", mode, "--json")
        assert code == 0
        summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert json.loads(trace[0])["cuda_graphs"] is (mode == "on")
        captures = summary["decode_graph_captures"]
        assert captures >= 4 if mode == "on" else captures is None
        outputs[mode] = [r["output"] for r in results]
    assert outputs["on"] == outputs["off"]
    want = [reference(checkpoint, p["tokens"], 12, CHUNK, 0, device="cuda:0") for p in prompts]
    assert outputs["on"] == want
