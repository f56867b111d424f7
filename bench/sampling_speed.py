"""What sampling adds to a decode step: greedy against sampled batches, side by side.

    python bench/sampling_speed.py                 # CPU: `small`, batch 16 (~30 s)
    python bench/sampling_speed.py --device cuda   # GPU: qwen3-0.6b, batch 64, bf16
    python bench/sampling_speed.py --json

Two measurements, each a median over rounds of ratios within a round (the sides' order
rotating; a shared machine drifts slowly):
  pick          Sampler.pick alone over logits [batch, vocab] of the served model's vocab
                (qwen3's 151936 by default), each kind of batch against the argmax
  decode step   the engine's whole decode step (model forward + pick) for `--batch` requests
                of `--context` tokens of the `--model`, each kind against greedy
Kinds: greedy; temperature 0.8 (one draw, no sort); top_p 0.95 + top_k 50 (one sort);
penalized (temperature, top_p, and the three penalties over each request's prompt and output).
Also the aten ops one pick dispatches (a CPU-side cost per step, issue 34).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pdgpu.decode_batch import DecodeBatch, decode_tokens
from pdgpu.decode_kv import DecodeCache
from pdgpu.model import build_model
from pdgpu.sampler import Sampler, Step
from pdgpu.sampling import GREEDY, Sampling
from pdgpu.streams import compute_threads
from pdref.models import load_model

KINDS = {"greedy": GREEDY, "temperature": Sampling(temperature=0.8),
         "top_p_top_k": Sampling(temperature=0.8, top_p=0.95, top_k=50),
         "penalized": Sampling(temperature=0.8, top_p=0.95, presence_penalty=0.5,
                               frequency_penalty=0.3, repetition_penalty=1.1)}


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--model", help="preset (default: small on CPU, qwen3-0.6b on CUDA)")
    p.add_argument("--batch", type=int, help="default: 16 on CPU, 64 on CUDA")
    p.add_argument("--vocab", type=int, default=151936, help="the pick measurement's vocab")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    cuda = args.device.startswith("cuda")
    args.model = args.model or ("qwen3-0.6b" if cuda else "small")
    args.batch = args.batch or (64 if cuda else 16)
    return args


def _now(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _sampler(vocab: int, device, sampling: Sampling, batch: int):
    """A sampler with `batch` requests open (prompt and a few outputs each) -> steps."""
    sampler = Sampler(vocab, device)
    gen = torch.Generator().manual_seed(0)
    steps = []
    for row in range(batch):
        prompt = torch.randint(0, vocab, (64,), generator=gen).tolist()
        slot = sampler.open(sampling, prompt, prompt[:8])
        steps.append(Step(Sampling(**{**_fields(sampling), "seed": row}), 8, (), slot))
    return sampler, steps


def _fields(sampling: Sampling) -> dict:
    import attrs
    return attrs.asdict(sampling)


def _rounds(sides: dict, device, rounds: int) -> dict:
    """name -> median over rounds of (its time / the first side's time), and the times."""
    names = list(sides)
    times = {n: [] for n in names}
    for r in range(rounds):
        for n in names[r % len(names):] + names[:r % len(names)]:
            start = _now(device)
            sides[n]()
            times[n].append(_now(device) - start)
    base = names[0]
    return {n: {"median_s": statistics.median(times[n]),
                "ratio": statistics.median(t / b for t, b in zip(times[n], times[base],
                                                                  strict=True))}
            for n in names}


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _pick_sides(args, device) -> tuple[dict, dict]:
    logits = torch.randn(args.batch, args.vocab, device=device,
                         generator=torch.Generator(device=device).manual_seed(1))
    sides, ops = {}, {}
    for name, sampling in KINDS.items():
        sampler, steps = _sampler(args.vocab, device, sampling, args.batch)
        sides[name] = lambda s=sampler, st=steps: s.pick(logits, st)
        with _Count() as count:
            sides[name]()
        ops[name] = count.ops
    return sides, ops


def _step_sides(args, device) -> dict:
    spec = load_model(args.model)
    model = build_model(spec, device, seed=0)
    dtype = model.model.embed_tokens.weight.dtype
    gen = torch.Generator(device=device).manual_seed(0)
    contexts = [torch.randn(spec.layers, 2, args.context, spec.kv_heads, spec.head_dim,
                            generator=gen, device=device, dtype=dtype)
                for _ in range(args.batch)]
    cache = DecodeCache.for_model(model)
    seqs = [cache.add(c) for c in contexts]
    last = list(range(args.batch))
    sides = {}
    for name, sampling in KINDS.items():
        sampler, steps = _sampler(spec.vocab, device, sampling, args.batch)

        def step(s=sampler, st=steps):
            batch = DecodeBatch(seqs)
            decode_tokens(model, batch, last, lambda logits: s.pick(logits, st))
            for seq in seqs:  # every step decodes the same positions
                seq.length -= 1
        sides[name] = step
    return sides


def main(argv=None) -> int:
    args = _parse(argv)
    device = torch.device(args.device)
    with compute_threads(args.device, None), torch.no_grad():
        pick_sides, ops = _pick_sides(args, device)
        for side in pick_sides.values():
            side()  # warm
        pick = _rounds(pick_sides, device, args.rounds)
        step_sides = _step_sides(args, device)
        for side in step_sides.values():
            side()
        step = _rounds(step_sides, device, args.rounds)
    out = {"device": args.device, "model": args.model, "batch": args.batch,
           "vocab": args.vocab, "context": args.context, "pick": pick, "ops_per_pick": ops,
           "decode_step": step}
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"{args.device}, batch {args.batch}: pick over vocab {args.vocab}; decode step of "
          f"{args.model} at context {args.context}")
    print(f"{'kind':<14}{'pick ms':>10}{'x argmax':>10}{'aten ops':>10}{'step ms':>10}"
          f"{'x greedy':>10}")
    for name in KINDS:
        print(f"{name:<14}{1e3 * pick[name]['median_s']:>10.3f}{pick[name]['ratio']:>10.2f}"
              f"{ops[name]:>10}{1e3 * step[name]['median_s']:>10.2f}"
              f"{step[name]['ratio']:>10.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
