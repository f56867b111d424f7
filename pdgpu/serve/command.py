"""The parts of one `pdgpu serve` command that the batch run (serve_cli.py) and the `--http`
run (http_run.py) share: every check made before a process starts, the run itself, and its
outputs (the trace and `--results`) opened before it and closed after it, however it ends.
Both callers import this module; it imports neither of them."""

from __future__ import annotations

import sys
from pathlib import Path

from pdgpu.decode_graph import graph_problem
from pdgpu.handoff import handoff_geometry
from pdgpu.serve.config import ServeConfig
from pdgpu.serve.devices import serve_devices, use_device
from pdgpu.serve.faults import FaultPolicy, FaultSpec, parse_kill
from pdgpu.serve.launch import (
    ProducerOptions,
    Refused,
    ServeRun,
    connect_producers,
    end_on_error,
    open_decoder_store,
    run_decoder,
    serve_local,
    start_header,
)
from pdgpu.serve.models import model_spec
from pdgpu.serve.report import SUMMARY_ORDER, ResultsLog
from pdgpu.serve.status import progress
from pdgpu.serve.tracelog import TraceLog
from pdgpu.serve.transport import Endpoint, TransportError, parse_init_method
from pdgpu.serve.transport_nccl import open_transport
from pdgpu.serve.workload import (
    Workload,
    check_context,
    check_vocab,
    draw_requests,
    parse_range,
    poisson_arrivals,
    read_prompts,
    shared_prefix,
)
from pdgpu.workload import WorkloadError
from pdref.cli_format import format_metrics
from pdref.kinds import LINEAR

LOCALHOST = "127.0.0.1"


# -- checks before anything starts ------------------------------------------------------------

def check_out(path: str | None, what: str) -> None:
    if path is not None and not Path(path).resolve().parent.is_dir():
        raise WorkloadError(f"{what}: {Path(path).resolve().parent} is not an existing folder")


def roles(args) -> tuple[int, Endpoint | None]:
    """(producers, rendezvous endpoint or None for a free local port)."""
    endpoint = None
    if args.init_method is not None:
        try:
            endpoint = parse_init_method(args.init_method)
        except ValueError as e:
            raise WorkloadError(str(e)) from None
    if args.role is None:
        if args.rank is not None or args.world_size is not None:
            raise WorkloadError("rank/world-size: only with --role decoder|producer")
        return args.producers, endpoint
    if endpoint is None or args.rank is None or args.world_size is None:
        raise WorkloadError(f"role {args.role}: needs --init-method, --rank and --world-size")
    if args.role == "decoder" and args.rank != 0:
        raise WorkloadError(f"rank: the decoder is rank 0, got {args.rank}")
    if args.role == "producer" and not 1 <= args.rank < args.world_size:
        raise WorkloadError(f"rank: a producer's rank must be in [1, world-size="
                            f"{args.world_size}), got {args.rank}")
    return args.world_size - 1, endpoint


def _workload(args, spec) -> Workload:
    vocab = spec.vocab
    if args.prompts is not None:
        requests = read_prompts(args.prompts, args.output_tokens)
        prefix = shared_prefix(requests, args.prefix)
    else:
        drawn = parse_range(args.prompt_range)
        check_context(spec, drawn, args.output_tokens)
        requests, prefix = draw_requests(args.requests, drawn, args.prefix,
                                         args.output_tokens, vocab, args.seed)
    check_context(spec, None, args.output_tokens, requests)
    check_vocab(requests, vocab)
    if args.prefix % args.page_tokens:
        raise WorkloadError(f"prefix must be a multiple of page-tokens={args.page_tokens}, "
                            f"got {args.prefix}")
    arrivals = None if args.rate is None else poisson_arrivals(len(requests), args.rate,
                                                               args.seed)
    concurrency = args.concurrency or len(requests)
    return Workload(tuple(requests), prefix, arrivals, concurrency)


def _pool_pages(args, workload: Workload) -> int:
    """The pool asked for, or the slabs of the largest requests that may be in at once."""
    pt = args.page_tokens
    suffixes = sorted((-(-(r.prompt - workload.prefix) // pt) for r in workload.requests),
                      reverse=True)
    at_once = workload.concurrency if workload.arrivals is None else min(8, len(suffixes))
    pages = args.pool_pages or max(1, sum(suffixes[:at_once]))
    if pages < suffixes[0]:
        raise WorkloadError(f"pool-pages: {pages} pages cannot hold the longest prompt's "
                            f"suffix (needs {suffixes[0]} pages of {pt} tokens)")
    return pages


def fault_options(args, producers: int) -> tuple[FaultSpec, FaultPolicy]:
    """The fault options, checked: ValueError -> one line, exit 2 (nothing started)."""
    if args.span_timeout is not None and not (0 < args.span_timeout < float("inf")):
        raise ValueError(f"span-timeout: must be a finite number of seconds > 0, got "
                         f"{args.span_timeout}")
    if not 0 < args.heartbeat_timeout < float("inf"):
        raise ValueError(f"heartbeat-timeout: must be a finite number of seconds > 0, got "
                         f"{args.heartbeat_timeout}")
    spec = FaultSpec(args.fail_rate, args.stall_rate, args.corrupt_rate, args.cancel_rate,
                     args.seed)
    kills = tuple(parse_kill(text) for text in args.kill_producer)
    if (kills or args.restart_producers) and args.role is not None:
        raise ValueError("kill-producer/restart-producers: only for producers this command "
                         "starts (not with --role)")
    attempts = args.max_attempts or (3 if args.retries is None else args.retries + 1)
    policy = FaultPolicy(args.span_timeout, args.heartbeat_timeout, attempts,
                         args.restart_producers, kills)
    policy.check(producers, spec, args.verify)
    return spec, policy


def serve_config(args, workload: Workload, faults: FaultSpec) -> ServeConfig:
    """The run's config (after `serve_devices`: the decoder's device is known)."""
    problem = None if args.role == "producer" else graph_problem(args.cuda_graphs,
                                                                   args.decoder_device)
    if problem is not None:
        raise WorkloadError(problem)
    spec_pages = -(-max(r.prompt for r in workload.requests) // args.page_tokens)
    prefix_pages = workload.prefix // args.page_tokens
    cache_pages = prefix_cache_pages(args, spec_pages)
    pool_pages = _pool_pages(args, workload)
    return ServeConfig(
        model=str(Path(args.model).resolve()) if Path(args.model).is_dir() else args.model,
        mode=args.mode, seed=args.seed, dtype=args.dtype, chunk=args.chunk,
        max_pending=args.max_pending, page_tokens=args.page_tokens,
        pool_pages=pool_pages, link_gbps=args.link_gbps, verify=args.verify,
        debug=args.debug, prefix_tokens=workload.prefix_tokens,
        source_pages=prefix_pages + 2 * (spec_pages - prefix_pages) + cache_pages,
        threads=args.threads, faults=faults, beat_s=args.heartbeat_timeout / 4,
        cuda_graphs=args.cuda_graphs, prefix_cache_pages=cache_pages,
        decoder_cache_pages=(args.decoder_cache_pages or pool_pages) if cache_pages else 0,
        prefix_cache_off=cache_off(args, cache_pages))


def prefix_cache_pages(args, spec_pages: int) -> int:
    """Each producer's prefix-cache budget (0: off), checked: a WorkloadError names what
    makes no sense with it. The cache is on by default where it applies; where it cannot
    (`cache_misfit`), the default is off and an explicit `--prefix-cache` is refused."""
    asked = args.prefix_cache or any(getattr(args, flag, None) is not None for flag in BUDGETS)
    if args.prefix_cache is False:
        for flag in BUDGETS:
            if getattr(args, flag, None) is not None:  # (generate has no decoder)
                raise WorkloadError(f"{flag.replace('_', '-')}: needs the prefix cache "
                                    "(not with --no-prefix-cache)")
        return 0
    misfit = cache_misfit(args)
    if misfit is not None and asked:
        raise WorkloadError(f"prefix-cache: refused {misfit}")
    if misfit is not None:
        if args.prefix:  # the default gives way to the fixed prefix asked for, said so
            print(f"pdgpu: note: prefix cache off with --prefix {args.prefix} (its fixed "
                  "prefix is warmed instead; --no-prefix-cache silences this)", file=sys.stderr)
        return 0
    return args.prefix_cache_pages or 4 * spec_pages


BUDGETS = ("prefix_cache_pages", "decoder_cache_pages")


def cache_misfit(args) -> str | None:
    """Why the prefix cache cannot serve this run (completing "refused ..."), or None."""
    if args.prefix:
        return "with --prefix (the cache finds shared prefixes itself)"
    kinds = handoff_geometry(model_spec(args.model, args.dtype), 1).kinds or ()
    if any(k.kind == LINEAR for k in kinds) and getattr(args, "mode", "chunk") == "layer":
        return ("in layer mode for a model with linear layers (their state is kept between "
                "chunks, not layers)")
    return None


def cache_off(args, cache_pages: int) -> str | None:
    """Why this run's prefix cache is off (None: on), for the summary and trace header."""
    if cache_pages:
        return None
    if args.prefix_cache is False:
        return "--no-prefix-cache"
    return f"not available {cache_misfit(args)}"


def check_eos(eos: int | None, vocab: int) -> None:
    if eos is not None and eos >= vocab:
        raise WorkloadError(f"eos-token must be in [0, vocab={vocab}), got {eos}")


def prepare(args) -> tuple[ServeConfig, FaultPolicy, Workload, int, Endpoint | None]:
    """Every check that needs no process: (config, policy, workload, producers, endpoint)."""
    producers, endpoint = roles(args)
    try:
        faults, policy = fault_options(args, producers)
    except ValueError as e:
        raise WorkloadError(str(e)) from None
    # written fully from here on (cuda -> cuda:0); the decoder's is --device with --role
    args.device, args.decoder_device = serve_devices(args.device, args.decoder_device, args.role)
    check_out(args.trace, "trace")
    check_out(args.results, "results")
    spec = model_spec(args.model, args.dtype)
    check_eos(args.eos_token, spec.vocab)
    workload = _workload(args, spec)
    return serve_config(args, workload, faults), policy, workload, producers, endpoint


# -- running ----------------------------------------------------------------------------------

def serve(args, config, policy, workload, producers, endpoint, run: ServeRun) -> None:
    opts = ProducerOptions(args.kv_progress, args.device, args.connect_timeout, args.kv_lane)
    bar = progress(args.progress, args.progress_every, len(workload.requests), run)
    try:
        if args.role == "decoder":
            _serve_decoder_role(config, policy, workload, producers, endpoint, opts, bar, run,
                                args.eos_token, args.trace)
            return
        endpoint = endpoint or Endpoint(LOCALHOST, 0)
        serve_local(config, workload, producers, opts, endpoint, policy, bar, run=run,
                    eos=args.eos_token, trace=args.trace, decoder_device=args.decoder_device)
    finally:
        bar.close()


def _serve_decoder_role(config, policy, workload, producers, endpoint, opts, bar, run,
                        eos, trace) -> None:
    use_device(opts.device)  # with --role decoder, --device is this process's
    store = open_decoder_store(endpoint, producers + 1, opts.connect_timeout_s)
    transport = open_transport(store, 0, opts.device, opts.connect_timeout_s, opts.kv_lane)
    try:
        connect_producers(transport, producers)
        run_decoder(transport, config, workload, policy, opts.connect_timeout_s, progress=bar,
                    run=run, eos=eos, trace=trace, device=opts.device)
    except BaseException as e:
        for rank in transport.peers():
            try:
                transport.send(rank, "shutdown", {})
            except TransportError:
                pass
        end_on_error(run, e)
    finally:
        transport.close()


def open_outputs(args, config: ServeConfig, producers: int, run: ServeRun) -> ServeRun:
    """The trace and `--results`, open under their names before any process starts (a
    stop at any moment leaves at least the header): both are written as the run goes."""
    run.log = TraceLog(start_header(config, producers, args.kv_lane), args.trace)
    if args.results:
        run.results = ResultsLog(args.results)
    return run


def serve_with_outputs(args, run: ServeRun, body) -> None:
    """`body()`, then the outputs closed, however it ended; a run refused before it
    served (bad input, exit 2) leaves neither file."""
    try:
        body()
    except (WorkloadError, Refused):
        run.log.remove()
        if run.results is not None:
            run.results.remove()
        raise
    finally:
        _write_outputs(run)


def _write_outputs(run: ServeRun) -> None:
    """Close what was written while the run went (after an error too: its live requests
    were aborted in it)."""
    run.log.close()
    if run.results is not None:
        run.results.close(run.decoder)


def summary_text(values: dict) -> str:
    keys = SUMMARY_ORDER + tuple(k for k in values if k not in SUMMARY_ORDER)
    rate = values["tokens_per_s"]  # ends in _s but is a rate, not seconds
    shown = {**values, "tokens_per_s": None if rate is None else f"{rate:.1f} tokens/s"}
    return format_metrics(shown, keys, width=18)
