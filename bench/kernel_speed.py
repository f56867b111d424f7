"""The engine's compute against plain transformers on the same geometry, device and threads.
(Not named kernels.py: transformers imports a package `kernels`, and a script's own folder
comes first on sys.path.)

    python bench/kernel_speed.py                  # CPU: `small`, 2048 tokens, float32 (~1 min)
    python bench/kernel_speed.py --device cuda    # GPU: qwen3-0.6b, 8192 tokens, bf16
    python bench/kernel_speed.py --json
    python bench/kernel_speed.py --family qwen3_5   # a hybrid of `small`'s sizes (or gemma3)
    python bench/kernel_speed.py --count          # kernel ops per layer only (no timing)

Both sides get the same weights (our random init, saved as a checkpoint and loaded by
transformers' `AutoModelForCausalLM`, sdpa attention) and the same torch threads (the
engine's: `compute_threads`). Each round times every side once, the order rotating; a ratio
is the median over rounds of the ratio within a round (a shared machine drifts slowly).
  prefill, one chunk       pdgpu `prefill_chunk` over the whole prompt into a paged source
                           cache + the head on the last position, vs one transformers forward
                           (`logits_to_keep=1`, its KV cache on)
  prefill, chunks of 256   the same prompt in chunks, vs the same one forward
  decode step              pdgpu `decode_step` for `--batch` requests of `--contexts` tokens
                           (drawn, seeded) vs transformers' padded batched decode (a
                           DynamicCache of the same K/V, left-padded, with its attention mask)
Targets (issue 24): CPU one chunk <= 1.10x, chunks <= 1.35x; GPU one chunk <= 1.0x,
chunks <= 1.3x, decode step <= 8 ms at batch 16.

`--family qwen3_5|gemma3` (issue 33): the same sides on a hybrid of the preset's sizes,
random weights saved by transformers (Qwen3.5: 3 gated DeltaNet layers to 1 full; Gemma 3:
5 sliding layers to 1 full, window --window; the last layer full). Its decode batch is
real: both sides prefill the same `--batch` prompts (transformers left-padded in one
forward), then time a step each (transformers' cache then grows by a token a step; ours
decodes the same positions again).
`--count` (issue 34): kernel ops per layer as a GPU launches them, views excluded, counted on
`--device` (pdgpu/op_count.py; on CPU rms_norm counts as its one CUDA kernel): a decode step
of `--batch` requests of `--contexts` tokens <= 20, a prefill chunk of `--chunk` (first and
later, digests on) <= 25; and host syncs and host-made tensors in the step (target 0).
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import sys
import tempfile
import time

import attrs
import torch

from pdgpu.checkpoint import load_checkpoint, save_checkpoint
from pdgpu.decode_batch import DecodeBatch, decode_logits
from pdgpu.decode_kv import DecodeCache
from pdgpu.model import build_model
from pdgpu.op_count import decode_step_ops, per_layer, prefill_chunk_ops
from pdgpu.source_cache import SourceCache
from pdgpu.streams import compute_threads
from pdref.models import load_model

CPU_TARGETS = {"prefill_one_chunk": 1.10, "prefill_chunked": 1.35}
GPU_TARGETS = {"prefill_one_chunk": 1.0, "prefill_chunked": 1.3}
GPU_DECODE_TARGET_S = 0.008
COUNT_TARGETS = {"decode_step": 20, "prefill_first_chunk": 25, "prefill_later_chunk": 25}


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--model", help="preset (default: small on CPU, qwen3-0.6b on CUDA)")
    p.add_argument("--dtype", help="default: float32 on CPU, bfloat16 on CUDA")
    p.add_argument("--prompt", type=int, help="default: 2048 on CPU, 8192 on CUDA")
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--contexts", default="1024:4096", help="LO:HI decode context lengths")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, help="torch threads (default: the engine's)")
    p.add_argument("--profile", action="store_true",
                   help="also profile one call of each pdgpu side: aten calls, device kernels "
                        "(CUDA), device seconds, the top ops (where a launch-bound path shows)")
    p.add_argument("--family", choices=("qwen3_5", "gemma3"),
                   help="a hybrid family of the preset's sizes, saved by transformers")
    p.add_argument("--window", type=int, default=512, help="gemma3's sliding window")
    p.add_argument("--count", action="store_true",
                   help="count kernel ops per layer (decode step, prefill chunk) instead of timing")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    cuda = torch.device(args.device).type == "cuda"
    args.model = args.model or ("qwen3-0.6b" if cuda else "small")
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    args.prompt = args.prompt or (8192 if cuda else 2048)
    lo, hi = (int(x) for x in args.contexts.split(":"))
    if not 1 <= lo <= hi or args.prompt < 1 or args.chunk < 1 or args.batch < 1:
        p.error("--prompt, --chunk, --batch >= 1 and --contexts LO:HI with 1 <= LO <= HI")
    args.context_range = (lo, hi)
    return args


def _clock(device):
    def now():
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()
    return now


def _transformers_model(model, device, dtype):
    import transformers
    with tempfile.TemporaryDirectory() as folder:
        save_checkpoint(model, folder)
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            folder, dtype=dtype, attn_implementation="sdpa")
    return hf.to(device).eval()


def _ours_prefill(model, ids, chunk, geometry, dtype):
    """Prefill into a source cache allocated once (as a serving producer's is)."""
    cache = SourceCache(geometry, geometry.pages_for(len(ids)), ids.device, dtype,
                        model.state_shape)
    cache.close(cache.open(len(ids)))  # the workspace too

    def prefill():
        kv = cache.open(len(ids))
        hidden = None
        for a in range(0, len(ids), chunk):
            hidden = model.prefill_chunk(ids[a:a + chunk], a, kv)[-1:]  # [1, E]
        cache.close(kv)
        return model.logits(hidden)
    return prefill


def _decode_contexts(spec, args, device, dtype):
    """Seeded K/V [L, 2, n, KVH, D] per request, drawn on the device (GBs on a GPU)."""
    lo, hi = args.context_range
    lengths = torch.randint(lo, hi + 1, (args.batch,),
                            generator=torch.Generator().manual_seed(0)).tolist()
    gen = torch.Generator(device=device).manual_seed(0)
    return [torch.randn(spec.layers, 2, n, spec.kv_heads, spec.head_dim, generator=gen,
                        device=device, dtype=dtype) for n in lengths]


def _ours_decode(model, contexts, device, graphed: bool = False):
    """A decode step over the contexts: eager, or replayed from its CUDA graph (captured in
    the warm-up round)."""
    cache = DecodeCache.for_model(model)
    seqs = [cache.add(c) for c in contexts]
    tokens = list(range(len(seqs)))
    forward = decode_logits
    if graphed:
        from pdgpu.decode_graph import GraphedStep
        forward = GraphedStep()

    def step():
        batch = DecodeBatch(seqs)  # no advance: every step decodes the same positions
        batch.feed(tokens)
        return forward(model, batch)
    return step


def _hf_decode(hf, contexts, device):
    """Left-padded DynamicCache of the same K/V and its attention mask."""
    from transformers import DynamicCache
    longest = max(c.shape[2] for c in contexts)
    cache = DynamicCache(config=hf.config)
    for layer in range(contexts[0].shape[0]):
        k = torch.stack([_left_pad(c[layer, 0], longest) for c in contexts])  # [B, KVH, T, D]
        v = torch.stack([_left_pad(c[layer, 1], longest) for c in contexts])
        cache.update(k, v, layer)
    mask = torch.zeros(len(contexts), longest + 1, dtype=torch.int64, device=device)
    for i, c in enumerate(contexts):
        mask[i, longest - c.shape[2]:] = 1
    ids = torch.arange(len(contexts), device=device)[:, None]  # [B, 1]
    positions = torch.tensor([[c.shape[2]] for c in contexts], device=device)  # [B, 1]

    names = inspect.signature(hf.forward).parameters
    given = {"cache" if "cache" in names else "past_key_values": cache}  # transformers 5.2x: cache

    def step():
        out = hf(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                 logits_to_keep=1, **given)
        cache.crop(-1)  # drop the token just appended: the next step decodes the same
        return out.logits
    return step


def _left_pad(kv, length):
    """kv [c, KVH, D] -> [KVH, length, D], zeros first."""
    out = kv.new_zeros(kv.shape[1], length, kv.shape[2])
    out[:, length - kv.shape[0]:] = kv.transpose(0, 1)
    return out


def _hybrid_models(spec, args, device, dtype):
    """(ours, transformers') of a random `args.family` checkpoint of the preset's sizes."""
    import transformers
    shape = dict(vocab_size=spec.vocab, hidden_size=spec.hidden, num_hidden_layers=spec.layers,
                 num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads,
                 head_dim=spec.head_dim, intermediate_size=spec.intermediate,
                 max_position_embeddings=max(spec.max_context or 0, 65536))
    every = 4 if args.family == "qwen3_5" else 6  # each family's pattern: 1 full in `every`
    local = "linear_attention" if args.family == "qwen3_5" else "sliding_attention"
    shape["layer_types"] = [local if (i + 1) % every and i + 1 < spec.layers else
                            "full_attention" for i in range(spec.layers)]  # the last: full
    if args.family == "qwen3_5":
        config = transformers.Qwen3_5TextConfig(
            **shape, linear_num_key_heads=spec.kv_heads, linear_num_value_heads=spec.heads,
            linear_key_head_dim=spec.head_dim, linear_value_head_dim=spec.head_dim)
        net = transformers.Qwen3_5ForCausalLM(config)
    else:
        net = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
            **shape, sliding_window=args.window, query_pre_attn_scalar=spec.head_dim))
    with tempfile.TemporaryDirectory() as folder:
        torch.manual_seed(0)
        net.save_pretrained(folder)
        model = load_checkpoint(folder, device, args.dtype)
        hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    return model, hf.to(device).eval()


def _hybrid_prompts(spec, args, device) -> list[torch.Tensor]:
    lo, hi = args.context_range
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(lo, hi + 1, (args.batch,), generator=gen).tolist()
    return [torch.randint(0, spec.vocab, (n,), generator=gen).to(device) for n in lengths]


@torch.no_grad()
def _ours_hybrid_decode(model, prompts, chunk, device):
    """Each prompt prefilled by the engine, then one batch over all of them."""
    geometry, dtype = model.spec.geometry(16), model.model.embed_tokens.weight.dtype
    cache = DecodeCache.for_model(model)
    seqs = []
    for ids in prompts:
        source = SourceCache(geometry, geometry.pages_for(len(ids)), device, dtype,
                             model.state_shape)
        kv = source.open(len(ids))
        for a in range(0, len(ids), chunk):
            model.prefill_chunk(ids[a:a + chunk], a, kv)
        seqs.append(cache.add(kv.kv.index_select(2, kv.slots), kv.read_state()))
    tokens = list(range(len(seqs)))

    def step():
        batch = DecodeBatch(seqs)  # no advance: every step decodes the same positions
        batch.feed(tokens)
        return decode_logits(model, batch)
    return step


@torch.no_grad()
def _hf_hybrid_decode(hf, prompts, device):
    """The prompts left-padded through one transformers forward, then a step at a time."""
    longest = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), longest, dtype=torch.int64, device=device)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, longest - len(p):], mask[i, longest - len(p):] = p, 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = hf(input_ids=ids, attention_mask=mask, position_ids=positions,
               use_cache=True, logits_to_keep=1).past_key_values
    state = {"mask": mask, "next": positions[:, -1:] + 1}
    new = torch.arange(len(prompts), device=device)[:, None]  # [B, 1]

    def step():
        state["mask"] = torch.cat((state["mask"], state["mask"][:, -1:]), dim=1)
        out = hf(input_ids=new, attention_mask=state["mask"], position_ids=state["next"],
                 cache=cache, use_cache=True, logits_to_keep=1)
        state["next"] = state["next"] + 1
        return out.logits
    return step


def _models(spec, args, device, dtype):
    if args.family:
        return _hybrid_models(spec, args, device, dtype)
    model = build_model(attrs.evolve(spec, dtype=args.dtype), device, seed=0)
    return model, _transformers_model(model, device, dtype)


def _decode_sides(spec, model, hf, args, device, dtype) -> dict:
    if args.family:
        prompts = _hybrid_prompts(spec, args, device)
        return {"ours_decode": _ours_hybrid_decode(model, prompts, args.chunk, device),
                "hf_decode": _hf_hybrid_decode(hf, prompts, device)}
    contexts = _decode_contexts(spec, args, device, dtype)
    sides = {"ours_decode": _ours_decode(model, contexts, device),
             "hf_decode": _hf_decode(hf, contexts, device)}
    if device.type == "cuda":  # the same step as one CUDA graph (issue 34)
        sides["ours_decode_graph"] = _ours_decode(model, contexts, device, graphed=True)
    return sides


def measure(args) -> dict:
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    spec = load_model(args.model)
    model, hf = _models(spec, args, device, dtype)
    geometry = model.spec.geometry(16)
    ids = torch.randint(0, spec.vocab, (args.prompt,), generator=torch.Generator().manual_seed(1))
    ids = ids.to(device)
    sides = {
        "ours_one_chunk": _ours_prefill(model, ids, args.prompt, geometry, dtype),
        "ours_chunked": _ours_prefill(model, ids, args.chunk, geometry, dtype),
        "hf_forward": lambda: hf(input_ids=ids[None], logits_to_keep=1, use_cache=True).logits,
        **_decode_sides(spec, model, hf, args, device, dtype),
    }
    times = _rounds(sides, args.repeats, _clock(device))
    profiles = _profile(sides, ("ours_chunked", "ours_decode"), device) if args.profile else {}
    return times, profiles


def _profile(sides: dict, names, device) -> dict:
    """One call of each side under torch.profiler -> counts, device seconds, top ops."""
    from torch.profiler import ProfilerActivity, profile
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    out = {}
    for name in names:
        with torch.no_grad(), profile(activities=activities) as prof:
            sides[name]()
            _clock(device)()
        out[name] = _profile_row(prof.key_averages(), cuda)
    return out


def _profile_row(events, cuda: bool) -> dict:
    kernels = [e for e in events if cuda and e.device_type == torch.autograd.DeviceType.CUDA]
    top = sorted(kernels or [e for e in events if e.key.startswith("aten::")],
                 key=lambda e: e.self_device_time_total if cuda else e.self_cpu_time_total,
                 reverse=True)[:6]
    return {"aten_calls": sum(e.count for e in events if e.key.startswith("aten::")),
            "device_kernels": sum(e.count for e in kernels),
            "device_s": sum(e.self_device_time_total for e in kernels) / 1e6,
            "top": [e.key[:60] for e in top]}


def _rounds(sides: dict, repeats: int, now) -> dict:
    names = list(sides)
    times = {n: [] for n in names}
    with torch.no_grad():
        for n in names:  # warm-up
            sides[n]()
        for r in range(repeats):
            for n in names[r % len(names):] + names[:r % len(names)]:
                start = now()
                sides[n]()
                times[n].append(now() - start)
    return times


def summary(measured: tuple, args, threads: int) -> dict:
    times, profiles = measured

    def ratio(a, b):
        return statistics.median(x / y for x, y in zip(times[a], times[b], strict=True))
    out = {f"{n}_s": statistics.median(v) for n, v in times.items()}
    out.update(prefill_one_chunk=ratio("ours_one_chunk", "hf_forward"),
               prefill_chunked=ratio("ours_chunked", "hf_forward"),
               decode_step=ratio("ours_decode", "hf_decode"),
               model=args.model, family=args.family, device=args.device, dtype=args.dtype,
               prompt=args.prompt,
               chunk=args.chunk, batch=args.batch, contexts=args.contexts, threads=threads,
               repeats=args.repeats, profile=profiles)
    return out


def _report(out: dict, cuda: bool) -> list[str]:
    targets = GPU_TARGETS if cuda else CPU_TARGETS
    name = out["model"] + (f" as {out['family']}" if out["family"] else "")
    lines = [f"{name} {out['dtype']} on {out['device']}, {out['threads']} threads, "
             f"prompt {out['prompt']}, chunk {out['chunk']}, decode batch {out['batch']} "
             f"of {out['contexts']} tokens, median of {out['repeats']} rounds"]
    for key in ("prefill_one_chunk", "prefill_chunked"):
        ok = "ok" if out[key] <= targets[key] else "MISSED"
        lines.append(f"  {key:18s} pdgpu / transformers {out[key]:.3f}x "
                     f"(target <= {targets[key]}x: {ok})")
    lines.append(f"  {'decode_step':18s} pdgpu / transformers {out['decode_step']:.3f}x "
                 f"(pdgpu {out['ours_decode_s'] * 1e3:.1f} ms, transformers "
                 f"{out['hf_decode_s'] * 1e3:.1f} ms)")
    for side in ("ours_decode", "ours_decode_graph"):
        if cuda and side + "_s" in out:
            ok = "ok" if out[side + "_s"] <= GPU_DECODE_TARGET_S else "MISSED"
            how = "replayed as a CUDA graph" if side.endswith("graph") else "eager"
            lines.append(f"  decode step {how} {out[side + '_s'] * 1e3:.2f} ms "
                         f"(target <= {GPU_DECODE_TARGET_S * 1e3:.0f} ms: {ok})")
    for name in ("ours_one_chunk", "ours_chunked", "hf_forward"):
        lines.append(f"  {name:18s} {out[name + '_s'] * 1e3:9.1f} ms")
    for name, row in out["profile"].items():
        lines.append(f"  profile {name}: {row['aten_calls']} aten calls, {row['device_kernels']} "
                     f"device kernels ({row['device_s'] * 1e3:.1f} ms on the device); top: "
                     + ", ".join(row["top"]))
    return lines


def counts(args) -> dict:
    """Kernel ops per layer of a decode step and of a first and a later prefill chunk."""
    spec = attrs.evolve(load_model(args.model), dtype=args.dtype)
    lengths = torch.randint(args.context_range[0], args.context_range[1] + 1, (args.batch,),
                            generator=torch.Generator().manual_seed(0)).tolist()
    sides = {"decode_step": lambda s: decode_step_ops(s, lengths, args.device)}
    for name, start in (("prefill_first_chunk", 0), ("prefill_later_chunk", args.chunk)):
        sides[name] = lambda s, start=start: prefill_chunk_ops(s, args.chunk, start, True,
                                                               args.device)
    out = {"model": args.model, "device": args.device, "dtype": args.dtype,
           "batch": args.batch, "contexts": args.contexts, "chunk": args.chunk}
    for name, measure in sides.items():
        layer, once = per_layer(spec, measure)
        out[name] = {"per_layer": layer.kernels, "per_layer_cpu_dispatched": layer.cpu_ops,
                     "once": once.kernels, "syncs": layer.syncs + once.syncs,
                     "made": layer.made + once.made, "target": COUNT_TARGETS[name],
                     "top": dict(layer.names.most_common(8))}
    return out


def _count_report(out: dict) -> list[str]:
    lines = [f"{out['model']} {out['dtype']} on {out['device']}: kernel ops per layer "
             f"(views excluded), decode batch {out['batch']} of {out['contexts']} tokens, "
             f"chunk {out['chunk']}"]
    for name in COUNT_TARGETS:
        row = out[name]
        ok = "ok" if row["per_layer"] <= row["target"] else "MISSED"
        lines.append(f"  {name:20s} {row['per_layer']:3d} per layer (target <= {row['target']}: "
                     f"{ok}), {row['once']} once per call, {row['syncs']} host syncs, "
                     f"{row['made']} host-made tensors; CPU build dispatches "
                     f"{row['per_layer_cpu_dispatched']} per layer")
    return lines


def main(argv=None) -> int:
    args = _parse(argv)
    if args.count:
        out = counts(args)
        print(json.dumps(out, indent=1) if args.json else "\n".join(_count_report(out)))
        return 0
    with compute_threads(args.device, args.threads):
        out = summary(measure(args), args, torch.get_num_threads())
    cuda = torch.device(args.device).type == "cuda"
    print(json.dumps(out, indent=1) if args.json else "\n".join(_report(out, cuda)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
