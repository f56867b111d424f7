"""pdgpu serve on the hybrid families (issue 33, contract v3): Qwen3.5 (gated DeltaNet: its
state crosses in state spans) and Gemma 3 (sliding windows: only the window's K/V crosses).
Served tokens equal `pdgpu generate`'s and transformers' greedy tokens (where its top-2
margin is clear), traces are legal under v3 with the contract's bytes, `--verify` covers
state bytes, and faults on state and window-cut spans are fenced and retried."""

from __future__ import annotations

import functools
import json

import pytest
import torch
from hybrid_helpers import kv_bytes
from serve_helpers import drawn_prompts, events_of, reference, serve, trace_ok
from test_pdgpu_hybrid import GEMMA3, QWEN35, _randomize
from test_pdgpu_transformers_parity import agree_while_clear, hf_greedy

from pdgpu.checkpoint import inspect_checkpoint
from pdgpu.handoff import handoff_geometry, kv_groups
from pdref.geometry import Geometry
from pdref.kinds import LayerKind
from pdref.trace import parse_lines

transformers = pytest.importorskip("transformers")

CHUNK = 32


def save_sensitive(folder, family: str) -> str:
    """A random checkpoint of `family` saved by transformers whose tokens depend on the
    context: Gemma 3's embedding scaled down (at its init, sqrt(hidden) times the embedding
    outweighs attention, and every step repeats one token whatever the window holds)."""
    torch.manual_seed(0)
    if family == "qwen3_5":
        model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**QWEN35))
    else:
        model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**GEMMA3))
        with torch.no_grad():
            model.model.embed_tokens.weight.mul_(0.1)
    _randomize(model)
    model.save_pretrained(folder)
    return str(folder)


@functools.cache
def _checkpoint(root: str, family: str) -> str:
    from pathlib import Path
    return save_sensitive(Path(root) / family, family)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """family -> checkpoint folder (made once per module)."""
    root = str(tmp_path_factory.mktemp("hybrids"))
    return lambda family: _checkpoint(root, family)


@functools.cache
def _hf(folder: str):
    return transformers.AutoModelForCausalLM.from_pretrained(folder,
                                                             dtype=torch.float32).eval()


def _assert_tokens(folder: str, prompts: list[dict], results: list[dict], prefix: int) -> int:
    """Each request ok with generate's tokens and transformers' where its margin is clear;
    how many tokens transformers' margins let us compare."""
    compared = 0
    for line, result in zip(prompts, results, strict=True):
        assert result["status"] == "ok", result
        want = reference(folder, line["tokens"], line["output_tokens"], CHUNK, prefix)
        assert result["output"] == want, (line["req"], result["output"], want)
        theirs, margins = hf_greedy(_hf(folder), line["tokens"], line["output_tokens"])
        compared += agree_while_clear(result["output"], theirs, margins)
    return compared


def _assert_v3_bytes(trace: list[bytes]) -> dict:
    """Every issue's bytes are the contract's (tests/hybrid_helpers.py: a sliding layer's
    window only, a state span its layers' state); every admitted life's state landed. Totals
    by kind."""
    geo = next(parse_lines(trace))[1].geometry
    reserves = {e["req"]: e for e in events_of(trace, "reserve")}
    totals = {"kv": 0, "state": 0}
    for e in events_of(trace, "issue"):
        r = reserves[e["req"]]
        if e.get("state"):
            want = sum(geo.kinds[la].state_bytes for la in range(*e["layers"]))
            assert e["tokens"] == [r["prompt"], r["prompt"]]
            totals["state"] += e["bytes"]
        else:
            want = kv_bytes(geo, e["layers"], e["tokens"], r["prompt"], r["prefix"])
            totals["kv"] += e["bytes"]
        assert e["bytes"] == want, e
    return totals


def _serve(tmp_path, folder: str, lengths, prefix: int, out: int, *args: str):
    prompts = drawn_prompts(tmp_path / "p.jsonl", len(lengths), list(lengths), 256, prefix, out)
    code, results, trace = serve(
        tmp_path, "--model", folder, "--producers", "2", "--prompts", str(tmp_path / "p.jsonl"),
        "--prefix", str(prefix), "--chunk", str(CHUNK), "--verify", *args)
    assert code == 0
    trace_ok(trace)
    return prompts, results, trace


@pytest.mark.parametrize(("family", "mode", "lane", "prefix"),
                         [("qwen3_5", "layer", "shm", 16), ("gemma3", "chunk", "shm", 0),
                          ("gemma3", "whole", "gloo", 16)])
def test_served_tokens_equal_generate_and_transformers(tmp_path, models, family, mode, lane,
                                                       prefix):
    """Two producers, prompts 7..300 in chunks of 32, every KV lane: tokens equal generate's
    and transformers'; the trace is legal v3 with the contract's bytes; a Qwen3.5 life's
    state crosses once per run of linear layers, a Gemma 3 sliding layer's window only."""
    folder = models(family)
    prompts, results, trace = _serve(tmp_path, folder, (7 + prefix, 150, 300), prefix, 6,
                                     "--mode", mode, "--kv-lane", lane)
    assert _assert_tokens(folder, prompts, results, prefix) >= 6
    header = json.loads(trace[0])
    assert header["version"] == 3 and header["transport"] == lane
    totals = _assert_v3_bytes(trace)
    states = [e for e in events_of(trace, "issue") if e.get("state")]
    geo = handoff_geometry(inspect_checkpoint(folder), 16)
    if family == "qwen3_5":
        runs = len(geo.layout.linear) if mode != "layer" else 3
        assert len(states) == runs * len(prompts) and totals["state"] > 0
    else:  # every sliding layer's full suffix would be more than what crossed
        assert not states
        full = sum(geo.bytes_per_token_layer * geo.layers * (len(p["tokens"]) - prefix)
                   for p in prompts)
        assert totals["kv"] < full / 2


def test_span_groups_carry_the_contracts_bytes():
    """handoff.kv_groups of a span over any layers of a hybrid carry exactly the bytes the
    contract counts (pdref's span_bytes), in K/V layers that skip the linear ones."""
    kinds = (LayerKind("linear", None, 8), LayerKind("sliding", 5), LayerKind("sliding", 5),
             LayerKind("full"), LayerKind("linear", None, 8), LayerKind("sliding", 5))
    geo = Geometry(6, 1, 2, 1, 4, True, kinds)
    for layers in [(0, 6), (1, 3), (2, 6), (4, 5), (3, 4)]:
        for tokens, prompt, prefix in [((0, 8), 20, 0), ((16, 20), 20, 0), ((4, 30), 30, 4),
                                       ((8, 12), 13, 8)]:
            groups = kv_groups(geo, layers, tokens, prompt, prefix)
            cells = sum((g.layers[1] - g.layers[0]) * (g.tokens[1] - g.tokens[0])
                        for g in groups)
            assert cells * geo.bytes_per_token_layer == \
                geo.span_bytes(layers, tokens, prompt, prefix)
            assert all(0 <= g.layers[0] < g.layers[1] <= 4 for g in groups)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["whole", "chunk", "layer"])
@pytest.mark.parametrize("family", ["qwen3_5", "gemma3"])
def test_served_tokens_sweep_over_prompt_lengths(tmp_path, models, family, mode):
    """Prompts 7..300 (around chunk and page edges, past the window and a DeltaNet block),
    chunk 32, two producers, every mode: generate's and transformers' tokens."""
    folder = models(family)
    lengths = (7, 31, 32, 33, 64, 65, 129, 200, 300)
    prompts, results, trace = _serve(tmp_path, folder, lengths, 0, 8, "--mode", mode)
    _assert_tokens(folder, prompts, results, 0)
    _assert_v3_bytes(trace)
