"""What a hybrid saves per request: the decoder's memory and the bytes a handoff carries.

    python bench/hybrid_memory.py            # Gemma 3 1B and Qwen3.5 9B geometry, 4k and 32k
    python bench/hybrid_memory.py --json

For each model, and for its dense twin (the same config with every layer full attention),
at each context length:
  decoder_bytes   the engine's DecodeCache after admitting one request of that context
                  (full layers: a bucket row of width_for(context + 1); sliding layers: a
                  ring of `window` rows; linear layers: one state slot), built on the meta
                  device (sizes only, nothing allocated)
  kv_bytes        the K/V a whole-mode handoff of that prompt carried before contract v3
                  (every token of every K/V layer; a Qwen3.5's linear layers carry none)
  state_bytes     a Qwen3.5's per-request DeltaNet state (conv window + recurrent matrices)
  window_kv_bytes the K/V a handoff needs under contract v3's sliding rule (a sliding layer
                  only its last window, from the start of its page)
The geometry is the models' published config.json (Gemma 3 1B) and transformers'
Qwen3_5TextConfig defaults (its docstring: Qwen3.5-9B style), in bfloat16.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from pdgpu.decode_kv import DecodeCache
from pdgpu.hf_config import spec_from_config
from pdgpu.model import Transformer

GEMMA3_1B = {
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "dtype": "bfloat16",
    "num_hidden_layers": 26, "hidden_size": 1152, "num_attention_heads": 4,
    "num_key_value_heads": 1, "head_dim": 256, "intermediate_size": 6912,
    "vocab_size": 262144, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
    "hidden_activation": "gelu_pytorch_tanh", "sliding_window": 512,
    "query_pre_attn_scalar": 256, "max_position_embeddings": 32768,
    "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
    "layer_types": ["sliding_attention" if (i + 1) % 6 else "full_attention"
                    for i in range(26)]}
QWEN35_9B = {
    "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", "dtype": "bfloat16",
    "num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 16,
    "num_key_value_heads": 4, "head_dim": 256, "intermediate_size": 12288,
    "vocab_size": 248320, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "hidden_act": "silu", "max_position_embeddings": 262144,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1e7,
                        "partial_rotary_factor": 0.25},
    "layer_types": ["linear_attention" if (i + 1) % 4 else "full_attention"
                    for i in range(32)]}
MODELS = {"gemma-3-1b": GEMMA3_1B, "qwen3.5-9b": QWEN35_9B}


def dense_twin(config: dict) -> dict:
    return {**config, "layer_types": ["full_attention"] * config["num_hidden_layers"]}


def _model(config: dict, name: str) -> Transformer:
    with torch.device("meta"):
        return Transformer(spec_from_config(config, name, name)).to(torch.bfloat16)


def decoder_bytes(model: Transformer, context: int) -> int:
    """Bytes the decode cache holds for one admitted request of `context` tokens."""
    spec = model.spec
    cache = DecodeCache.for_model(model)
    layers = len(model.arch.kv_layers)
    kv = torch.empty(layers, 2, context, spec.kv_heads, spec.head_dim, device="meta",
                     dtype=torch.bfloat16)
    state = None
    if cache.states is not None:
        pool = cache.states
        state = (pool.conv[:, 0].clone(), pool.recurrent[:, 0].clone())
    cache.add(kv, state)
    return cache.nbytes


def handoff(model: Transformer, prompt: int, page_tokens: int = 16) -> dict:
    """K/V bytes of a whole-mode handoff before v3, under v3's window rule, and the state's."""
    spec, arch = model.spec, model.arch
    per_token_layer = 2 * spec.kv_heads * spec.head_dim * spec.dtype_bytes
    first = max(0, prompt - (arch.window or prompt) + 1)
    window_tokens = prompt - (first - first % page_tokens)
    windowed = sum(window_tokens if k == "sliding" else prompt
                   for k in arch.kinds if k != "linear")
    state = model.state_shape
    return {"kv_bytes": per_token_layer * prompt * len(arch.kv_layers),
            "window_kv_bytes": per_token_layer * windowed,
            "state_bytes": 0 if state is None else state.nbytes}


def rows(contexts: list[int]) -> list[dict]:
    out = []
    for name, config in MODELS.items():
        for label, cfg in ((name, config), (f"{name} dense twin", dense_twin(config))):
            model = _model(cfg, label)
            for context in contexts:
                out.append({"model": label, "context": context,
                            "decoder_bytes": decoder_bytes(model, context),
                            **handoff(model, context)})
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", default="4000,32000",
                   help="prompt lengths (a request of 4096 would take an 8192-wide row: "
                        "its first step holds 4097 keys)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    table = rows([int(x) for x in args.contexts.split(",")])
    if args.json:
        print(json.dumps(table, indent=1))
        return 0
    keys = ("decoder_bytes", "kv_bytes", "window_kv_bytes", "state_bytes")
    print(f"{'model':26s} {'context':>8s} " + " ".join(f"{k:>16s}" for k in keys))
    for r in table:
        print(f"{r['model']:26s} {r['context']:8d} " + " ".join(
            f"{r[k] / 2**20:14.1f}MB" for k in keys))
    return 0


if __name__ == "__main__":
    sys.exit(main())
