"""`pdgpu serve` and `pdgpu generate` on the command line (registered by pdgpu/cli.py).

Exit codes: 0 every request ok or cancelled; 1 a protocol violation, a run error, or a request
that failed every attempt; 2 bad input or an unservable configuration (one line naming the
field and the rule; no process started or left, no file written); 130 Ctrl-C, 143 SIGTERM
(pdgpu/interrupt.py: one line at any stage). The trace and results are opened under their
names once the input is checked, before any process starts, written as the run goes (each
always a consistent prefix: whole lines) and closed on every exit (a run stopped early
aborts its live requests in the trace).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from pdgpu import interrupt
from pdgpu.checkpoint import CheckpointError
from pdgpu.serve.args import add_parsers  # noqa: F401 - pdgpu.cli registers it from here
from pdgpu.serve.config import ServeConfig
from pdgpu.serve.decoder import ServeError
from pdgpu.serve.devices import check_device, serve_devices, use_device
from pdgpu.serve.faults import FaultPolicy, FaultSpec, parse_kill
from pdgpu.serve.launch import (
    ProducerOptions,
    Refused,
    ServeRun,
    connect_producers,
    end_on_error,
    open_decoder_store,
    run_decoder,
    run_producer,
    serve_local,
    start_header,
)
from pdgpu.serve.models import ENGINE_ARCHS, SERVED_ARCHS, load_served_model, model_spec
from pdgpu.serve.report import SUMMARY_ORDER, ResultsLog, summary
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
from pdgpu.streams import compute_threads
from pdgpu.workload import WorkloadError
from pdref.cli_format import format_metrics
from pdref.models import ProfileError, context_error
from pdref.violations import Violation

COMMANDS = ("serve", "generate")
LOCALHOST = "127.0.0.1"


# -- checks before anything starts ------------------------------------------------------------

def _check_out(path: str | None, what: str) -> None:
    if path is not None and not Path(path).resolve().parent.is_dir():
        raise WorkloadError(f"{what}: {Path(path).resolve().parent} is not an existing folder")


def _roles(args) -> tuple[int, Endpoint | None]:
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


def _faults(args, producers: int) -> tuple[FaultSpec, FaultPolicy]:
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


def _config(args, workload: Workload, faults: FaultSpec) -> ServeConfig:
    spec_pages = -(-max(r.prompt for r in workload.requests) // args.page_tokens)
    prefix_pages = workload.prefix // args.page_tokens
    return ServeConfig(
        model=str(Path(args.model).resolve()) if Path(args.model).is_dir() else args.model,
        mode=args.mode, seed=args.seed, dtype=args.dtype, chunk=args.chunk,
        max_pending=args.max_pending, page_tokens=args.page_tokens,
        pool_pages=_pool_pages(args, workload), link_gbps=args.link_gbps, verify=args.verify,
        debug=args.debug, prefix_tokens=workload.prefix_tokens,
        source_pages=prefix_pages + 2 * (spec_pages - prefix_pages), threads=args.threads,
        faults=faults, beat_s=args.heartbeat_timeout / 4)


def _check_eos(eos: int | None, vocab: int) -> None:
    if eos is not None and eos >= vocab:
        raise WorkloadError(f"eos-token must be in [0, vocab={vocab}), got {eos}")


def prepare(args) -> tuple[ServeConfig, FaultPolicy, Workload, int, Endpoint | None]:
    """Every check that needs no process: (config, policy, workload, producers, endpoint)."""
    producers, endpoint = _roles(args)
    try:
        faults, policy = _faults(args, producers)
    except ValueError as e:
        raise WorkloadError(str(e)) from None
    # written fully from here on (cuda -> cuda:0); the decoder's is --device with --role
    args.device, args.decoder_device = serve_devices(args.device, args.decoder_device, args.role)
    _check_out(args.trace, "trace")
    _check_out(args.results, "results")
    spec = model_spec(args.model, args.dtype)
    if spec.arch in ENGINE_ARCHS and spec.arch not in SERVED_ARCHS:  # (others: handshake)
        raise WorkloadError(f"model: arch {spec.arch!r} is not served yet "
                            f"({', '.join(SERVED_ARCHS)}): see docs/hybrid-models.md")
    _check_eos(args.eos_token, spec.vocab)
    workload = _workload(args, spec)
    return _config(args, workload, faults), policy, workload, producers, endpoint


# -- running ----------------------------------------------------------------------------------

def _serve(args, config, policy, workload, producers, endpoint, run: ServeRun) -> None:
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


def serve_with_outputs(args, run: ServeRun, serve) -> None:
    """`serve()`, then the outputs closed, however it ended; a run refused before it
    served (bad input, exit 2) leaves neither file."""
    try:
        serve()
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


def _producer_role(args, endpoint: Endpoint) -> None:
    """This process is one producer rank; it ends here (os._exit: its receiving thread may
    still block in gloo, and an interpreter exit would abort on it)."""
    opts = ProducerOptions(args.kv_progress, args.device, args.connect_timeout, args.kv_lane)
    code = 1
    try:
        code = run_producer(endpoint, args.rank, 0, opts)
    except KeyboardInterrupt as e:
        code = interrupt.report(e, "this producer stopped")
    except (TransportError, ServeError) as e:
        print(f"pdgpu: serve error: {e}", file=sys.stderr)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _summary_text(values: dict) -> str:
    keys = SUMMARY_ORDER + tuple(k for k in values if k not in SUMMARY_ORDER)
    rate = values["tokens_per_s"]  # ends in _s but is a rate, not seconds
    shown = {**values, "tokens_per_s": None if rate is None else f"{rate:.1f} tokens/s"}
    return format_metrics(shown, keys, width=18)


def cmd_serve(args) -> int:
    if args.http is not None:  # requests over HTTP (its packages are an optional extra)
        from pdgpu.serve.http_run import serve_http
        return serve_http(args)
    config, policy, workload, producers, endpoint = prepare(args)
    if args.role == "producer":
        _producer_role(args, endpoint)
    run = open_outputs(args, config, producers, ServeRun())
    try:
        serve_with_outputs(args, run, lambda: _serve(args, config, policy, workload,
                                                     producers, endpoint, run))
        values = summary(run.decoder, run.ledger, run.wall_s)
    finally:
        run.log.discard()  # without --trace: the temporary file the metrics were read from
    print(json.dumps(values) if args.json else _summary_text(values))
    bad = values["failed"]
    if bad:
        print(f"pdgpu: {bad} of {values['requests']} requests failed every attempt",
              file=sys.stderr)
    return 1 if bad else 0


def cmd_generate(args) -> int:
    try:
        tokens = [int(t) for t in args.tokens.replace(",", " ").split()]
    except ValueError:
        raise WorkloadError("tokens: must be integers separated by commas or spaces") from None
    spec = model_spec(args.model, args.dtype)
    if not tokens:
        raise WorkloadError("tokens: at least one token id is needed")
    problem = context_error(spec, len(tokens), args.output_tokens, "tokens")
    if problem:
        raise WorkloadError(problem)
    bad = [t for t in tokens if not 0 <= t < spec.vocab]
    if bad:
        raise WorkloadError(f"tokens: {bad[0]} is outside [0, vocab={spec.vocab})")
    if args.prefix > len(tokens) or args.prefix % args.page_tokens:
        raise WorkloadError(f"prefix must be a multiple of page-tokens={args.page_tokens} and "
                            f"<= the prompt ({len(tokens)}), got {args.prefix}")
    if spec.arch not in ENGINE_ARCHS:
        raise WorkloadError(f"model: arch {spec.arch!r} has no engine implementation")
    _check_eos(args.eos_token, spec.vocab)
    sampling = _sampling(args)
    device = check_device(args.device)
    from pdgpu.generate import generate
    use_device(device)
    with compute_threads("cpu", args.threads):  # as before once it returns (main() in-process)
        model = load_served_model(args.model, args.seed, args.dtype, device)
        start = time.perf_counter()
        output = generate(model, tokens, args.output_tokens, args.chunk, args.prefix,
                          args.page_tokens, args.eos_token, sampling)
        wall = time.perf_counter() - start
    if args.json:
        print(json.dumps({"output": output, "prompt": len(tokens), "model": spec.name,
                          "wall_s": wall}))
    else:
        print("output: " + " ".join(map(str, output)))
    return 0


def _sampling(args):
    """`pdgpu generate`'s sampling options (each checked by argparse already)."""
    from pdgpu.sampling import SamplingError, checked
    given = {name[len("sample_"):]: value for name, value in vars(args).items()
             if name.startswith("sample_") and value is not None}
    try:
        return checked(args.output_tokens, "output-tokens", ignore_eos=args.ignore_eos, **given)
    except SamplingError as e:
        raise WorkloadError(f"{e.field.replace('_', '-')}: {e.message}") from None


def run_command(args) -> int:
    """Dispatch from pdgpu.cli.main; one line and an exit code for each kind of failure."""
    try:
        return interrupt.unmasked(cmd_serve if args.command == "serve" else cmd_generate, args)
    except (WorkloadError, Refused) as e:
        print(f"pdgpu: error: {e}", file=sys.stderr)
        return 2
    except Violation as e:
        print(f"pdgpu: violation: {e.code} {e.message}", file=sys.stderr)
        return 1
    except (ServeError, TransportError) as e:
        print(f"pdgpu: serve error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:  # SIGTERM too (interrupt.Terminated): exit 143
        return interrupt.report(e, "every process stopped")
    except (OSError, ProfileError, CheckpointError):
        raise  # pdgpu.cli prints these: one line, exit 2
    except Exception as e:  # noqa: BLE001 - any other error: one line naming it, exit 1
        print(f"pdgpu: serve error: {type(e).__name__}: {str(e).strip()[:300]}",
              file=sys.stderr)
        return 1
