"""pdgpu.model against a dense float64 reference written here, and chunked vs one-shot prefill."""

from __future__ import annotations

import math

import attrs
import pytest
import torch

from pdgpu.model import build_model, inv_frequencies
from pdgpu.source_cache import SourceCache
from pdref.models import RopeScaling, load_model

TINY = attrs.evolve(load_model("tiny"), dtype="float32")
LLAMA = attrs.evolve(
    TINY, name="tiny-llama", arch="llama", tie_embeddings=False, rope_theta=500000.0,
    rope_scaling=RopeScaling(8.0, 1.0, 4.0, 64),
)


def _norm(x, w, eps):
    return w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))


def _ref_inv_freq(spec):
    """Llama 3.1 rope scaling, written out per frequency as in Meta's reference code."""
    d = spec.head_dim
    base = [1.0 / spec.rope_theta ** (i / d) for i in range(0, d, 2)]
    s = spec.rope_scaling
    if s is None:
        return torch.tensor(base, dtype=torch.float64)
    out = []
    for f in base:
        wavelen = 2 * math.pi / f
        if wavelen < s.original_max_position / s.high_freq_factor:
            out.append(f)
        elif wavelen > s.original_max_position / s.low_freq_factor:
            out.append(f / s.factor)
        else:
            smooth = (s.original_max_position / wavelen - s.low_freq_factor) / (
                s.high_freq_factor - s.low_freq_factor)
            out.append((1 - smooth) * f / s.factor + smooth * f)
    return torch.tensor(out, dtype=torch.float64)


def _rope(x, pos, inv):
    """x [n, H, D]: pairs (i, i + D/2) rotated by pos * inv[i]."""
    ang = pos[:, None].double() * inv[None, :]  # [n, D/2]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    a, b = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)


def dense_logits(model, tokens):
    """Straightforward full-sequence forward pass in float64 -> logits [n, V]."""
    spec, w = model.spec, {k: v.double() for k, v in model.state_dict().items()}
    n, hd = len(tokens), spec.head_dim
    pos, inv = torch.arange(n), _ref_inv_freq(spec)
    h = w["model.embed_tokens.weight"][tokens]
    causal = torch.tril(torch.ones(n, n, dtype=torch.bool))
    for i in range(spec.layers):
        p = f"model.layers.{i}."
        x = _norm(h, w[p + "input_layernorm.weight"], spec.rms_eps)
        q = (x @ w[p + "self_attn.q_proj.weight"].T).view(n, spec.heads, hd)
        k = (x @ w[p + "self_attn.k_proj.weight"].T).view(n, spec.kv_heads, hd)
        v = (x @ w[p + "self_attn.v_proj.weight"].T).view(n, spec.kv_heads, hd)
        if spec.arch == "qwen3":
            q = _norm(q, w[p + "self_attn.q_norm.weight"], spec.rms_eps)
            k = _norm(k, w[p + "self_attn.k_norm.weight"], spec.rms_eps)
        q, k = _rope(q, pos, inv), _rope(k, pos, inv)
        out = torch.empty(n, spec.heads, hd, dtype=torch.float64)
        for head in range(spec.heads):
            kv_head = head * spec.kv_heads // spec.heads
            scores = q[:, head] @ k[:, kv_head].T / math.sqrt(hd)
            probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
            out[:, head] = probs @ v[:, kv_head]
        h = h + out.reshape(n, -1) @ w[p + "self_attn.o_proj.weight"].T
        x = _norm(h, w[p + "post_attention_layernorm.weight"], spec.rms_eps)
        gate = torch.nn.functional.silu(x @ w[p + "mlp.gate_proj.weight"].T)
        h = h + (gate * (x @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
    head_w = w["model.embed_tokens.weight"] if spec.tie_embeddings else w["lm_head.weight"]
    return _norm(h, w["model.norm.weight"], spec.rms_eps) @ head_w.T


def chunked_logits(model, tokens, chunk, pages=16):
    """Logits [n, V] of a chunked prefill through a paged source cache, and the cache."""
    geometry = model.spec.geometry(8)
    cache = SourceCache(geometry, pages, "cpu", torch.float32)
    # Take a few pages first so the request's pages are not 0..k (the page table matters).
    cache.open(20)
    request = cache.open(len(tokens))
    starts = range(0, len(tokens), chunk)
    hs = [model.prefill_chunk(tokens[a:a + chunk], a, request) for a in starts]
    return model.logits(torch.cat(hs)), request


@pytest.mark.parametrize("spec", [TINY, LLAMA], ids=["qwen3", "llama3.1"])
def test_logits_match_dense_float64_reference(spec):
    """Chunked paged prefill gives the dense float64 reference's logits."""
    model = build_model(spec, seed=3)
    tokens = torch.randint(0, spec.vocab, (70,), generator=torch.Generator().manual_seed(1))
    got, _ = chunked_logits(model, tokens, chunk=16)
    want = dense_logits(model, tokens)
    assert torch.allclose(got.double(), want, atol=2e-5, rtol=1e-4)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("chunk", [1, 7, 32, 70])
def test_chunked_prefill_matches_one_shot(chunk):
    """Any chunk size gives one-shot prefill's logits and K/V (fp tolerance)."""
    model = build_model(LLAMA, seed=0)
    tokens = torch.randint(0, LLAMA.vocab, (70,), generator=torch.Generator().manual_seed(2))
    one, kv_one = chunked_logits(model, tokens, chunk=70)
    many, kv_many = chunked_logits(model, tokens, chunk=chunk)
    assert torch.allclose(one, many, atol=1e-5)
    slots = kv_one.slots
    assert torch.allclose(kv_one.kv[:, :, slots], kv_many.kv[:, :, slots], atol=1e-5)


def test_rope_scaling_changes_low_frequencies_only():
    """Llama 3.1 scaling divides the lowest frequencies by the factor and keeps the highest."""
    plain = inv_frequencies(attrs.evolve(LLAMA, rope_scaling=None))
    scaled = inv_frequencies(LLAMA)
    assert torch.allclose(scaled, _ref_inv_freq(LLAMA).float())
    assert scaled[0] == plain[0]
    assert torch.isclose(scaled[-1], plain[-1] / 8)


def test_seeded_init_is_deterministic_and_seed_dependent():
    """The same seed gives the same weights; another seed gives others."""
    a, b, c = (build_model(TINY, seed=s).state_dict() for s in (5, 5, 6))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.layers.0.mlp.up_proj.weight"],
                           c["model.layers.0.mlp.up_proj.weight"])


def test_layer_hook_runs_after_each_layer_with_kv_in_store():
    """on_layer(l) fires in layer order once layer l's K/V of the chunk is in the store."""
    model = build_model(TINY, seed=0)
    cache = SourceCache(TINY.geometry(8), 4, "cpu", torch.float32)
    request = cache.open(10)
    seen = []

    def hook(layer):
        filled = cache.kv[layer, :, request.slots].abs().sum() > 0
        later = cache.kv[layer + 1:, :, request.slots].abs().sum() == 0
        seen.append((layer, bool(filled), bool(later)))

    model.prefill_chunk(torch.arange(10), 0, request, on_layer=hook)
    assert seen == [(i, True, True) for i in range(TINY.layers)]


def test_bfloat16_model_runs_and_keeps_float32_rope():
    """A bf16 preset builds in bf16, keeps inv_freq in float32, and gives finite logits."""
    spec = attrs.evolve(TINY, dtype="bfloat16")
    model = build_model(spec, seed=0)
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert model.inv_freq.dtype == torch.float32
    cache = SourceCache(spec.geometry(8), 4, "cpu", torch.bfloat16)
    h = model.prefill_chunk(torch.arange(12), 0, cache.open(12))
    assert torch.isfinite(model.logits(h).float()).all()


@pytest.mark.parametrize("spec", [TINY, LLAMA], ids=["qwen3", "llama3.1"])
def test_logits_match_hugging_face_transformers(tmp_path, spec):
    """Same checkpoint, same logits as HF's Qwen3ForCausalLM / LlamaForCausalLM (if installed)."""
    transformers = pytest.importorskip("transformers")
    from pdgpu.checkpoint import save_checkpoint

    model = build_model(spec, seed=3)
    save_checkpoint(model, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, dtype=torch.float32, attn_implementation="eager").eval()
    tokens = torch.randint(0, spec.vocab, (90,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(tokens[None]).logits[0]  # [n, V]
    got, _ = chunked_logits(model, tokens, chunk=32)
    assert torch.allclose(got, want, atol=1e-5)
