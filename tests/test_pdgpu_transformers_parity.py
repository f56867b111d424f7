"""Greedy tokens of the engine (chunked prefill, bucketed batch decode) against transformers'."""

from __future__ import annotations

import inspect

import pytest
import torch

from pdgpu import checkpoint as ckpt
from pdgpu.decode_batch import DecodeBatch, decode_tokens
from pdgpu.decode_kv import DecodeCache
from pdgpu.generate import generate
from pdgpu.source_cache import SourceCache

CLEAR_MARGIN = 1e-3  # logits apart: below it float rounding may pick either token

HF_SHAPE = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                max_position_embeddings=512, initializer_range=0.2, rope_theta=1e6,
                tie_word_embeddings=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A random Qwen3 saved by transformers, loaded by both."""
    transformers = pytest.importorskip("transformers")
    folder = tmp_path_factory.mktemp("qwen3")
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**HF_SHAPE)).save_pretrained(folder)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="sdpa").eval()
    return ckpt.load_checkpoint(folder), hf


def hf_greedy(hf, tokens: list[int], count: int,
              device: str = "cpu") -> tuple[list[int], list[float]]:
    """transformers' greedy tokens one step at a time, with each step's top-2 margin."""
    ids = torch.tensor([tokens], device=device)
    out, margins, cache = [], [], None
    name = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"
    with torch.no_grad():
        for _ in range(count):
            step = hf(input_ids=ids, use_cache=True, **{name: cache})
            cache, logits = step.past_key_values, step.logits[0, -1]
            top = logits.topk(2).values
            margins.append(float(top[0] - top[1]))
            out.append(int(logits.argmax()))
            ids = torch.tensor([[out[-1]]], device=device)
    return out, margins


def agree_while_clear(ours: list[int], theirs: list[int], margins: list[float]) -> int:
    """How many leading tokens were compared: equal wherever transformers' margin is clear."""
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        if margins[i] < CLEAR_MARGIN:
            return i
        assert a == b, (i, ours, theirs, margins)
    return len(ours)


@pytest.mark.parametrize("chunk", [16, 64])
def test_generate_equals_transformers_greedy_where_the_margin_is_clear(models, chunk):
    """`pdgpu generate` (prefill in chunks, decode through the bucketed cache) gives
    transformers' greedy tokens, at least the first ten of them."""
    model, hf = models
    tokens = torch.randint(0, 256, (250,), generator=torch.Generator().manual_seed(2)).tolist()
    ours = generate(model, tokens, 16, chunk=chunk)
    theirs, margins = hf_greedy(hf, tokens, 16)
    assert agree_while_clear(ours, theirs, margins) >= 10


def test_a_batch_crossing_a_bucket_decodes_transformers_tokens(models):
    """Requests decoded together, one of them outgrowing its 256-token row mid-way, each
    give transformers' greedy tokens."""
    model, hf = models
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (250, 40, 300)]
    cache, seqs, outs = DecodeCache.for_model(model), [], []
    for prompt in prompts:
        source = SourceCache(model.spec.geometry(16), 32, "cpu", torch.float32)
        kv = source.open(len(prompt))
        with torch.no_grad():
            hidden = model.prefill_chunk(torch.tensor(prompt), 0, kv)[-1:]
        seqs.append(cache.add(kv.kv.index_select(2, kv.slots)))
        outs.append([int(model.logits(hidden).argmax())])
    for _ in range(11):
        step = decode_tokens(model, DecodeBatch(seqs), [o[-1] for o in outs])
        for out, token in zip(outs, step, strict=True):
            out.append(token)
    for prompt, ours in zip(prompts, outs, strict=True):
        theirs, margins = hf_greedy(hf, prompt, 12)
        assert agree_while_clear(ours, theirs, margins) >= 8
