"""Decode memory's CPU costs on this checkout, for comparing two checkouts side by side
(docs/graph-step.md): requests joining a DecodeCache one by one (each one gather of its
context; the bucket's rows doubling as they come), decode steps over all of them, and their
leaves (each a row copied into the freed one, the rows halving).

    python bench/decode_memory.py                     # `small`, 16 requests of 128..512
    python bench/decode_memory.py --json
    PYTHONPATH=OTHER_CHECKOUT python bench/decode_memory.py --json   # the other side

Medians over --repeats rounds, in seconds: join_s (all joins), step_s (one step of the
batch), leave_s (all leaves). The peak bytes a growth holds are tested, not benched
(tests/test_pdgpu_decode_kv.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from pdgpu.decode_batch import DecodeBatch, decode_tokens
from pdgpu.decode_kv import DecodeCache
from pdgpu.model import build_model
from pdref.models import load_model


def _round(model, contexts: list[torch.Tensor], steps: int) -> dict[str, float]:
    """One round: every request joins, `steps` steps, every request leaves."""
    cache = DecodeCache.for_model(model)
    start = time.perf_counter()
    seqs = [cache.add(c) for c in contexts]
    joined = time.perf_counter()
    for _ in range(steps):
        decode_tokens(model, DecodeBatch(seqs), [1] * len(seqs))
    stepped = time.perf_counter()
    for seq in seqs:
        cache.remove(seq)
    return {"join_s": joined - start, "step_s": (stepped - joined) / steps,
            "leave_s": time.perf_counter() - stepped}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="small")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--contexts", default="128:512", help="LO:HI context lengths (drawn)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = build_model(load_model(args.model), seed=0)
    spec, (lo, hi) = model.spec, map(int, args.contexts.split(":"))
    lengths = torch.randint(lo, hi + 1, (args.requests,)).tolist()
    contexts = [torch.randn(len(model.arch.kv_layers), 2, n, spec.kv_heads, spec.head_dim)
                for n in lengths]
    rounds = [_round(model, contexts, args.steps) for _ in range(args.repeats + 1)][1:]
    out = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    print(json.dumps(out) if args.json else
          "  ".join(f"{k} {v * 1e3:.2f} ms" for k, v in out.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
