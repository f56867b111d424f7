"""`pdsim run`'s prefix cache and session options (contract v4, docs/prefix-cache.md): the
caches' page budgets, and a multi-turn workload (pdsim/core/sessions.py)."""

from __future__ import annotations

import argparse

import attrs

from pdsim.arg_types import int_range
from pdsim.core.config import SimConfig
from pdsim.core.sessions import SessionSpec, SessionWorkload
from pdsim.core.workload_rules import WorkloadError


def add_cache_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("prefix cache (contract v4: version 4 traces)")
    g.add_argument("--prefix-cache", action="store_true",
                   help="cache prefixes on both sides by whole pages, LRU: the producer skips "
                        "computing the pages it holds, the decoder's never cross (budgets: "
                        "the pool's pages, unless given)")
    g.add_argument("--decoder-cache-pages", type=int, default=None,
                   help="the most pages the decoder's cache holds (of its pool; 0: none); "
                        "implies --prefix-cache")
    g.add_argument("--producer-cache-pages", type=int, default=None,
                   help="the most pages each producer's cache holds (0: none); implies "
                        "--prefix-cache")


def add_session_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sessions: multi-turn conversations sharing a system prompt")
    g.add_argument("--sessions", type=int, default=None,
                   help="conversations; each turn's prompt is the conversation so far plus "
                        "its user tokens; they start at --rate (Poisson) or --interval")
    g.add_argument("--turns", type=int, default=4, help="requests per session")
    g.add_argument("--system-prompt", type=int, default=0,
                   help="tokens of the system prompt every session starts with")
    g.add_argument("--turn-tokens", type=int_range, default=(64, 256),
                   help="a turn's new user tokens, uniform in A:B")
    g.add_argument("--think", type=float, default=1.0,
                   help="mean seconds (exponential) between an answer and the next turn")


def session_workload(args) -> SessionWorkload:
    """The sessions the options describe (answers: --output-range, else --output-tokens)."""
    output = args.output_range or (args.output_tokens, args.output_tokens)
    return SessionWorkload(SessionSpec(
        args.sessions, args.turns, args.system_prompt, args.turn_tokens, output, args.think,
        args.rate, args.interval or 0.0, args.seed))


def cache_config(args, cfg: SimConfig) -> SimConfig:
    """`cfg` with the caches' budgets (--prefix-cache alone: the pool's pages each)."""
    decoder, producer = args.decoder_cache_pages, args.producer_cache_pages
    for flag, value in (("--decoder-cache-pages", decoder), ("--producer-cache-pages", producer)):
        if value is not None and value < 0:
            raise WorkloadError(f"{flag} must be >= 0 pages, got {value}")
    if not (args.prefix_cache or decoder is not None or producer is not None):
        return cfg
    return attrs.evolve(cfg, decoder_cache_pages=cfg.pool_pages if decoder is None else decoder,
                        producer_cache_pages=cfg.pool_pages if producer is None else producer)
