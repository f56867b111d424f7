"""Bytes a served request hands off, dense vs each hybrid, read from `pdgpu serve`'s trace.

    python bench/hybrid_serve_bytes.py                       # prompt 2048, chunk 256
    python bench/hybrid_serve_bytes.py --prompt 512 --json

Random-weight checkpoints saved by transformers, float32, each hybrid beside its dense twin
(the same config with every layer full attention): a Qwen3.5 of 8 layers (6 gated DeltaNet,
2 full) and a Gemma 3 of 12 layers (10 sliding with a window of 256, 2 full), hidden 64,
2 K/V heads of 32. Each is served (`pdgpu serve`, 2 producers, chunk mode, `--verify`) with
two requests of `--prompt` tokens; per request, from the trace's `issue` events of its
admitted life: `kv_bytes` (K/V spans: a sliding layer's window only, contract v3) and
`state_bytes` (state spans), and `ratio`, the request's bytes over its dense twin's.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import tempfile
from pathlib import Path

import torch

from pdgpu.cli import main as pdgpu

SHAPE = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, max_position_embeddings=8192,
             initializer_range=0.2)
QWEN35 = dict(SHAPE, num_hidden_layers=8, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_key_head_dim=16, linear_value_head_dim=16, tie_word_embeddings=False)
GEMMA3 = dict(SHAPE, num_hidden_layers=12, sliding_window=256, query_pre_attn_scalar=24)


def save(folder: Path, family: str, dense: bool) -> Path:
    """A random checkpoint of `family` (every layer full attention when `dense`)."""
    import transformers
    torch.manual_seed(0)
    if family == "qwen3_5":
        config = transformers.Qwen3_5TextConfig(**QWEN35)
        make = transformers.Qwen3_5ForCausalLM
    else:
        config = transformers.Gemma3TextConfig(**GEMMA3)
        make = transformers.Gemma3ForCausalLM
    if dense:
        config.layer_types = ["full_attention"] * config.num_hidden_layers
    make(config).save_pretrained(folder)
    return folder


def served_bytes(model: Path, prompt: int, chunk: int, work: Path) -> dict:
    """Serve two requests of `prompt` tokens; the handoff bytes of each admitted life."""
    trace = work / f"{model.name}.jsonl"
    with contextlib.redirect_stdout(io.StringIO()):  # its summary: not this table
        code = pdgpu(["serve", "--model", str(model), "--producers", "2", "--requests", "2",
                      "--prompt-range", f"{prompt}:{prompt}", "--output-tokens", "2",
                      "--chunk", str(chunk), "--mode", "chunk", "--verify", "--trace",
                      str(trace), "--no-progress"])
    if code != 0:
        raise SystemExit(f"pdgpu serve on {model.name} exited {code}")
    events = [json.loads(line) for line in trace.read_text().splitlines()[1:]]
    admitted = {e["req"] for e in events if e["kind"] == "admit"}
    per = {req: {"kv_bytes": 0, "state_bytes": 0} for req in admitted}
    for e in events:
        if e["kind"] == "issue" and e["req"] in admitted:
            per[e["req"]]["state_bytes" if e.get("state") else "kv_bytes"] += e["bytes"]
    sizes = {json.dumps(v, sort_keys=True) for v in per.values()}
    if len(sizes) != 1:  # equal prompts: every request hands off the same bytes
        raise SystemExit(f"{model.name}: requests handed off different bytes: {sizes}")
    return json.loads(sizes.pop())


def rows(prompt: int, chunk: int, work: Path) -> list[dict]:
    out = []
    for family in ("qwen3_5", "gemma3"):
        twin = served_bytes(save(work / f"{family}-dense-twin", family, True), prompt, chunk,
                            work)
        hybrid = served_bytes(save(work / family, family, False), prompt, chunk, work)
        total = twin["kv_bytes"] + twin["state_bytes"]
        for name, got in ((f"{family} dense twin", twin), (family, hybrid)):
            out.append({"model": name, "prompt": prompt, **got,
                        "ratio": (got["kv_bytes"] + got["state_bytes"]) / total})
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompt", type=int, default=2048)
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        table = rows(args.prompt, args.chunk, Path(tmp))
    if args.json:
        print(json.dumps(table, indent=1))
        return 0
    print(f"{'model':22s} {'prompt':>7s} {'kv_bytes':>12s} {'state_bytes':>12s} {'ratio':>6s}")
    for r in table:
        print(f"{r['model']:22s} {r['prompt']:7d} {r['kv_bytes']:12,d} "
              f"{r['state_bytes']:12,d} {r['ratio']:6.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
