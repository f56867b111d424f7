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

from pdgpu import interrupt
from pdgpu.checkpoint import CheckpointError
from pdgpu.decode_graph import decode_forward, graph_problem
from pdgpu.serve.args import add_parsers  # noqa: F401 - pdgpu.cli registers it from here
from pdgpu.serve.command import (
    check_eos,
    open_outputs,
    prepare,
    serve,
    serve_with_outputs,
    summary_text,
)
from pdgpu.serve.decoder import ServeError
from pdgpu.serve.devices import check_device, use_device
from pdgpu.serve.launch import ProducerOptions, Refused, ServeRun, run_producer
from pdgpu.serve.models import ENGINE_ARCHS, load_served_model, model_spec
from pdgpu.serve.report import summary
from pdgpu.serve.transport import Endpoint, TransportError
from pdgpu.streams import compute_threads
from pdgpu.workload import WorkloadError
from pdref.models import ProfileError, context_error
from pdref.violations import Violation

COMMANDS = ("serve", "generate")


# -- the commands ----------------------------------------------------------------------------

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


def cmd_serve(args) -> int:
    if args.http is not None:  # requests over HTTP (its packages are an optional extra)
        from pdgpu.serve.http_run import serve_http
        return serve_http(args)
    config, policy, workload, producers, endpoint = prepare(args)
    if args.role == "producer":
        _producer_role(args, endpoint)
    run = open_outputs(args, config, producers, ServeRun())
    try:
        serve_with_outputs(args, run, lambda: serve(args, config, policy, workload,
                                                     producers, endpoint, run))
        values = summary(run.decoder, run.ledger, run.wall_s)
    finally:
        run.log.discard()  # without --trace: the temporary file the metrics were read from
    print(json.dumps(values) if args.json else summary_text(values))
    bad = values["failed"]
    if bad:
        print(f"pdgpu: {bad} of {values['requests']} requests failed every attempt",
              file=sys.stderr)
    return 1 if bad else 0


def cmd_generate(args) -> int:
    if args.prompts is not None:
        return _generate_prompts(args)
    if args.prefix_cache or args.prefix_cache_pages is not None:
        raise WorkloadError("prefix-cache: needs --prompts (one prompt shares nothing)")
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
    check_eos(args.eos_token, spec.vocab)
    sampling = _sampling(args)
    device = check_device(args.device)
    problem = graph_problem(args.cuda_graphs, device)
    if problem is not None:
        raise WorkloadError(problem)
    from pdgpu.generate import generate
    use_device(device)
    with compute_threads("cpu", args.threads):  # as before once it returns (main() in-process)
        model = load_served_model(args.model, args.seed, args.dtype, device)
        start = time.perf_counter()
        output = generate(model, tokens, args.output_tokens, args.chunk, args.prefix,
                          args.page_tokens, args.eos_token, sampling,
                          decode_forward(args.cuda_graphs, device))
        wall = time.perf_counter() - start
    if args.json:
        print(json.dumps({"output": output, "prompt": len(tokens), "model": spec.name,
                          "wall_s": wall}))
    else:
        print("output: " + " ".join(map(str, output)))
    return 0


def _generate_prompts(args) -> int:
    """`pdgpu generate --prompts` (generate_many.py)."""
    from pdgpu.serve import generate_many
    spec = model_spec(args.model, args.dtype)
    requests = generate_many.checked_prompts(args, spec)
    budget = generate_many.cache_budget(args, requests)
    if spec.arch not in ENGINE_ARCHS:
        raise WorkloadError(f"model: arch {spec.arch!r} has no engine implementation")
    check_eos(args.eos_token, spec.vocab)
    sampling, device = _sampling(args), check_device(args.device)
    problem = graph_problem(args.cuda_graphs, device)
    if problem is not None:
        raise WorkloadError(problem)
    use_device(device)
    with compute_threads("cpu", args.threads):
        model = load_served_model(args.model, args.seed, args.dtype, device)
        values = generate_many.generate_all(model, requests, args, budget, sampling,
                                            decode_forward(args.cuda_graphs, device))
    generate_many.print_all({**values, "model": spec.name}, args.json)
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
