"""The attention kernels: the same answers as masked attention, and work that does not grow."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from pdgpu.attention import decode_attention, key_bias, prefill_attention
from pdgpu.model import build_model
from pdgpu.source_cache import SourceCache
from pdref.models import load_model


def masked_reference(q, k, v, start):
    """q [n, H, D] at [start, start + n) over k/v [KVH, c, D], by an explicit mask."""
    groups = q.shape[1] // k.shape[0]
    n, c = q.shape[0], k.shape[1]
    mask = torch.arange(c)[None, :] <= torch.arange(start, start + n)[:, None]  # [n, c]
    out = F.scaled_dot_product_attention(
        q.double().transpose(0, 1), k.double().repeat_interleave(groups, 0),
        v.double().repeat_interleave(groups, 0), attn_mask=mask)  # [H, n, D]
    return out.transpose(0, 1).float()


@pytest.mark.parametrize(("start", "n"), [(0, 64), (0, 1), (64, 64), (200, 17), (5, 1),
                                          (31, 96)])
def test_prefill_attention_equals_lower_right_masked_attention(start, n):
    """A chunk sees every earlier key and its own keys causally, with GQA, at any start."""
    gen = torch.Generator().manual_seed(start * 1000 + n)
    q = torch.randn(n, 8, 16, generator=gen)
    k, v = (torch.randn(2, start + n, 16, generator=gen) for _ in range(2))
    got = prefill_attention(q, k, v, start)
    torch.testing.assert_close(got, masked_reference(q, k, v, start), atol=2e-6, rtol=1e-5)


def test_prefill_attention_reads_strided_views_of_a_workspace():
    """K/V given as views of a wider workspace give the same answer as compact copies."""
    gen = torch.Generator().manual_seed(3)
    work = torch.randn(2, 2, 500, 16, generator=gen)  # [2, KVH, tokens, D]
    q = torch.randn(40, 4, 16, generator=gen)
    view = prefill_attention(q, work[0, :, :140], work[1, :, :140], 100)
    compact = prefill_attention(q, work[0, :, :140].clone(), work[1, :, :140].clone(), 100)
    assert torch.equal(view, compact)


def test_decode_attention_equals_each_request_alone_over_its_length():
    """Each row attends exactly its own first `length` keys (garbage past it is ignored)."""
    gen = torch.Generator().manual_seed(1)
    lengths = torch.tensor([1, 7, 256, 100])
    q = torch.randn(4, 4, 16, generator=gen)
    k, v = (torch.randn(4, 2, 256, 16, generator=gen) * 50 for _ in range(2))
    got = decode_attention(q, k, v, key_bias(lengths - 1, torch.arange(256), q.dtype))
    got = got.reshape(4, 4, 16)  # [b, KVH, G, D] -> [b, H, D]
    for i, c in enumerate(lengths.tolist()):
        expected = masked_reference(q[i:i + 1], k[i, :, :c], v[i, :, :c], c - 1)[0]
        torch.testing.assert_close(got[i], expected, atol=1e-4, rtol=1e-5)


class Allocations(TorchDispatchMode):
    """Bytes of every new tensor the ops make, and the ops' names."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes, self.ops = 0, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage().data_ptr() for a in _tensors(args, kwargs)}
        for t in _tensors(out, None):
            if t.untyped_storage().data_ptr() not in inputs:
                self.bytes += t.untyped_storage().nbytes()
        self.ops.append(str(func))
        return out


def _tensors(args, kwargs):
    flat = torch.utils._pytree.tree_leaves((args, kwargs or {}))
    return [a for a in flat if isinstance(a, torch.Tensor)]


def _chunk_allocations(model, cache, kv, tokens, start, chunk):
    with Allocations() as seen:
        model.prefill_chunk(tokens[start:start + chunk], start, kv)
    return seen.bytes


def test_a_chunks_new_memory_does_not_grow_with_its_context():
    """A chunk of 64 at position 1,536 allocates what the one at 0..63 does: no mask, no
    re-gather of the context, no repeated K/V."""
    model = build_model(load_model("tiny"), seed=0)
    geometry = model.spec.geometry(16)
    cache = SourceCache(geometry, geometry.pages_for(1600), "cpu", torch.float32)
    tokens = torch.randint(0, model.spec.vocab, (1600,))
    kv = cache.open(1600)
    with torch.no_grad():
        first = _chunk_allocations(model, cache, kv, tokens, 64, 64)
        for a in range(128, 1536, 64):
            model.prefill_chunk(tokens[a:a + 64], a, kv)
        late = _chunk_allocations(model, cache, kv, tokens, 1536, 64)
    assert late == first, (first, late)


def test_a_decode_step_calls_attention_once_per_bucket_not_per_request():
    """Eight requests in one bucket make as many attention calls as one request does."""
    from pdgpu.decode_batch import DecodeBatch, decode_logits
    from pdgpu.decode_kv import DecodeCache
    model = build_model(load_model("tiny"), seed=0)
    spec = model.spec

    def bmm_calls(batch: int) -> int:
        cache = DecodeCache.for_model(model)
        seqs = [cache.add(torch.randn(spec.layers, 2, 30 + i, spec.kv_heads, spec.head_dim))
                for i in range(batch)]
        step = DecodeBatch(seqs)
        step.feed(list(range(batch)))
        with torch.no_grad(), Allocations() as seen:
            decode_logits(model, step)
        return sum("scaled_dot_product" in op for op in seen.ops)

    assert bmm_calls(8) == bmm_calls(1) == spec.layers


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("start", "n"), [(0, 256), (256, 256), (7936, 256), (300, 5)])
def test_cuda_prefill_attention_equals_masked_attention(dtype, start, n):
    """On CUDA (flash for bf16): a chunk at any start equals the lower-right masked answer."""
    gen = torch.Generator().manual_seed(start + n)
    q = torch.randn(n, 16, 128, generator=gen)
    k, v = (torch.randn(8, start + n, 128, generator=gen) for _ in range(2))
    got = prefill_attention(q.cuda().to(dtype), k.cuda().to(dtype), v.cuda().to(dtype), start)
    tol = 2e-2 if dtype is torch.bfloat16 else 1e-4
    torch.testing.assert_close(got.float().cpu(), masked_reference(q, k, v, start),
                               atol=tol, rtol=tol)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_decode_attention_equals_each_request_alone():
    """On CUDA in bf16: each row attends its own first `length` keys."""
    gen = torch.Generator().manual_seed(2)
    lengths = torch.tensor([1, 300, 1024, 77])
    q = torch.randn(4, 16, 128, generator=gen)
    k, v = (torch.randn(4, 8, 1024, 128, generator=gen) for _ in range(2))
    bias = key_bias(lengths.cuda() - 1, torch.arange(1024, device="cuda"), torch.bfloat16)
    got = decode_attention(q.cuda().bfloat16(), k.cuda().bfloat16(), v.cuda().bfloat16(), bias)
    got = got.reshape(4, 16, 128)  # [b, KVH, G, D] -> [b, H, D]
    for i, c in enumerate(lengths.tolist()):
        expected = masked_reference(q[i:i + 1], k[i, :, :c], v[i, :, :c], c - 1)[0]
        torch.testing.assert_close(got[i].float().cpu(), expected, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("start", [0, 256])
def test_cuda_bf16_prefill_runs_on_the_flash_backend(start):
    """With every SDPA backend but flash disabled, a bf16 chunk still runs: no silent fallback
    to the math kernel (a mask, repeated K/V, float32 scores)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    q = torch.randn(256, 16, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(8, start + 256, 128, device="cuda", dtype=torch.bfloat16)
            for _ in range(2))
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        assert prefill_attention(q, k, v, start).shape == q.shape


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("start", [0, 256])
def test_cuda_float32_grouped_prefill_runs_on_the_memory_efficient_backend(start):
    """float32 with grouped K/V (flash refuses float32, memory-efficient grouped K/V): with
    only the memory-efficient backend enabled a chunk still runs, and gives the masked
    reference's answer: it is not left to the math kernel."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    gen = torch.Generator().manual_seed(start)
    q = torch.randn(256, 16, 128, generator=gen)
    k, v = (torch.randn(8, start + 256, 128, generator=gen) for _ in range(2))
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
        got = prefill_attention(q.cuda(), k.cuda(), v.cuda(), start)
    torch.testing.assert_close(got.cpu(), masked_reference(q, k, v, start), atol=1e-4,
                               rtol=1e-4)
