"""Command-line options shared by the pdsim subcommands, and turning them into a run."""

from __future__ import annotations

import argparse
import heapq
import sys

import attrs

from pdref.cli_format import DefaultsFormatter
from pdref.events import Mode
from pdref.models import context_error, list_models, load_model
from pdsim.arg_types import int_range as _range
from pdsim.core.config import SENDERS, RequestSpec, SimConfig
from pdsim.core.costs import costs_for, engine_of, sim_geometry
from pdsim.core.engines import DEFAULT_ENGINE, list_engines
from pdsim.core.profile_fields import COPIERS
from pdsim.core.profiles import link_of, load_hw
from pdsim.core.sessions import SessionWorkload
from pdsim.core.workload import WorkloadSpec, workload
from pdsim.session_options import (
    add_cache_options,
    add_session_options,
    cache_config,
    session_workload,
)

DEFAULT_PROMPT = 8192


class UsageError(Exception):
    """Bad command-line input: one line naming the field and the rule; exit 2."""


class Parser(argparse.ArgumentParser):
    """argparse that reports bad input as one line on stderr and exits 2; help shows defaults."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", DefaultsFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def _times(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated seconds, got {text!r}") from None


def add_model_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="qwen3-0.6b",
                   help=f"model preset ({', '.join(list_models())}) or a profile .toml")
    p.add_argument("--hw", default="a100-pcie", help="hardware profile name or .toml")
    p.add_argument("--engine", default=None,
                   help=f"engine profile ({', '.join(list_engines())}) or a .toml: what the "
                        f"software reaches on the device (default: a calibrated hw "
                        f"profile's own, else {DEFAULT_ENGINE!r})")
    p.add_argument("--link", default=None, help="link profile (default: the hw profile's)")
    p.add_argument("--page-tokens", type=int, default=16, help="tokens per KV page")
    p.add_argument("--bandwidth-scale", type=float, default=1.0,
                   help="what-if: multiply every copy bandwidth")
    p.add_argument("--compute-scale", type=float, default=1.0,
                   help="what-if: multiply compute speed")
    p.add_argument("--copier", choices=COPIERS, default=None,
                   help="how the copier runs spans: serial = one worker, a span after the one "
                        "before; pipelined = gather, d2h, h2d each on its own lane (default: "
                        "the hw profile's `copier`)")


def add_run_options(p: argparse.ArgumentParser) -> None:
    """contract.md's workload options plus the simulator's own."""
    add_model_options(p)
    p.add_argument("--prompt", type=int, default=None,
                   help=f"prompt tokens per request (default: {DEFAULT_PROMPT})")
    p.add_argument("--prefix", type=int, default=None,
                   help="tokens the decoder already holds, a multiple of --page-tokens "
                        "(default: 0, or the CSV's prefix column)")
    p.add_argument("--chunk", type=int, default=256, help="prefill chunk, tokens")
    p.add_argument("--mode", choices=[m.value for m in Mode], default="chunk",
                   help="handoff: whole = one copy after prefill, chunk = a copy per prefill "
                        "chunk, layer = a copy per layer of the whole suffix")
    p.add_argument("--max-pending", type=int, default=2,
                   help="copy spans in flight (staging buffers) per producer")
    p.add_argument("--seed", type=int, default=0, help="seed of Poisson arrivals and drawn prompts")
    p.add_argument("--no-compute", action="store_true",
                   help="export-only what-if: the copy path alone")
    p.add_argument("--payload", type=int, default=None,
                   help="with --no-compute: payload bytes, rounded up to whole tokens "
                        "(sets the prompt length)")
    p.add_argument("--pool-pages", type=int, default=None,
                   help="decoder pool pages (default: every request at once; 16 of the "
                        "largest for more than 16 requests; with --concurrency C, the C "
                        "largest, as pdgpu serve)")
    p.add_argument("--producers", type=int, default=1, help="prefill devices")
    p.add_argument("--requests", type=int, default=None,
                   help="requests (default: one per CSV row or --arrivals time, else 1)")
    p.add_argument("--rate", type=float, default=None, help="Poisson arrivals, requests/s")
    p.add_argument("--interval", type=float, default=None,
                   help="fixed arrival spacing, s (default: all arrive at t = 0)")
    p.add_argument("--arrivals", type=_times, default=None,
                   help="fixed arrival times, s, comma separated")
    p.add_argument("--prompt-range", type=_range, default=None,
                   help="uniform random prompts in A:B (tokens)")
    p.add_argument("--prompts-csv", default=None,
                   help="CSV with a prompt column; optional arrival and prefix columns")
    p.add_argument("--workload", default=None, metavar="FILE.csv|FILE.jsonl",
                   help="requests read as a stream, one per row in arrival order: arrival "
                        "(s) or TIMESTAMP, prompt or ContextTokens, optional output or "
                        "GeneratedTokens (the Azure LLM inference traces' columns)")
    p.add_argument("--arrival-shape", type=float, default=None,
                   help="with --rate: gamma gaps between arrivals of this shape (1: Poisson; "
                        "below 1: burstier)")
    p.add_argument("--output-tokens", type=int, default=0,
                   help="tokens each request generates (the first is its producer's; then "
                        "one per decode step of the decoder's continuous batch)")
    add_serving_options(p)
    add_session_options(p)
    add_cache_options(p)


def add_serving_options(p: argparse.ArgumentParser) -> None:
    """The serving workload and engine options, as `pdgpu serve` names them."""
    p.add_argument("--prompts", default=None, metavar="FILE.jsonl",
                   help='pdgpu serve\'s prompts: lines {"req", "tokens", "output_tokens"}')
    p.add_argument("--concurrency", type=int, default=None,
                   help="closed loop: C requests in the system at once, the next entering as "
                        "one finishes (instead of arrival times)")
    p.add_argument("--output-range", type=_range, default=None,
                   help="output tokens uniform in A:B per request (instead of --output-tokens)")
    p.add_argument("--sender", choices=SENDERS, default="blocking",
                   help="blocking: compute waits while max_pending spans are in flight (pdgpu "
                        "run); queued: spans wait in the producer's outbox, compute goes on "
                        "(pdgpu serve's sender thread)")
    p.add_argument("--source-pages", type=int, default=None,
                   help="a producer's source cache for prompt suffixes, pages: it starts a "
                        "request once its suffix fits (default: with --sender queued pdgpu "
                        "serve's, 2 of the longest suffixes; else unbounded)")


def _prompt(args, cfg: SimConfig) -> int:
    """The fixed prompt length; two options that both set the prompts are refused."""
    given = [flag for flag, value in (("--prompt", args.prompt), ("--payload", args.payload),
                                      ("--prompt-range", args.prompt_range),
                                      ("--prompts-csv", args.prompts_csv),
                                      ("--prompts", args.prompts),
                                      ("--workload", args.workload)) if value is not None]
    if len(given) > 1:
        raise UsageError(f"prompts: give one of --prompt, --payload, --prompt-range, "
                         f"--prompts-csv, --prompts, --workload, got {' and '.join(given)}")
    if args.payload is not None and not args.no_compute:
        raise UsageError("--payload needs --no-compute (it sizes an export-only run)")
    if args.payload is not None:
        return -(-args.payload // cfg.geometry.bytes_per_token)
    return DEFAULT_PROMPT if args.prompt is None else args.prompt


def _check_positive(args, *names: str) -> None:
    for name in names:
        value = getattr(args, name)
        if value is not None and not value > 0:
            flag = "--" + name.replace("_", "-")
            raise UsageError(f"{flag} must be > 0, got {value}")


def base_config(args) -> SimConfig:
    """The SimConfig the model/hw/link options describe (mode whole, chunk 256 unless set)."""
    _check_positive(args, "page_tokens", "bandwidth_scale", "compute_scale")
    spec = load_model(args.model)
    hw = load_hw(args.hw)
    link = link_of(hw, args.link)
    engine = engine_of(hw, args.engine)
    costs = costs_for(spec, hw, link, engine).scaled(args.bandwidth_scale, args.compute_scale)
    labels = (("model", spec.name), ("hw", hw.name), ("engine", engine.name),
              ("link", link.name))
    if args.copier is not None and args.copier != costs.copier:
        costs = attrs.evolve(costs, copier=args.copier)
        labels += (("copier", args.copier),)
    if args.bandwidth_scale != 1.0:
        labels += (("bandwidth_scale", args.bandwidth_scale),)
    geometry = sim_geometry(spec, args.page_tokens)
    return SimConfig(geometry, costs, getattr(args, "mode", "whole"),
                     getattr(args, "chunk", 256), labels=labels)


class Requests:
    """A workload's requests in arrival order, read (or drawn) each time they are iterated,
    and how many there are."""

    def __init__(self, requests, count: int) -> None:
        self.requests, self.count = requests, count

    def __iter__(self):
        return iter(self.requests)

    def __len__(self) -> int:
        return self.count


def run_setup(args) -> tuple[SimConfig, Requests]:
    """The config and the requests of `pdsim run` (and explain/timeline); the requests are
    read once here, to check each and size the pools, and again by the run."""
    _check_positive(args, "chunk", "max_pending", "producers", "requests", "pool_pages",
                    "payload")
    cfg = base_config(args)
    if args.sessions is not None:  # multi-turn sessions draw their own prompts
        requests = _sessions(args)
        count, largest = _scan(args, cfg, requests.all_turns())
    else:
        prompt = _prompt(args, cfg)
        _check_closed_loop(args)
        spec = WorkloadSpec(args.requests, prompt, args.prefix, args.prompt_range,
                            args.prompts_csv, args.rate, args.interval, args.arrivals,
                            args.seed, args.prompts, args.output_range, args.arrival_shape,
                            args.workload)
        _check_context(args)
        requests = workload(spec, cfg.geometry.page_tokens)
        count, largest = _scan(args, cfg, requests)
    pool = args.pool_pages or _default_pool(largest, count, args.concurrency)
    cfg = attrs.evolve(cfg, max_pending=args.max_pending, pool_pages=pool,
                       producers=args.producers, no_compute=args.no_compute,
                       output_tokens=args.output_tokens, concurrency=args.concurrency,
                       sender=args.sender)
    source = args.source_pages
    if source is None and args.sender == "queued":
        source = 2 * largest[0]  # pdgpu serve's producer cache: two of the longest suffixes
    cfg = cache_config(args, attrs.evolve(cfg, source_pages=source))
    return cfg, requests if args.sessions is not None else Requests(requests, count)


def _sessions(args) -> SessionWorkload:
    """The --sessions workload; an option that would also set prompts or arrivals is
    refused (it would be ignored)."""
    given = [flag for flag, value in (
        ("--prompt", args.prompt), ("--prompt-range", args.prompt_range),
        ("--prefix", args.prefix), ("--prompts", args.prompts),
        ("--prompts-csv", args.prompts_csv), ("--workload", args.workload),
        ("--arrivals", args.arrivals), ("--requests", args.requests),
        ("--concurrency", args.concurrency), ("--payload", args.payload)) if value is not None]
    if given:
        raise UsageError(f"--sessions draws its own prompts and arrivals; give it without "
                         f"{' and '.join(given)}")
    _check_positive(args, "source_pages")
    return session_workload(args)


def _scan(args, cfg: SimConfig, requests) -> tuple[int, list[int]]:
    """One pass over the requests: each checked (context; closed loop: no arrival time);
    (how many, the pages of the longest suffixes, as many as `_default_pool` reads)."""
    keep = max(16, args.concurrency or 0) + 1
    count, largest = 0, []  # a heap of the `keep` largest suffixes' pages
    model = None if args.no_compute else load_model(args.model)
    for request in requests:
        if model is not None:
            _check_request_context(args, model, request)
        if args.concurrency is not None and request.arrival:
            source = "--workload" if args.workload else "the --prompts-csv arrival column"
            raise UsageError(f"--concurrency (closed loop) sets the arrival times; {source} "
                             "gives them too")
        need = cfg.geometry.pages_for(request.prompt - request.prefix)
        (heapq.heappush if len(largest) < keep else heapq.heappushpop)(largest, need)
        count += 1
    return count, sorted(largest, reverse=True)


def _check_context(args) -> None:
    """Prompt + output within the model's max_context: --prompt-range's upper end (with the
    longest output) before any prompt is drawn (then each request: `_scan`). Export only
    (--no-compute) has no positions: no limit."""
    if args.no_compute or not args.prompt_range:
        return
    default_output = args.output_range[1] if args.output_range else args.output_tokens
    problem = context_error(load_model(args.model), args.prompt_range[1], default_output,
                            "--prompt-range")
    if problem:
        raise UsageError(problem)


def _check_request_context(args, model, request: RequestSpec) -> None:
    default_output = args.output_range[1] if args.output_range else args.output_tokens
    source = next((flag for flag, value in (("--prompts-csv", args.prompts_csv),
                                            ("--prompts", args.prompts),
                                            ("--workload", args.workload)) if value), "--prompt")
    output = default_output if request.output_tokens is None else request.output_tokens
    problem = context_error(model, request.prompt, output, f"{source} (request {request.req!r})")
    if problem:
        raise UsageError(problem)


def _check_closed_loop(args) -> None:
    """A closed loop times arrivals itself: any other arrival option is refused."""
    _check_positive(args, "concurrency", "source_pages")
    if args.concurrency is None:
        return
    given = [flag for flag, value in (("--rate", args.rate), ("--interval", args.interval),
                                      ("--arrivals", args.arrivals)) if value is not None]
    if given:
        raise UsageError(f"--concurrency (closed loop) sets the arrival times; give it "
                         f"without {' and '.join(given)}")


def _default_pool(largest: list[int], count: int, concurrency: int | None = None) -> int:
    """Room for every request at once (single runs), 16 of the largest (workloads), or the
    C largest in a closed loop (pdgpu serve's: never fewer slabs than requests in it).
    `largest`: the pages of the longest suffixes, longest first (all of them up to 16)."""
    if concurrency is not None:
        return max(1, sum(largest[:concurrency]))
    return max(1, sum(largest) if count <= 16 else 16 * largest[0])
