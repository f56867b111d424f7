"""A decoder-only transformer of the Qwen3 / Llama family, prefilled in chunks over a paged cache.

Module names follow the Hugging Face layout (`model.layers.N.self_attn.q_proj` ...), so a
state dict is a checkpoint. The math follows the published Qwen3 / Llama code: RMSNorm in
float32, rotate-half RoPE (with Llama 3.1 frequency scaling), grouped-query attention,
Qwen3's per-head q/k RMSNorm before RoPE, SwiGLU MLP, tied or untied embeddings.

The layers are layers/dense_blocks.py's (Qwen3 / Llama, with their fused weights) and
layers/hybrid_blocks.py's; here: the network over them, RoPE tables, weights and building.

The KV cache is not owned by the model: every attention call hands its new K/V to a `KVStore`
(the producer's paged source cache) and gets back K/V of every earlier token of the request,
a contiguous view the attention kernels read in place (attention.py). `decode_step` runs one
new token for each row of a padded batch (a `DecodeKV` keeps each request's K/V and runs the
batch's attention in one call per group of equal width, decode_kv.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

from pdgpu.arch import DENSE, Arch, arch_of
from pdgpu.layers.dense_blocks import Block, RMSNorm
from pdgpu.layers.hybrid_blocks import hybrid_layers
from pdgpu.layers.kv_ports import DecodeKV, KVStore
from pdgpu.layers.norms import OffsetRMSNorm
from pdgpu.layers.rope import inv_frequencies, rope_tables
from pdref.models import ModelSpec

__all__ = ["TORCH_DTYPES", "Body", "Transformer", "build_model", "fuse_weights", "init_weights",
           "inv_frequencies", "layer_frequencies", "torch_dtype"]

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class Body(nn.Module):
    def __init__(self, spec: ModelSpec, arch: Arch) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(spec.vocab, spec.hidden)
        if arch.family in DENSE:
            self.layers = nn.ModuleList(Block(spec) for _ in range(spec.layers))
            self.norm = RMSNorm(spec.hidden, spec.rms_eps)
        else:
            self.layers = nn.ModuleList(hybrid_layers(spec, arch))
            self.norm = OffsetRMSNorm(spec.hidden, spec.rms_eps)


def layer_frequencies(spec: ModelSpec, arch: Arch) -> dict[str, torch.Tensor]:
    """RoPE inverse frequencies per rope kind ("full"; Gemma 3 also "sliding"), float32.
    Qwen3.5 rotates `rotary_dim` dims of a head; Gemma 3's full layers may scale linearly."""
    if arch.family in DENSE:
        return {"full": inv_frequencies(spec)}
    full = _plain_frequencies(spec.rope_theta, arch.rotary_dim)
    if arch.family == "qwen3_5":
        return {"full": full}
    return {"full": full / spec.get("global_rope_factor"),
            "sliding": _plain_frequencies(arch.local_rope_theta, spec.head_dim)}


def _plain_frequencies(theta: float, dims: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dims, 2, dtype=torch.int64).float() / dims))


class Transformer(nn.Module):
    """The network. `prefill_chunk` for chunk-major prefill, `run_layer` for layer-major."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec, self.arch = spec, arch_of(spec)
        self.model = Body(spec, self.arch)
        if not spec.tie_embeddings:
            self.lm_head = nn.Linear(spec.hidden, spec.vocab, bias=False)
        # per layer: which RoPE tables it uses, and its index among its storage's layers
        self.rope_kind = tuple("sliding" if k == "sliding" else "full" for k in self.arch.kinds)
        self.store_index = tuple(map(self.arch.store_index, range(spec.layers)))
        self.set_frequencies()

    def set_frequencies(self, device=None) -> None:
        """The RoPE buffers (float32 whatever the model's dtype, like HF's): `inv_freq` of
        full layers, `local_inv_freq` of Gemma 3's sliding layers."""
        for kind, inv in layer_frequencies(self.spec, self.arch).items():
            name = "inv_freq" if kind == "full" else "local_inv_freq"
            self.register_buffer(name, inv if device is None else inv.to(device),
                                 persistent=False)
        if self.arch.family == "gemma3":  # made once: a step builds no tensor from host data
            self.register_buffer("embed_scale", torch.tensor(self.spec.hidden ** 0.5,
                                                             device=device), persistent=False)

    @property
    def state_shape(self):
        """The per-request state of the linear layers (a StateShape), or None without any."""
        from pdgpu.state_pool import StateShape  # torch-side pools import the model's types
        return StateShape.for_arch(self.arch, self.model.embed_tokens.weight.dtype)

    @property
    def num_layers(self) -> int:
        return len(self.model.layers)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [n] -> hidden [n, E] (Gemma 3 scales by sqrt(E), rounded to the dtype)."""
        h = self.model.embed_tokens(tokens)
        if self.arch.family == "gemma3":
            h = h * self.embed_scale.to(h.dtype)  # as HF rounds it
        return h

    def rope(self, start: int, n: int, dtype: torch.dtype):
        """RoPE tables [n, 1, D] of positions [start, start+n) (full layers)."""
        positions = torch.arange(start, start + n, device=self.inv_freq.device)  # [n]
        return rope_tables(self.inv_freq, positions, dtype)

    def rope_by_kind(self, positions: torch.Tensor, dtype: torch.dtype) -> dict:
        """kind -> RoPE tables [n, 1, D'] of positions [n], for each kind the model has."""
        tables = {"full": rope_tables(self.inv_freq, positions, dtype)}
        if "sliding" in self.rope_kind:
            tables["sliding"] = rope_tables(self.local_inv_freq, positions, dtype)
        return tables

    def _chunk_tables(self, start: int, n: int, dtype: torch.dtype) -> dict:
        return self.rope_by_kind(torch.arange(start, start + n, device=self.inv_freq.device),
                                 dtype)

    def run_layer(self, layer: int, h: torch.Tensor, start: int, kv: KVStore) -> torch.Tensor:
        """One layer over hidden states h [n, E] of positions [start, start+n)."""
        cos, sin = self._chunk_tables(start, h.shape[0], h.dtype)[self.rope_kind[layer]]
        return self.model.layers[layer](h, cos, sin, kv, self.store_index[layer], start)

    def prefill_chunk(
        self,
        tokens: torch.Tensor,
        start: int,
        kv: KVStore,
        on_layer: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """Every layer over tokens [n] at positions [start, start+n); hidden [n, E] out.

        `on_layer(l)` runs as soon as layer l's K/V of this chunk is in the store.
        """
        h = self.embed(tokens)  # [n, E]
        tables = self._chunk_tables(start, h.shape[0], h.dtype)  # once for every layer
        for layer, block in enumerate(self.model.layers):
            cos, sin = tables[self.rope_kind[layer]]
            h = block(h, cos, sin, kv, self.store_index[layer], start)
            if on_layer is not None:
                on_layer(layer)
        return h

    def decode_step(self, tokens: torch.Tensor, positions: torch.Tensor, kv: DecodeKV):
        """One forward for a padded decode batch: tokens [R] at positions [R] (each row its
        own request's length) -> logits [R, V]. Makes no tensor from host data and reads no
        tensor value on the host: it can be traced whole and captured (decode_batch.py)."""
        h = self.embed(tokens)  # [R, E]
        tables = self.rope_by_kind(positions, h.dtype)  # kind -> [R, 1, D] each
        masks = kv.masks(positions, h.dtype)
        for layer, block in enumerate(self.model.layers):
            cos, sin = tables[self.rope_kind[layer]]
            h = block.decode(h, cos, sin, kv, self.store_index[layer], masks)  # [R, E]
        return self.logits(h)  # [R, V]

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head: hidden [n, E] -> logits [n, V]."""
        h = self.model.norm(h)
        weight = self.model.embed_tokens.weight if self.spec.tie_embeddings else self.lm_head.weight
        logits = F.linear(h, weight)
        cap = self.spec.get("final_softcap")
        if cap:  # Gemma's final logit soft-capping
            logits = torch.tanh(logits / cap) * cap
        return logits


def torch_dtype(spec: ModelSpec) -> torch.dtype:
    return TORCH_DTYPES[spec.dtype]


@torch.no_grad()
def init_weights(model: Transformer, seed: int) -> None:
    """Seeded random init: norms at 1, every matrix N(0, 0.02), deterministic per seed."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    for name, param in sorted(model.named_parameters()):
        if name.endswith("norm.weight"):
            param.fill_(1.0)
            continue
        values = torch.empty(param.shape, dtype=torch.float32).normal_(0.0, 0.02, generator=gen)
        param.copy_(values)


def fuse_weights(model: Transformer) -> None:
    """Build every dense layer's fused matrices from its HF-named weights (once weights are
    loaded, and again after the model moves device or dtype)."""
    if model.arch.family not in DENSE:
        return
    for block in model.model.layers:
        block.self_attn.fuse()
        block.mlp.fuse()


def build_model(spec: ModelSpec, device: str | torch.device = "cpu", seed: int | None = 0):
    """A model of `spec`'s shape in its dtype on `device`; random weights when seed is set."""
    arch_of(spec)  # refuses an arch the engine cannot build
    with torch.device("meta"):
        model = Transformer(spec)
    model = model.to_empty(device=device)
    if seed is not None:
        init_weights(model, seed)
    model = model.to(torch_dtype(spec)).eval().requires_grad_(False)
    model.set_frequencies(device)  # stays float32, like HF's
    fuse_weights(model)
    return model
