"""A request waiting for room: what its scheduling turns cost on each side's prefix cache.

A long prompt (`--prompt` tokens, its first `--cached` held by the cache) heads the queue for
`--turns` turns; each turn asks what the scheduler asks: the producer whether it can open
(`ProducerCache.can_open`: its look-up and the pool's room), the decoder its hit
(`DecoderPrefix.lookup`). Since issue 35 the request's key chain is made once and kept
(every turn reuses it); before, each turn hashed the prompt's pages again. The script runs
on either tree (it passes the tokens where there is no `chain`), so bench/tree_ab.py times
one against the other; its JSON line: microseconds a turn on each side, hash calls a turn.

    git worktree add --detach /tmp/old OLD && ln -s "$PWD/build" /tmp/old/build
    python bench/tree_ab.py /tmp/old "$PWD" --rounds 4 \\
        --keys producer_turn_us,decoder_turn_us -- bench/prefix_wait.py --prompt 8192
"""

from __future__ import annotations

import argparse
import hashlib
import json
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from pdgpu import prefix_index
from pdgpu.serve.decoder_prefix import DecoderPrefix
from pdgpu.serve.ledger import Ledger
from pdgpu.serve.producer_cache import ProducerCache
from pdgpu.serve.tracelog import TraceLog
from pdgpu.source_cache import SourceCache
from pdref import events as ev
from pdref.geometry import Geometry


def _args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompt", type=int, default=8192, help="the waiting prompt's tokens")
    p.add_argument("--cached", type=int, default=4096, help="its leading tokens cached")
    p.add_argument("--turns", type=int, default=200, help="scheduling turns it waits")
    p.add_argument("--page-tokens", type=int, default=16)
    p.add_argument("--chunk", type=int, default=64)
    args = p.parse_args()
    if not 0 < args.cached < args.prompt or args.turns < 1:
        p.error("need 0 < --cached < --prompt and --turns >= 1")
    return args


def _keys(cache, tokens):
    """The request's kept key chain where the tree has one, else its tokens (hashed again)."""
    return cache.chain(tokens) if hasattr(cache, "chain") else tokens


def _turns(ask, turns: int, calls: list) -> tuple[float, float]:
    """Microseconds a turn of `ask()`, and hash calls a turn (`calls` gets one each)."""
    before, start = len(calls), time.perf_counter()
    for _ in range(turns):
        ask()
    return (time.perf_counter() - start) / turns * 1e6, (len(calls) - before) / turns


def producer_turn(args, tokens: list[int], calls: list) -> tuple[float, float]:
    """The producer: its cache holds the prompt's first `cached` tokens; the pool lacks room
    for the rest (two pages free), so the head waits."""
    pt, pages = args.page_tokens, args.prompt // args.page_tokens
    geometry = Geometry(layers=1, kv_heads=1, head_dim=2, dtype_bytes=4, page_tokens=pt)
    cache = ProducerCache(SourceCache(geometry, pages, "cpu", torch.float32), 1, pages,
                          args.chunk, 0, lambda *_, **__: None)
    shared = tokens[:args.cached + 1]
    held = cache.open("warm", "warm", _keys(cache, shared))
    cache.keep("warm", "warm", _keys(cache, shared), held, 0)
    cache.confirm(held, True)
    cache.prefix.source.pool, _ = cache.prefix.source.pool.allocate(
        cache.prefix.source.pool.free_pages - 2)
    keys = _keys(cache, tokens)
    assert not cache.can_open(keys)
    return _turns(lambda: cache.can_open(keys), args.turns, calls)


def decoder_turn(args, tokens: list[int], calls: list, folder: Path) -> tuple[float, float]:
    """The decoder: its index holds the prompt's first `cached` tokens' pages."""
    geometry = Geometry(layers=1, kv_heads=1, head_dim=2, dtype_bytes=4,
                        page_tokens=args.page_tokens)
    header = ev.Header("bench", "chunk", geometry, args.prompt // args.page_tokens, 4,
                       version=ev.CACHE_VERSION)
    ledger = Ledger(header, "cpu", torch.float32, TraceLog(header, folder / "t.jsonl"))
    try:
        cache = DecoderPrefix(ledger, args.chunk, args.prompt // args.page_tokens)
        cached = args.cached // args.page_tokens
        cache.index.insert(tokens, (0, cached * args.page_tokens), list(range(cached)))
        keys = _keys(cache, tokens)
        assert len(cache.lookup(keys)) * args.page_tokens == args.cached // args.chunk * args.chunk
        return _turns(lambda: cache.lookup(keys), args.turns, calls)
    finally:
        ledger.stop()
        ledger.log.close()


def main() -> None:
    args = _args()
    tokens = torch.randint(0, 150_000, (args.prompt,),
                           generator=torch.Generator().manual_seed(0)).tolist()
    calls = []
    real = hashlib.blake2b
    prefix_index.hashlib = SimpleNamespace(
        blake2b=lambda data, **kw: calls.append(1) or real(data, **kw))
    with tempfile.TemporaryDirectory() as folder:
        producer, producer_hashes = producer_turn(args, tokens, calls)
        decoder, decoder_hashes = decoder_turn(args, tokens, calls, Path(folder))
    print(json.dumps({"prompt": args.prompt, "turns": args.turns,
                      "producer_turn_us": round(producer, 1),
                      "decoder_turn_us": round(decoder, 1),
                      "producer_hashes_per_turn": producer_hashes,
                      "decoder_hashes_per_turn": decoder_hashes}))


if __name__ == "__main__":
    main()
