"""One producer rank from start to exit: its device, its transport, the handshake, its loop.

Started by the local decoder (`producer_process`, launch.py's LocalProducers) or by
`pdgpu serve --role producer` on its own machine (`run_producer`). Its device is its own
(`ProducerOptions.device`): set as the process's CUDA device before the model or any NCCL
group is made; the transport follows it (transport_nccl.open_transport) and it is announced
in the capabilities so the decoder refuses mixed devices.
"""

from __future__ import annotations

import os
import signal
import sys

import attrs
import torch

from pdgpu.handoff import unshipped_state
from pdgpu.serve.bugs import bug_for
from pdgpu.serve.config import ServeConfig, producer_capabilities
from pdgpu.serve.devices import use_device
from pdgpu.serve.models import load_served_model, model_spec
from pdgpu.serve.producer import Producer
from pdgpu.serve.recovery import ServeError
from pdgpu.serve.transport import Endpoint, TransportError, open_store
from pdgpu.serve.transport_nccl import open_transport


@attrs.frozen
class ProducerOptions:
    kv_progress: bool = True
    device: str = "cpu"  # this producer's (checked: devices.check_device)
    connect_timeout_s: float = 60.0
    kv_lane: str = "shm"  # offer shared memory to a decoder on this machine, or "gloo"


def expect(transport, ops: tuple[str, ...], timeout_s: float):
    msg = transport.get(timeout=timeout_s)
    if msg is None:
        raise ServeError(f"no {'/'.join(ops)} message within {timeout_s:.0f} s")
    if msg.op not in ops:
        raise ServeError(f"expected {'/'.join(ops)}, got {msg.op!r}")
    return msg


def run_producer(endpoint: Endpoint, rank: int, generation: int, opts: ProducerOptions) -> int:
    """One producer rank (its link's `generation`: 0, or the restarts before it), until the
    decoder says shutdown; its exit code."""
    use_device(opts.device)
    store = open_store(endpoint, rank, None, opts.connect_timeout_s)
    transport = open_transport(store, rank, opts.device, opts.connect_timeout_s, opts.kv_lane)
    transport.connect(0, generation)
    producer = None
    try:
        setup = expect(transport, ("setup",), opts.connect_timeout_s)
        config = ServeConfig.from_json(setup.body["config"])
        spec = model_spec(config.model, config.dtype)
        caps = producer_capabilities(f"p{rank}", unshipped_state(spec), opts.kv_progress,
                                     opts.device)
        transport.send(0, "hello", {"caps": caps.to_json()})
        if expect(transport, ("go", "refuse"), opts.connect_timeout_s).op == "refuse":
            return 2
        torch.set_num_threads(config.threads)
        model = load_served_model(config.model, config.seed, config.dtype, opts.device)
        producer = Producer(transport, config, model, f"p{rank}", bug_for(config.debug),
                            generation)
        transport.send(0, "ready", {"now": producer.now()})
        producer.run()
        return 0
    except Exception as e:  # noqa: BLE001 - told to the decoder in one line, then exit 1
        _tell_decoder(transport, f"{type(e).__name__}: {e}")
        return 1
    finally:
        if producer is not None:
            producer.close()
        transport.close(wait_s=0.0)  # os._exit follows: its receiving thread needs no join


def _tell_decoder(transport, message: str) -> None:
    try:
        transport.send(0, "error", {"message": message.splitlines()[0][:300]})
    except TransportError:
        pass  # the decoder is gone: it knows


def producer_process(rank: int, generation: int, host: str, port: int,
                     opts: ProducerOptions) -> None:
    """The entry of a producer started by the local decoder (Ctrl-C is the decoder's job)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    code = 1
    try:
        code = run_producer(Endpoint(host, port), rank, generation, opts)
    except BaseException as e:  # noqa: BLE001 - one line on stderr, never a traceback
        first = (str(e).strip().splitlines() or [""])[0][:300]  # torch errors carry frames
        print(f"pdgpu serve: producer p{rank}: {type(e).__name__}: {first}", file=sys.stderr)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # gloo's receiving threads may still block in recv: don't wait for them
