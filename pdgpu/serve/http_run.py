"""`pdgpu serve --http HOST:PORT`: the decoder and its producers as in a batch run, with the
requests coming from an OpenAI-compatible HTTP front end instead of a workload known up front.

The decoder loop stays in the main thread (its Ctrl-C path, the producers' shutdown and the
trace's close are the batch mode's own, unchanged), uvicorn serves in a second thread of the
same process (the bridge, frontend.py, is the only state both threads touch). The listening
socket is bound here before any producer starts, so a port in use is one line, exit 2.
SIGINT or SIGTERM drains: no new requests (503), requests in flight finish (those still
running `--http-drain` seconds later are cancelled), then the producers stop and the trace
closes as after a batch run, exit 130 (SIGINT) or 143 (SIGTERM); a second signal stops at once
(the same codes, live requests aborted).
"""

from __future__ import annotations

import json
import signal
import socket
import sys
import threading
from contextlib import contextmanager

from pdgpu import interrupt
from pdgpu.serve import command
from pdgpu.serve.devices import serve_devices
from pdgpu.serve.launch import ServeRun
from pdgpu.serve.models import model_spec
from pdgpu.serve.workload import ServeRequest, Workload
from pdgpu.workload import WorkloadError

HTTP_PACKAGES = ("fastapi", "uvicorn", "prometheus_client", "tokenizers")
SIZING_SLABS = 8  # the default pool holds this many slabs of the longest prompt
SWITCH_S = 0.001  # the GIL's switch interval in a serving process (Python's default: 5 ms)


def check_packages() -> None:
    """One line naming what to install when the `http` extra is missing."""
    import importlib.util
    missing = [p for p in HTTP_PACKAGES if importlib.util.find_spec(p) is None]
    if missing:
        raise WorkloadError(f"http: needs {', '.join(missing)}: pip install "
                            "'pdhandoff[http]' (fastapi uvicorn prometheus-client tokenizers)")


def parse_address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or int(port) > 65535:
        raise WorkloadError(f"http: must be HOST:PORT (port 0: a free one), got {text!r}")
    return host.strip("[]"), int(port)


def _refuse_batch_options(args) -> None:
    given = [name for name, on in (("prompts", args.prompts is not None),
                                   ("rate", args.rate is not None),
                                   ("concurrency", args.concurrency is not None),
                                   ("prefix", args.prefix > 0),
                                   ("cancel-rate", args.cancel_rate > 0),
                                   ("role producer", args.role == "producer")) if on]
    if given:
        raise WorkloadError(f"http: --{given[0]} is a batch-mode option (requests come "
                            "over HTTP; clients cancel by hanging up)")


def prepare_http(args):
    """The batch mode's checks, with the pool and caches sized for `--http-max-prompt`."""
    _refuse_batch_options(args)
    producers, endpoint = command.roles(args)
    try:
        faults, policy = command.fault_options(args, producers)
    except ValueError as e:
        raise WorkloadError(str(e)) from None
    args.device, args.decoder_device = serve_devices(args.device, args.decoder_device,
                                                           args.role)
    command.check_out(args.trace, "trace")
    command.check_out(args.results, "results")
    spec = model_spec(args.model, args.dtype)
    command.check_eos(args.eos_token, spec.vocab)
    longest = tuple(ServeRequest(f"size{i}", [0] * args.http_max_prompt)
                    for i in range(SIZING_SLABS))
    config = command.serve_config(args, Workload(longest, (), None, SIZING_SLABS), faults)
    return config, policy, Workload((), (), None, 1), producers, endpoint, spec


def listen(host: str, port: int) -> socket.socket:
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(512)
    except OSError as e:
        raise WorkloadError(f"http: cannot listen on {host}:{port} ({e.strerror or e})") \
            from None
    return sock


class ServerThread:
    """uvicorn on an already bound socket, in a daemon thread (no signal handlers there)."""

    def __init__(self, app, sock: socket.socket) -> None:
        import uvicorn
        config = uvicorn.Config(app, log_level="warning", lifespan="off",
                                timeout_graceful_shutdown=5)
        self.server, self.sock = uvicorn.Server(config), sock
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]},
                                       name="pdgpu-http", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()


@contextmanager
def drain_on_signals(frontend):
    """First SIGINT/SIGTERM: drain; the second: KeyboardInterrupt or Terminated (stop now).
    Yields the list the first signal's number is put in (the exit code: 130 or 143)."""
    signalled: list[int] = []

    def handler(signum, frame):
        if signalled:
            raise interrupt.error_for(signum)
        signalled.append(signum)
        print(f"pdgpu: {signal.Signals(signum).name}: draining (no new requests; again to "
              "stop now)", file=sys.stderr, flush=True)
        frontend.close()
    old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield signalled
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _service(args, spec, frontend):
    from pdgpu.serve.http import Service
    from pdgpu.serve.openai_api import Limits
    from pdgpu.serve.texts import Texts
    limits = Limits(spec.name, spec.vocab, args.http_max_prompt, spec)
    return Service(frontend, Texts.for_model(args.model), limits, frontend.metrics)


def serve_http(args) -> int:
    """The whole `--http` run; the exit code (as cmd_serve's)."""
    from pdgpu.serve.frontend import Frontend
    from pdgpu.serve.http import build_app
    from pdgpu.serve.metrics import ServeMetrics
    check_packages()
    host, port = parse_address(args.http)
    config, policy, workload, producers, endpoint, spec = prepare_http(args)
    frontend = Frontend(args.http_queue, args.http_drain,
                        ServeMetrics(prefix_cache=config.prefix_cache_pages > 0))
    service = _service(args, spec, frontend)
    sock = listen(host, port)
    server = ServerThread(build_app(service), sock)
    server.start()
    bound = sock.getsockname()[1]
    print(f"pdgpu: OpenAI-compatible API on http://{host}:{bound}/v1 (model "
          f"{spec.name!r}); Ctrl-C or SIGTERM drains", file=sys.stderr, flush=True)
    args.progress = False  # requests are not known up front: no bar
    # Two threads take turns on the GIL: at the default 5 ms a token event could wait that
    # long for the decoder thread's Python to let go of it.
    sys.setswitchinterval(SWITCH_S)
    run = command.open_outputs(args, config, producers, ServeRun(frontend=frontend))
    signalled: list[int] = []

    def serve() -> None:
        nonlocal signalled
        try:
            with drain_on_signals(frontend) as signalled:
                command.serve(args, config, policy, workload, producers, endpoint, run)
        except BaseException as e:
            if type(e).__name__ == "Violation":
                frontend.metrics.violations.inc()
            raise
        finally:
            frontend.abandon("the server stopped")
            server.stop()
    try:
        command.serve_with_outputs(args, run, serve)
        return _report(args, run, signalled)
    finally:
        run.log.discard()


def _report(args, run: ServeRun, signalled: list[int]) -> int:
    """The summary; the exit code: 130/143 after a drain a signal began (the README's
    promise for every run a signal stops), else 1 if a request failed, else 0."""
    from pdgpu.serve.report import summary
    values = summary(run.decoder, run.ledger, run.wall_s)
    print(json.dumps(values) if args.json else command.summary_text(values))
    if signalled:
        stop = interrupt.error_for(signalled[0])
        print(f"pdgpu: {interrupt.describe(stop)}: drained, every process stopped",
              file=sys.stderr)
        return interrupt.exit_code(stop)
    return 1 if values["failed"] else 0
