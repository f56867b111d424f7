"""Kernel ops per layer (what a GPU launches), host syncs and host-made tensors, counted."""

from __future__ import annotations

import attrs
import pytest
import torch

from pdgpu.op_count import count_ops, decode_step_ops, per_layer, prefill_chunk_ops
from pdref.models import load_model

TINY = load_model("tiny")
SPECS = [TINY, attrs.evolve(TINY, arch="llama", tie_embeddings=False)]
DECODE_TARGET, PREFILL_TARGET = 20, 25  # issue 34, ops per layer, views excluded


def test_the_counter_skips_views_and_sees_syncs_and_host_made_tensors():
    """Views are free; .item() is a sync; torch.tensor of host data is a made tensor."""
    x = torch.arange(6.0)
    seen = count_ops(lambda: x.view(2, 3).t().sum().item())
    assert (seen.kernels, seen.syncs, seen.made) == (2, 1, 0)
    assert count_ops(lambda: torch.tensor([1, 2]) + x[:2]).made == 1


def test_rms_norm_counts_as_one_kernel_and_its_cpu_decomposition_apart():
    """rms_norm is one kernel (as on CUDA); the CPU figure keeps its decomposition."""
    x, w = torch.randn(4, 8), torch.ones(8)
    seen = count_ops(torch.nn.functional.rms_norm, x, (8,), w, 1e-6)
    assert seen.kernels == 1 and seen.cpu_ops > 1


@pytest.mark.parametrize("spec", SPECS, ids=["qwen3", "llama"])
def test_a_decode_step_meets_the_ops_per_layer_target_with_no_sync(spec):
    """One bucket: <= 20 kernel ops per layer; the whole step reads nothing on the host and
    makes no tensor from host data."""
    layer, once = per_layer(spec, lambda s: decode_step_ops(s, [40, 90, 200]))
    assert layer.kernels <= DECODE_TARGET, dict(layer.names)
    assert layer.syncs == once.syncs == 0 and layer.made == once.made == 0


def test_each_further_bucket_adds_one_write_and_one_attention_per_layer():
    """Requests in four widths cost 2 ops per layer per extra bucket, not per request."""
    one, _ = per_layer(TINY, lambda s: decode_step_ops(s, [40, 90]))
    four, _ = per_layer(TINY, lambda s: decode_step_ops(s, [40, 300, 600, 1200, 1300]))
    assert four.kernels - one.kernels == 2 * 3, (dict(one.names), dict(four.names))


@pytest.mark.parametrize("spec", SPECS, ids=["qwen3", "llama"])
@pytest.mark.parametrize("start", [0, 256])
def test_a_prefill_chunk_meets_the_ops_per_layer_target_with_digests(spec, start):
    """A chunk of 256, first or later, digests included: <= 25 kernel ops per layer, of
    which the digests are two."""
    layer, _ = per_layer(spec, lambda s: prefill_chunk_ops(s, 256, start))
    plain, _ = per_layer(spec, lambda s: prefill_chunk_ops(s, 256, start, digests=False))
    assert layer.kernels <= PREFILL_TARGET, dict(layer.names)
    assert layer.kernels - plain.kernels == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_counts_meet_the_targets_with_every_dispatched_op():
    """On CUDA no convention applies (rms_norm is one fused kernel there): the decode step
    and a later prefill chunk meet their targets counting every dispatched op."""
    layer, once = per_layer(TINY, lambda s: decode_step_ops(s, [40, 90, 200], "cuda"))
    assert layer.kernels == layer.cpu_ops <= DECODE_TARGET, dict(layer.names)
    assert layer.syncs == once.syncs == 0 and layer.made == once.made == 0
    chunk, _ = per_layer(TINY, lambda s: prefill_chunk_ops(s, 256, 256, True, "cuda"))
    assert chunk.kernels <= PREFILL_TARGET, dict(chunk.names)
