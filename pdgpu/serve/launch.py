"""Starting, connecting and stopping the serving processes.

Local run: this process is the decoder (rank 0, it serves the rendezvous store on a free port
unless `--init-method` names one) and starts `producers` processes with torch.multiprocessing;
it can kill one (`--kill-producer`) and respawn it (`--restart-producers`: the new process
joins the next generation of its link, transport.py).
Separate machines: each role runs `pdgpu serve --role ... --rank R --world-size W
--init-method tcp://HOST:PORT` itself. Handshake, before any slab or request: the decoder
sends the run's ServeConfig; each producer answers with its Capabilities; a run that cannot be
served is refused (every producer told, one line, exit 2: mixed CPU and CUDA devices too);
then models are built, the prefix caches warmed, clocks related, and t = 0 starts. Each
process's device is its own (`decoder_device` here, `ProducerOptions.device` there); the
transport follows it (transport_nccl.py: gloo on CPU, NCCL between CUDA devices).
A producer's death is a fault the decoder serves through (members.py, recovery.py).
Any other error or Ctrl-C: producers are stopped (terminated after a grace period when local),
every live request is aborted in the trace, and the error goes up as one line.
"""

from __future__ import annotations

import os
import signal
import time
from contextlib import suppress

import attrs
import torch
import torch.multiprocessing as mp

from pdgpu import audit, interrupt
from pdgpu.decode_graph import decode_forward, uses_graphs
from pdgpu.handoff import handoff_geometry
from pdgpu.prefill import prefix_kv
from pdgpu.serve import clock
from pdgpu.serve.config import Capabilities, ServeConfig, refusal
from pdgpu.serve.decoder import Decoder, ServeError
from pdgpu.serve.decoder_prefix import DecoderPrefix
from pdgpu.serve.devices import use_device
from pdgpu.serve.faults import FaultPolicy
from pdgpu.serve.ledger import Ledger
from pdgpu.serve.members import Members
from pdgpu.serve.models import ENGINE_ARCHS, load_served_model, model_spec
from pdgpu.serve.producer_rank import (  # noqa: F401 - run_producer: imported from here
    ProducerOptions,
    producer_process,
    run_producer,
)
from pdgpu.serve.tracelog import TraceLog
from pdgpu.serve.transport import Endpoint, open_store
from pdgpu.serve.transport_nccl import open_transport
from pdgpu.serve.workload import Workload
from pdgpu.streams import compute_threads
from pdgpu.workload import WorkloadError
from pdref import events as ev

START_METHOD = "forkserver"


class Refused(Exception):
    """The handshake found the configuration unservable (exit 2)."""


@attrs.define
class ServeRun:
    """What the decoder knows at the end of a run, finished or not."""

    ledger: Ledger | None = None
    decoder: Decoder | None = None
    log: TraceLog | None = None  # the trace, open from the start when the caller opened it
    results: object = None  # `--results` (report.ResultsLog), written as requests end
    wall_s: float = 0.0
    error: BaseException | None = None
    frontend: object = None  # `--http`: the bridge requests come through (frontend.py)


# -- decoder side -----------------------------------------------------------------------------

def _start_forkserver() -> None:
    """Start the forkserver (and multiprocessing's resource tracker) with SIGINT blocked, a
    mask they and the producers keep: a terminal's Ctrl-C reaches the whole process group,
    and in them, while they import, it printed tracebacks. Ctrl-C is the decoder's job (it
    stops them); one that arrives meanwhile is delivered here when the mask is lifted."""
    from multiprocessing import forkserver, resource_tracker

    resource_tracker.ensure_running()  # first: it blocks SIGINT itself, then unblocks it
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        forkserver.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


class LocalProducers:
    """Producer processes started from here, by rank; `check` raises when one died (during
    the first handshake), `exited` reports deaths while serving."""

    def __init__(self, producers: int, endpoint: Endpoint, opts: ProducerOptions) -> None:
        self.ctx = mp.get_context(START_METHOD)
        if START_METHOD == "forkserver":  # one torch import for every producer, not one each
            self.ctx.set_forkserver_preload(["pdgpu.serve.preload"])
            _start_forkserver()
        self.endpoint, self.opts = endpoint, opts
        self.procs = {rank: self._start(rank, 0) for rank in range(1, producers + 1)}

    def _start(self, rank: int, generation: int):
        p = self.ctx.Process(target=producer_process, daemon=True, name=f"pdgpu-p{rank}",
                             args=(rank, generation, self.endpoint.host, self.endpoint.port,
                                   self.opts))
        with interrupt.held():  # an interrupt inside start would lose the process's pid
            p.start()
        return p

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs.values()]

    def check(self) -> None:
        for rank, code in self.exited().items():
            raise ServeError(f"producer p{rank} exited with code {code}")

    def exited(self) -> dict[int, int]:
        return {rank: p.exitcode for rank, p in self.procs.items() if p.exitcode is not None}

    def kill(self, rank: int) -> None:
        """SIGKILL (a crash: nothing runs in it after this)."""
        with suppress(ProcessLookupError):
            os.kill(self.procs[rank].pid, signal.SIGKILL)

    def respawn(self, rank: int, generation: int) -> None:
        """Reap the dead process and start its replacement."""
        self.kill(rank)
        self.procs[rank].join(timeout=5)
        self.procs[rank] = self._start(rank, generation)

    def stop(self, grace_s: float) -> None:
        procs = list(self.procs.values())
        deadline = time.monotonic() + grace_s
        for p in procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(timeout=3)
            if p.is_alive():
                p.kill()
                p.join(timeout=3)


def open_decoder_store(endpoint: Endpoint, world: int, timeout_s: float):
    """The rendezvous store this decoder serves; a port that cannot be bound is bad input."""
    try:
        return open_store(endpoint, 0, world, timeout_s)
    except Exception as e:  # noqa: BLE001 - torch raises DistNetworkError and others
        raise WorkloadError(f"init-method: cannot serve the rendezvous on {endpoint.host}:"
                            f"{endpoint.port} (port in use or address not local): "
                            f"{str(e).strip().splitlines()[0][:120]}") from None


def start_header(config: ServeConfig, producers: int, kv_lane: str) -> ev.Header:
    """The trace's header before the processes start: the lane asked for stands in for the
    lanes the producers will agree (set_header replaces it before the first event)."""
    spec = model_spec(config.model, config.dtype)
    return _header(config, spec, producers, {rank: kv_lane for rank in range(producers)})


def _header(config: ServeConfig, spec, producers: int, lanes: dict[int, str],
            graphs: bool | None = None) -> ev.Header:
    extra = {"chunk": config.chunk, "model": spec.name, "engine": "pdgpu serve",
             "producers": producers, "verify": config.verify,
             "transport": "+".join(sorted(set(lanes.values())))}
    if graphs is not None:  # known once the decoder's device is (the start header's is not)
        extra["cuda_graphs"] = graphs
    if config.link_gbps is not None:
        extra["link_gbps"] = config.link_gbps
    extra["prefix_cache"] = config.prefix_cache_pages > 0  # on by default where it applies
    if config.prefix_cache_pages:
        extra["prefix_cache_pages"] = config.prefix_cache_pages
        extra["decoder_cache_pages"] = config.decoder_cache_pages
    elif config.prefix_cache_off is not None:
        extra["prefix_cache_off"] = config.prefix_cache_off
    geometry = handoff_geometry(spec, config.page_tokens)
    version = {"version": ev.CACHE_VERSION} if config.prefix_cache_pages else {}
    return ev.Header("pdgpu serve", config.mode, geometry, config.pool_pages,
                     config.max_pending, extra=tuple(sorted(extra.items())), **version)


def handshake(transport, config: ServeConfig, timeout_s: float, check_peers,
              device: str = "cpu") -> None:
    """Setup out, capabilities in; refuse an unservable run before anything is reserved."""
    for rank in transport.peers():
        transport.send(rank, "setup", {"config": config.to_json()})
    caps = [_wait(transport, "hello", timeout_s, check_peers) for _ in transport.peers()]
    reason = refusal(config.mode, [Capabilities.from_json(m.body["caps"]) for m in caps],
                     device)
    spec = model_spec(config.model, config.dtype)
    if reason is None and spec.arch not in ENGINE_ARCHS:
        reason = f"model: arch {spec.arch!r} is not served ({', '.join(ENGINE_ARCHS)})"
    for rank in transport.peers():
        transport.send(rank, "refuse" if reason else "go", {"reason": reason})
    if reason is not None:
        raise Refused(reason)


def measure_offset(transport, rank: int, timeout_s: float, check_peers) -> float:
    """Producer `rank`'s clock offset (clock.py): the best of a few round trips."""
    def answer():
        msg = _wait(transport, "clock", timeout_s, check_peers)
        if msg.src != rank:
            raise ServeError(f"producer p{msg.src} answered a clock probe sent to p{rank}")
        return msg
    return clock.best([clock.probe(transport, rank, answer)
                       for _ in range(clock.PROBES)]).offset


def _wait(transport, op: str, timeout_s: float, check_peers):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        msg = transport.get(timeout=0.1)
        if msg is None:
            check_peers()
            continue
        if msg.op == "error":
            raise ServeError(f"producer p{msg.src}: {msg.body['message']}")
        if msg.op == "beat":  # a producer's heartbeat may start before its hello is read
            continue
        if msg.op != op:
            raise ServeError(f"producer p{msg.src} sent {msg.op!r} during the handshake")
        return msg
    raise ServeError(f"handshake: no {op!r} from every producer within {timeout_s:.0f} s")


def prefix_cache(model, config: ServeConfig) -> torch.Tensor:
    """The decoder's prefix cache K/V [L, 2, prefix, KVH, D], computed like the producers'."""
    return prefix_kv(model, config.prefix_tokens, config.chunk, config.page_tokens)


def decoder_prefix(ledger: Ledger, config: ServeConfig) -> DecoderPrefix | None:
    """The decoder's automatic prefix cache over its pool (`--prefix-cache`), or None."""
    if not config.decoder_cache_pages:
        return None
    return DecoderPrefix(ledger, config.chunk, config.decoder_cache_pages)


def connect_producers(transport, producers: int, alive=lambda: None) -> None:
    """The first links, one per producer rank (generation 0)."""
    for rank in range(1, producers + 1):
        transport.connect(rank, 0, alive)


def run_decoder(transport, config: ServeConfig, workload: Workload, policy: FaultPolicy,
                timeout_s: float, processes: LocalProducers | None = None, progress=None,
                run: ServeRun | None = None, eos: int | None = None, trace=None,
                device: str = "cpu"):
    """The decoder rank on `device`: handshake, models, the serving loop; fills and returns
    `run` (its trace written to `trace`, or to a temporary file when None). Torch runs on
    `config.threads` threads meanwhile, and on as many as before once it returns."""
    with compute_threads("cpu", config.threads):
        return _run_decoder(transport, config, workload, policy, timeout_s, processes,
                            progress, run, eos, trace, device)


def _run_decoder(transport, config: ServeConfig, workload: Workload, policy: FaultPolicy,
                 timeout_s: float, processes, progress, run, eos, trace, device: str):
    run = run if run is not None else ServeRun()
    check_peers = processes.check if processes is not None else (lambda: None)
    handshake(transport, config, timeout_s, check_peers, device)
    model = load_served_model(config.model, config.seed, config.dtype, device)
    prefix_kv = prefix_cache(model, config)  # [L, 2, prefix, KVH, D] on `device`
    header = _header(config, model.spec, len(transport.peers()), transport.lanes(),
                     uses_graphs(config.cuda_graphs, device))
    if run.log is None:
        run.log = TraceLog(header, trace)
    else:  # opened at the start with the lane asked for: now the lanes agreed
        run.log.set_header(header)
    run.ledger = Ledger(header, device, model.model.embed_tokens.weight.dtype, run.log,
                        state=model.state_shape, prefix_kv=prefix_kv)
    for _ in transport.peers():
        _wait(transport, "ready", timeout_s, check_peers)
    offsets = {rank: measure_offset(transport, rank, timeout_s, check_peers)
               for rank in transport.peers()}
    run.ledger.restart_clock()
    members = Members(transport, config, offsets, policy.heartbeat_timeout, timeout_s,
                      processes, policy.restart_producers, device)
    run.decoder = Decoder(run.ledger, model, workload, members, policy,
                          config.faults, config.verify, progress, eos=eos, inbox=run.frontend,
                          forward=decode_forward(config.cuda_graphs, device),
                          prefix_cache=decoder_prefix(run.ledger, config))
    if run.results is not None:
        run.decoder.on_end = run.results.add
    start = time.perf_counter()
    run.decoder.run()
    run.wall_s = time.perf_counter() - start
    for rank in transport.peers():
        members.send(rank, "shutdown", {})
    run.ledger.close()  # waits for the audit: raises what it found
    return run


def end_on_error(run: ServeRun, error: BaseException) -> None:
    """Producers are gone: the audit drained, every live life aborted so the trace closes
    complete; raises the run's cause: a violation the audit found in what happened before
    the stop (the first broken rule, never lost behind the error that stopped the run), or
    `error` itself (call it while handling `error`)."""
    cause = error if run.ledger is None else audit.cause(error, run.ledger.stop())
    run.error = cause
    if run.decoder is not None:
        run.decoder.cancel_all(f"stopped: {type(cause).__name__}")
    if cause is error:
        raise error
    raise cause from error


def _kill_started() -> None:
    """Every process started from here so far (LocalProducers may be half made)."""
    for child in mp.active_children():
        child.kill()
        child.join(timeout=3)


def serve_local(config: ServeConfig, workload: Workload, producers: int, opts: ProducerOptions,
                endpoint: Endpoint, policy: FaultPolicy | None = None, progress=None,
                on_start=None, run: ServeRun | None = None, eos: int | None = None,
                trace=None, decoder_device: str = "cpu") -> ServeRun:
    """Decoder here (on `decoder_device`), `producers` processes started from here (on
    `opts.device`); the run, or its error raised after every producer is stopped and every
    live request aborted."""
    use_device(decoder_device)
    store = open_decoder_store(endpoint, producers + 1, opts.connect_timeout_s)  # port 0: free
    run = run if run is not None else ServeRun()
    try:
        procs = LocalProducers(producers, Endpoint(endpoint.host, store.port), opts)
        if on_start is not None:
            on_start(procs.pids)
        import pdgpu.serve.preload  # noqa: F401 - torch's lazy imports, while producers start
        transport = open_transport(store, 0, decoder_device, opts.connect_timeout_s,
                                   opts.kv_lane)
    except BaseException:  # e.g. Ctrl-C: the producers started so far go before the store
        _kill_started()  # does (one that sees the rendezvous vanish prints torch's C++ frames)
        raise
    try:
        connect_producers(transport, producers, alive=procs.check)
        run_decoder(transport, config, workload, policy or FaultPolicy(),
                    opts.connect_timeout_s, procs, progress, run, eos, trace, decoder_device)
        procs.stop(grace_s=10.0)
    except BaseException as e:
        procs.stop(grace_s=5.0 if isinstance(e, Refused) else 0.0)  # before the close below
        end_on_error(run, e)
    finally:
        transport.close()  # every producer is gone: the receiving threads end at once
    return run
