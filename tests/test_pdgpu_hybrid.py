"""The hybrid families (Qwen3.5 gated DeltaNet, Gemma 3 sliding window) against transformers."""

from __future__ import annotations

import json
import runpy
from pathlib import Path

import pytest
import torch
from test_pdgpu_prefill import prefilled
from test_pdgpu_transformers_parity import agree_while_clear, hf_greedy

from pdgpu import checkpoint as ckpt
from pdgpu.cli import main as cli_main
from pdgpu.compare import compare_modes
from pdgpu.decode_batch import DecodeBatch, decode_tokens
from pdgpu.decode_kv import DecodeCache
from pdgpu.decoder_pool import DecoderPool
from pdgpu.engine import Engine
from pdgpu.generate import first_token, generate
from pdgpu.handoff import handoff_geometry, kv_geometry
from pdgpu.model import build_model
from pdgpu.op_count import decode_step_ops
from pdgpu.payload import payload_matches
from pdgpu.source_cache import SourceCache
from pdgpu.workload import EngineConfig, Request
from pdref.check import check_lines
from pdref.events import Mode, event_to_json, header_to_json
from pdref.trace import dumps

SHAPE = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
             initializer_range=0.2)
QWEN35 = dict(SHAPE, num_hidden_layers=4, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_key_head_dim=16, linear_value_head_dim=16, tie_word_embeddings=False)
GEMMA3 = dict(SHAPE, num_hidden_layers=6, sliding_window=16, query_pre_attn_scalar=24,
              final_logit_softcapping=30.0)


def _randomize(model) -> None:
    """Norm weights (stored as offsets from 1) and DeltaNet's gates away from their inits, so
    a wrong offset, gate or decay shows in the tokens."""
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "dt_bias" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
            elif "A_log" in name:
                p.copy_(torch.rand(p.shape, generator=gen) * 2 - 1)


def save_hf(folder, family: str) -> None:
    """A random checkpoint of `family` saved by transformers."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if family == "qwen3_5":
        model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**QWEN35))
    else:
        model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**GEMMA3))
    _randomize(model)
    model.save_pretrained(folder)


@pytest.fixture(scope="module", params=["qwen3_5", "gemma3"])
def family(request, tmp_path_factory):
    """(folder, our model, transformers' model) of one hybrid family."""
    transformers = pytest.importorskip("transformers")
    folder = tmp_path_factory.mktemp(request.param)
    save_hf(folder, request.param)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return folder, ckpt.load_checkpoint(folder), hf


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize(("length", "chunk"), [(7, 32), (150, 32), (150, 200)])
def test_generate_equals_transformers_greedy(family, length, chunk):
    """`pdgpu generate` (chunked prefill carrying the DeltaNet state / windowed attention,
    then recurrent / ring decode) gives transformers' greedy tokens where its margin is clear,
    past the window and past one DeltaNet block (a chunk of 150: three blocks)."""
    _, model, hf = family
    tokens = _prompt(length, length)
    ours = generate(model, tokens, 16, chunk=chunk)
    theirs, margins = hf_greedy(hf, tokens, 16)
    assert agree_while_clear(ours, theirs, margins) >= 8


def test_decoding_in_a_batch_gives_the_tokens_of_decoding_alone(family):
    """Requests decoded together (states gathered per layer, rings per bucket, one request
    outgrowing its bucket) get bit-for-bit the tokens each gets alone."""
    _, model, _ = family
    prompts = [_prompt(n, n) for n in (250, 9, 40)]
    alone = [generate(model, p, 10, chunk=64) for p in prompts]
    cache, seqs, last = DecodeCache.for_model(model), [], []
    for prompt in prompts:
        source = SourceCache(model.spec.geometry(16), 32, "cpu", torch.float32,
                             model.state_shape)
        kv = source.open(len(prompt))
        hidden = None
        for a in range(0, len(prompt), 64):
            ids = torch.tensor(prompt[a:a + 64])
            hidden = model.prefill_chunk(ids, a, kv)[-1:]
        last.append(first_token(model, hidden))
        seqs.append(cache.add(kv.kv.index_select(2, kv.slots), kv.read_state()))
    outs = [[t] for t in last]
    for _ in range(9):
        step = decode_tokens(model, DecodeBatch(seqs), [o[-1] for o in outs])
        for out, token in zip(outs, step, strict=True):
            out.append(token)
    assert outs == alone


def test_compare_every_mode_hands_off_the_same_kv_and_state(family):
    """`pdgpu compare`'s engine runs (whole, chunk, layer) give the same decoder K/V, state
    and first token, and the first token is transformers' greedy one."""
    _, model, hf = family
    tokens = _prompt(70, 3)
    configs = {m: EngineConfig(mode=Mode(m), chunk=32, keep_kv=True, warmup=False)
               for m in ("whole", "chunk", "layer")}
    report = compare_modes(model, configs, [Request("r0", tuple(tokens))])
    assert report.parity_ok
    if model.state_shape is not None:  # the state crossed: not the zeros a slot starts at
        assert report.results["layer"].outcomes[0].state[1].abs().sum() > 0
    theirs, margins = hf_greedy(hf, tokens, 1)
    if margins[0] >= 1e-3:
        assert report.results["whole"].outcomes[0].first_token == theirs[0]


def test_layer_steps_leave_the_kv_and_state_of_chunk_steps(family):
    """The shared prefill step, layer-major (a DeltaNet layer carrying its state over the
    chunks of the suffix), leaves bit for bit the K/V, state and last hidden state of the
    chunk-major steps, after a prefix warm-up."""
    _, model, _ = family
    tokens = _prompt(70, 5)
    by_chunk, src_c, chunked = prefilled(model, tokens, 16, 24, False)
    by_layer, src_l, layered = prefilled(model, tokens, 16, 24, True)
    assert torch.equal(by_chunk.kv[:, :, src_c.slots], by_layer.kv[:, :, src_l.slots])
    assert torch.equal(chunked.last, layered.last)
    if model.state_shape is not None:
        for ours, theirs in zip(src_c.read_state(), src_l.read_state(), strict=True):
            assert torch.equal(ours, theirs) and ours.abs().sum() > 0


def test_the_paged_caches_hold_only_layers_that_keep_kv(family):
    """A Qwen3.5's paged caches hold its full-attention layers only; a Gemma 3's every layer;
    the trace's geometry (v3) names every layer with its kind, a linear layer with its share
    of the state the engine stores."""
    _, model, _ = family
    storage, trace = model.spec.geometry(16), handoff_geometry(model.spec, 16)
    kinds = [k.kind for k in trace.kinds]
    if model.spec.arch == "qwen3_5":
        assert (storage.layers, kinds) == (1, ["linear"] * 3 + ["full"])
        assert trace.state_bytes((0, 4)) == model.state_shape.nbytes
    else:
        assert (storage.layers, kinds) == (6, ["sliding"] * 5 + ["full"])
        assert {k.window for k in trace.kinds[:5]} == {16}
    assert trace.recurrent == storage.recurrent == (model.spec.arch == "qwen3_5")


class _PoisonedEngine(Engine):
    """An engine whose decoder pool starts as NaN (no warm-up zeroes it): K/V a decode reads
    that did not cross poisons the logits."""

    def _allocate(self, plan, rec) -> None:
        super()._allocate(plan, rec)
        self.pool.kv.fill_(float("nan"))


class _UnzeroedStateEngine(_PoisonedEngine):
    """A poisoned engine whose decoder state slots are NaN when taken (not zeroed): a state
    the spans did not land leaves NaN."""

    def _allocate(self, plan, rec) -> None:
        super()._allocate(plan, rec)
        if self.pool.states is not None:
            self.pool.states._zero = self.pool.states.scrub


@pytest.mark.parametrize("mode", ["whole", "chunk", "layer"])
def test_no_compute_hands_off_the_payload_and_zero_state(family, mode):
    """`pdgpu run --no-compute` on a hybrid: the K/V payload lands where the spans carry it
    (a sliding layer its window) and the state spans carry zeros of the state's size (the
    decoder's slot starts NaN here), checked by the engine at admission; the trace passes
    pdref with every state span at the real size; a prefix included."""
    _, model, _ = family
    requests = [Request("a", (0,) * 79), Request("b", (0,) * 150, 32)]
    config = EngineConfig(mode=Mode(mode), chunk=32, warmup=False, no_compute=True,
                          keep_kv=True)
    result = _UnzeroedStateEngine(model, config).run(requests)
    lines = [dumps(header_to_json(result.header)).encode()]
    verdict = check_lines(lines + [dumps(event_to_json(e)).encode() for e in result.events])
    assert verdict.ok, verdict.message
    assert [o.first_token for o in result.outcomes] == [None, None]
    issues = [e for e in result.events if e.kind == "issue"]
    if model.state_shape is not None:
        assert [sum(e.bytes for e in issues if e.state and e.req == r.req)
                for r in requests] == [model.state_shape.nbytes] * 2
        assert all(not part.any() for o in result.outcomes for part in o.state)


def test_the_payload_check_refuses_a_state_that_is_not_zero(family):
    """Export only: a decoder state slot holding anything but zeros fails the payload check
    (what a state span carries when nothing was computed)."""
    _, model, _ = family
    if model.state_shape is None:
        pytest.skip("no linear layers: no state")
    pool = DecoderPool(kv_geometry(handoff_geometry(model.spec, 16)), 8, "cpu", torch.float32,
                       model.state_shape)
    slab, slot = pool.slab((0,), 0, 4), pool.states.take()
    assert payload_matches(pool, slab, (), slot)
    pool.states.conv[0, slot, 0, 0] = 1.0
    assert not payload_matches(pool, slab, (), slot)


def _reference_state(model, tokens: list[int]):
    """The state a plain prefill leaves (StatePool.read's pair)."""
    _, src, _ = prefilled(model, tokens, 0, 32, False)
    return src.read_state()


@pytest.mark.parametrize("mode", ["whole", "chunk", "layer"])
def test_run_hands_off_v3_spans_and_decodes_from_what_crossed(family, mode):
    """`pdgpu run` on a hybrid: a v3 trace pdref passes (kinds, state slot at reserve, state
    spans of the real state size, sliding spans cut to the window), and tokens decoded from
    what crossed alone (the rest of the decoder pool is NaN) equal `pdgpu generate`'s; a
    prompt whose window starts on a page edge (79) and one with a prefix included."""
    _, model, _ = family
    requests = [Request("a", tuple(_prompt(79, 79))), Request("b", tuple(_prompt(150, 9)), 32)]
    config = EngineConfig(mode=Mode(mode), chunk=32, warmup=False, output_tokens=6,
                          keep_kv=True)
    result = _PoisonedEngine(model, config).run(requests)
    lines = [dumps(header_to_json(result.header)).encode()]
    verdict = check_lines(lines + [dumps(event_to_json(e)).encode() for e in result.events])
    assert verdict.ok, verdict.message
    assert result.header.version == 3
    for request, outcome in zip(requests, result.outcomes, strict=True):
        expected = generate(model, list(request.tokens), 6, chunk=32, prefix=request.prefix)
        assert list(outcome.tokens) == expected
    issues = [e for e in result.events if e.kind == "issue"]
    reserves = [e for e in result.events if e.kind == "reserve"]
    if model.state_shape is not None:
        assert all(e.state_slot is not None for e in reserves)
        per_request = model.state_shape.nbytes
        assert [sum(e.bytes for e in issues if e.state and e.req == r.req)
                for r in requests] == [per_request] * 2
        landed = result.outcomes[0].state
        for ours, theirs in zip(landed, _reference_state(model, _prompt(79, 79)), strict=True):
            assert torch.allclose(ours, theirs, atol=1e-5)
    else:  # 5 sliding layers send at most their window's pages: far below every token
        unclipped = 6 * 79 * result.header.geometry.bytes_per_token_layer
        assert sum(e.bytes for e in issues if e.req == "a") < unclipped / 2


def test_sliding_layers_decode_from_a_ring_that_does_not_grow(tmp_path):
    """A Gemma 3 request's decoder memory for its sliding layers is the window's, whatever
    its context: only the full layers' row grows."""
    spec = ckpt.spec_from_config(_config(tmp_path, "gemma3"), "g", "config.json")
    model = build_model(spec, seed=0)
    sizes = []
    for context in (300, 3000):
        cache = DecodeCache.for_model(model)
        cache.add(torch.zeros(6, 2, context, 2, 32))
        bucket = next(iter(cache.buckets.values()))
        sizes.append(([r.shape for r in bucket.ring], len(bucket.kv), cache.nbytes))
    assert sizes[0][0] == sizes[1][0] == [(2, 1, 2, 16, 32)] * 5
    assert sizes[0][1] == sizes[1][1] == 1  # one full layer in the growing rows


def _config(tmp_path, family: str) -> dict:
    save_hf(tmp_path / family, family)
    return json.loads((tmp_path / family / "config.json").read_text())


@pytest.mark.parametrize(("family_name", "edit", "named"), [
    ("qwen3_5", lambda c: c.pop("layer_types"), "'layer_types'"),
    ("qwen3_5", lambda c: c["rope_parameters"].pop("partial_rotary_factor"),
     "'partial_rotary_factor'"),
    ("qwen3_5", lambda c: c.pop("linear_conv_kernel_dim"), "'linear_conv_kernel_dim'"),
    ("qwen3_5", lambda c: c.update(hidden_act="gelu"), "'hidden_act'"),
    ("qwen3_5", lambda c: c["layer_types"].__setitem__(0, "mamba"), "'mamba'"),
    ("gemma3", lambda c: c.pop("sliding_window"), "'sliding_window'"),
    ("gemma3", lambda c: c.update(attn_logit_softcapping=50.0), "'attn_logit_softcapping'"),
    ("gemma3", lambda c: c["rope_parameters"].pop("sliding_attention"),
     "'rope_parameters.sliding_attention'"),
    ("gemma3", lambda c: c.pop("query_pre_attn_scalar"), "'query_pre_attn_scalar'"),
    ("gemma3", lambda c: c.update(model_type="gemma2"), "'model_type'"),
])
def test_a_missing_or_unsupported_field_is_named(tmp_path, family_name, edit, named):
    """A hybrid config.json missing a field that changes the math, or with an unsupported
    value, is refused in one line naming the field (never defaulted)."""
    config = _config(tmp_path, family_name)
    ckpt.spec_from_config(config, "m", "config.json")  # as transformers wrote it: loads
    edit(config)
    with pytest.raises(ckpt.CheckpointError) as err:
        ckpt.spec_from_config(config, "m", "config.json")
    assert named in str(err.value) and "\n" not in str(err.value)


@pytest.mark.slow
@pytest.mark.parametrize("length", [7, 31, 32, 33, 64, 65, 129, 200, 300])
def test_parity_sweep_over_prompt_lengths(family, length):
    """Prompts of 7..300 tokens in chunks of 32 (chunk edges, DeltaNet block edges, past the
    window): transformers' greedy tokens while its margin is clear, and the first token of
    every engine mode equal to generate's."""
    _, model, hf = family
    tokens = _prompt(length, 100 + length)
    ours = generate(model, tokens, 16, chunk=32)
    theirs, margins = hf_greedy(hf, tokens, 16)
    agree_while_clear(ours, theirs, margins)  # asserts every token up to the first unclear
    configs = {m: EngineConfig(mode=Mode(m), chunk=32, keep_kv=True, warmup=False)
               for m in ("whole", "chunk", "layer")}
    report = compare_modes(model, configs, [Request("r0", tuple(tokens))])
    assert report.parity_ok
    assert report.results["whole"].outcomes[0].first_token == ours[0]


def test_memory_bench_shows_the_window_and_the_state(capsys):
    """bench/hybrid_memory.py: a Gemma 3's decoder memory grows with the context only in its
    full layers (far less than its dense twin's), a Qwen3.5's state does not grow at all."""
    main = runpy.run_path(str(Path(__file__).parent.parent / "bench" / "hybrid_memory.py"))
    main["main"](["--contexts", "1000,8000", "--json"])
    rows = {(r["model"], r["context"]): r for r in json.loads(capsys.readouterr().out)}
    gemma = [rows["gemma-3-1b", c]["decoder_bytes"] for c in (1000, 8000)]
    twin = [rows["gemma-3-1b dense twin", c]["decoder_bytes"] for c in (1000, 8000)]
    assert gemma[1] - gemma[0] < (twin[1] - twin[0]) / 4
    qwen = [rows["qwen3.5-9b", c] for c in (1000, 8000)]
    assert qwen[0]["state_bytes"] == qwen[1]["state_bytes"] > 0
    assert rows["gemma-3-1b", 8000]["window_kv_bytes"] < rows["gemma-3-1b", 8000]["kv_bytes"]


@pytest.mark.parametrize("name", ["qwen3_5", "gemma3"])
def test_kernel_speed_bench_runs_a_hybrid_beside_transformers(capsys, name):
    """bench/kernel_speed.py --family: both sides prefill and decode a hybrid checkpoint."""
    pytest.importorskip("transformers")
    main = runpy.run_path(str(Path(__file__).parent.parent / "bench" / "kernel_speed.py"))
    main["main"](["--model", "tiny", "--family", name, "--window", "16", "--prompt", "80",
                  "--chunk", "32", "--batch", "2", "--contexts", "20:40", "--repeats", "1",
                  "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["family"] == name
    assert all(out[k] > 0 for k in ("prefill_one_chunk", "prefill_chunked", "decode_step"))


@pytest.mark.parametrize("mode", ["chunk", "layer"])
def test_layer_mode_ships_a_linear_layers_state_once_that_layer_is_done(family, mode):
    """Qwen3.5 (layers linear x3, full): in layer mode each linear layer's state span is
    issued right after that layer's `computed`, before the next layer computes; in chunk
    mode every state goes out after the last chunk."""
    _, model, _ = family
    if model.state_shape is None:
        pytest.skip("Gemma 3 has no state")
    config = EngineConfig(mode=Mode(mode), chunk=32, max_pending=4, warmup=False)
    events = Engine(model, config).run([Request("a", tuple(_prompt(100, 1)))]).events
    order = [(e.kind, e.layers) for e in events if e.kind == "computed"
             or (e.kind == "issue" and e.state)]
    if mode == "layer":
        assert order == [("computed", (0, 1)), ("issue", (0, 1)), ("computed", (1, 2)),
                         ("issue", (1, 2)), ("computed", (2, 3)), ("issue", (2, 3)),
                         ("computed", (3, 4))]
    else:
        assert order == [("computed", (0, 4))] * 4 + [("issue", (0, 3))]


def test_a_failed_state_span_is_fenced_and_the_request_retried(family):
    """A Qwen3.5 state span whose copy fails (span 3: after the three chunks' spans) is
    fenced, its life aborted and the request retried in a new life (a state slot named
    again at reserve); the trace passes pdref and the tokens are generate's."""
    _, model, _ = family
    if model.state_shape is None:
        pytest.skip("Gemma 3 has no state")
    tokens = _prompt(79, 79)
    config = EngineConfig(mode=Mode.CHUNK, chunk=32, fail_span=3, output_tokens=4)
    result = Engine(model, config).run([Request("a", tuple(tokens))])
    failed = [e for e in result.events if e.kind == "fail"]
    assert [(e.span, e.kind) for e in failed] == [(3, "fail")]
    assert [e.span for e in result.events if e.kind == "issue" and e.state] == [3, 7]
    assert [e.state_slot for e in result.events if e.kind == "reserve"] == [0, 0]
    assert result.outcomes[0].attempts == 2
    assert list(result.outcomes[0].tokens) == generate(model, tokens, 4, chunk=32)
    lines = [dumps(header_to_json(result.header)).encode()]
    assert check_lines(lines + [dumps(event_to_json(e)).encode() for e in result.events]).ok


def test_the_command_line_runs_a_hybrid(family, capsys, tmp_path):
    """`pdgpu run --json` on a hybrid checkpoint exits 0 with transformers' first token (where
    clear); in layer mode it writes a v3 trace and decodes generate's tokens (`pdgpu serve`
    on both: tests/test_pdgpu_serve_hybrid.py)."""
    folder, model, hf = family
    assert cli_main(["run", "--model", str(folder), "--tokens", "5,6,7,8,9,10,11",
                     "--chunk", "4", "--mode", "chunk", "--json"]) == 0
    metrics = json.loads(capsys.readouterr().out)
    theirs, margins = hf_greedy(hf, [5, 6, 7, 8, 9, 10, 11], 1)
    if margins[0] >= 1e-3:
        assert metrics["first_token"] == theirs[0]
    trace = tmp_path / "layer.jsonl"
    assert cli_main(["run", "--model", str(folder), "--tokens", "5,6,7,8,9,10,11",
                     "--chunk", "4", "--mode", "layer", "--output-tokens", "3", "--json",
                     "--trace", str(trace)]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == [
        generate(model, [5, 6, 7, 8, 9, 10, 11], 3, chunk=4)]
    assert json.loads(trace.read_text().splitlines()[0])["version"] == 3
    assert cli_main(["run", "--model", str(folder), "--prompt", "20", "--no-compute",
                     "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["first_token"] is None
    assert cli_main(["run", "--model", str(folder), "--payload", "4096", "--no-compute"]) == 2
    assert "payload: sizes a dense model's prompt" in capsys.readouterr().err



@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["qwen3_5", "gemma3"])
def test_cuda_generate_equals_transformers_greedy(tmp_path, name, dtype):
    """On CUDA, in float32 and bfloat16: `pdgpu generate` gives transformers' greedy tokens
    (same device and dtype) where its margin is clear, and a batch of two decodes each
    request's tokens alone."""
    transformers = pytest.importorskip("transformers")
    save_hf(tmp_path, name)
    model = ckpt.load_checkpoint(tmp_path, "cuda", dtype)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, dtype=getattr(torch, dtype)).to("cuda").eval()
    tokens, other = _prompt(150, 150), _prompt(40, 40)
    ours = generate(model, tokens, 16, chunk=32)
    theirs, margins = hf_greedy(hf, tokens, 16, device="cuda")
    assert agree_while_clear(ours, theirs, margins) >= 4
    cache, seqs, outs = DecodeCache.for_model(model), [], []
    for prompt in (tokens, other):
        source = SourceCache(model.spec.geometry(16), 16, "cuda", getattr(torch, dtype),
                             model.state_shape)
        kv = source.open(len(prompt))
        hidden = None
        for a in range(0, len(prompt), 32):
            hidden = model.prefill_chunk(torch.tensor(prompt[a:a + 32], device="cuda"), a,
                                         kv)[-1:]
        outs.append([first_token(model, hidden)])
        seqs.append(cache.add(kv.kv.index_select(2, kv.slots), kv.read_state()))
    for _ in range(7):
        step = decode_tokens(model, DecodeBatch(seqs), [o[-1] for o in outs])
        for out, token in zip(outs, step, strict=True):
            out.append(token)
    assert outs == [ours[:8], generate(model, other, 8, chunk=32)]


@pytest.mark.parametrize("name", ["qwen3_5", "gemma3"])
def test_a_hybrid_decode_step_reads_nothing_on_the_host_and_makes_no_host_tensor(tmp_path,
                                                                                  name):
    """The capturable-step rule holds for the hybrids too: a steady-state decode step of a
    batch (DeltaNet states, sliding rings) has no host sync and builds no tensor from host
    data (Gemma 3's embedding scale included)."""
    spec = ckpt.spec_from_config(_config(tmp_path, name), name, "config.json")
    seen = decode_step_ops(spec, [40, 90, 200])
    assert seen.kernels > 0
    assert (seen.syncs, seen.made) == (0, 0), dict(seen.names)
