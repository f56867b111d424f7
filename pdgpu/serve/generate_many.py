"""`pdgpu generate --prompts FILE`: the reference for several prompts, one after another,
through one producer's automatic prefix cache (generate_cached; on by default, off with
`--no-prefix-cache` or `--prefix`): its tokens must be those without the cache, and it says
how many prompt tokens it computed and whether the cache was on.
"""

from __future__ import annotations

import json
import time

from pdgpu.serve.command import cache_off, prefix_cache_pages
from pdgpu.serve.workload import check_vocab, read_prompts, shared_prefix
from pdgpu.workload import WorkloadError
from pdref.models import context_error


def checked_prompts(args, spec) -> list:
    """The prompts file's requests, checked against the model (WorkloadError: one line)."""
    requests = read_prompts(args.prompts, args.output_tokens)
    check_vocab(requests, spec.vocab)
    for r in requests:
        problem = context_error(spec, r.prompt, r.output_tokens, f"prompts: request {r.req!r}")
        if problem:
            raise WorkloadError(problem)
    if args.prefix % args.page_tokens:
        raise WorkloadError(f"prefix must be a multiple of page-tokens={args.page_tokens}, "
                            f"got {args.prefix}")
    shared_prefix(requests, args.prefix)
    return requests


def cache_budget(args, requests) -> int:
    """The cache's pages (0: off), refused where it makes no sense (prefix_cache_pages)."""
    longest = max(-(-r.prompt // args.page_tokens) for r in requests)
    return prefix_cache_pages(args, longest)


def generate_all(model, requests, args, budget: int, sampling, forward) -> dict:
    """Each request's output tokens, the prompt tokens computed in all, the wall time."""
    from pdgpu.generate import generate, generate_cached
    start = time.perf_counter()
    prompts = [list(r.tokens) for r in requests]
    if budget:
        outputs, computed = generate_cached(
            model, prompts, [r.output_tokens for r in requests], args.chunk, args.page_tokens,
            budget, args.eos_token, sampling, forward)
    else:
        outputs = [generate(model, p, r.output_tokens, args.chunk, args.prefix,
                            args.page_tokens, args.eos_token, sampling, forward)
                   for p, r in zip(prompts, requests, strict=True)]
        computed = sum(len(p) - args.prefix for p in prompts)
    return {"outputs": {r.req: out for r, out in zip(requests, outputs, strict=True)},
            "prompt_tokens": sum(map(len, prompts)), "computed_tokens": computed,
            "prefix_cache": budget > 0, "prefix_cache_off": cache_off(args, budget),
            "wall_s": time.perf_counter() - start}


def print_all(values: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(values))
        return
    for req, out in values["outputs"].items():
        print(f"{req}: " + " ".join(map(str, out)))
    cache = "on" if values["prefix_cache"] else f"off: {values['prefix_cache_off']}"
    print(f"prompt tokens computed: {values['computed_tokens']} of {values['prompt_tokens']} "
          f"(prefix cache {cache})")
