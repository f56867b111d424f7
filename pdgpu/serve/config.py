"""What a serving run is asked to do, what each producer can do, and whether that serves.

`ServeConfig` travels from the decoder to every producer in the handshake (as JSON), so a
producer started on another machine needs only its rank and the rendezvous address.
"""

from __future__ import annotations

import attrs

from pdgpu.serve.devices import mixed_devices
from pdgpu.serve.faults import FaultSpec
from pdref.events import Mode

DEBUG_BUGS = {
    # A hand-made bug a user could not see in `pdgpu run`: --verify must catch it as `fail`.
    "drop-last-row": "the producer's copy drops each span's last token row",
    # Protocol breaks the live check must stop with their code, naming the producer.
    "early-reuse": "the producer gives a request's source pages back at `produced`, while its "
                   "last spans are still to be copied (COPY-3 or COPY-1)",
    "issue-early": "the producer announces each streamed span before computing it (COPY-1)",
}


def _fault_spec(value) -> FaultSpec:
    return FaultSpec.from_json(value) if isinstance(value, dict) else value


@attrs.frozen
class ServeConfig:
    model: str
    mode: Mode = attrs.field(converter=Mode)
    seed: int = 0
    dtype: str | None = None
    chunk: int = 64
    max_pending: int = 2
    page_tokens: int = 16
    pool_pages: int = 0
    link_gbps: float | None = None
    verify: bool = True  # `--no-verify` turns it off (it costs little: bench/serve.py)
    debug: str | None = None
    prefix_tokens: tuple[int, ...] = attrs.field(default=(), converter=tuple)
    source_pages: int = 0  # per producer: room for two of the longest requests
    threads: int = 1
    faults: FaultSpec = attrs.field(factory=FaultSpec, converter=_fault_spec)
    beat_s: float = 1.0  # a producer sends a heartbeat this often
    cuda_graphs: str = "auto"  # the decoder's step: auto, on, off (decode_graph.py)
    prefix_cache_pages: int = 0  # each producer's automatic prefix cache (0: off)
    decoder_cache_pages: int = 0  # the decoder's, in pages of its pool (0: off)
    prefix_cache_off: str | None = None  # why both are off (the header says it)

    @property
    def prefix(self) -> int:
        return len(self.prefix_tokens)

    def to_json(self) -> dict:
        out = attrs.asdict(self)
        out["mode"] = str(self.mode)
        out["prefix_tokens"] = list(self.prefix_tokens)
        return out

    @classmethod
    def from_json(cls, obj: dict) -> ServeConfig:
        return cls(**obj)


@attrs.frozen
class Capabilities:
    """What a producer announces in the handshake."""

    name: str
    kv_progress: bool  # publishes per-chunk / per-layer readiness, so it can stream spans
    modes: tuple[str, ...] = attrs.field(converter=tuple)
    # its model carries recurrent state besides attention KV that no span carries (a
    # hybrid the engine implements ships its state in state spans: contract v3)
    recurrent: bool
    device: str = "cpu"  # where its KV lives (cpu: gloo; cuda:N: NCCL)

    def to_json(self) -> dict:
        return {**attrs.asdict(self), "modes": list(self.modes)}

    @classmethod
    def from_json(cls, obj: dict) -> Capabilities:
        return cls(**obj)


def producer_capabilities(name: str, recurrent: bool, kv_progress: bool,
                          device: str = "cpu") -> Capabilities:
    """Streaming modes need kv_progress; layer streaming carries attention KV only."""
    modes = ["whole"]
    if kv_progress:
        modes.append("chunk")
        if not recurrent:
            modes.append("layer")
    return Capabilities(name, kv_progress, tuple(modes), recurrent, device)


def refusal(mode: Mode, caps: list[Capabilities], decoder_device: str = "cpu") -> str | None:
    """One line saying why the run cannot be served by these producers, or None."""
    for cap in caps:
        mixed = mixed_devices(decoder_device, cap.device, f"producer {cap.name}")
        if mixed is not None:
            return f"device: {mixed}"
        if mode is Mode.LAYER and cap.recurrent:
            return (f"mode: layer is refused for a recurrent model (CFG-1): producer "
                    f"{cap.name} carries recurrent state, layer streaming carries attention "
                    "KV only")
        if mode is not Mode.WHOLE and not cap.kv_progress:
            return (f"mode: {mode} streams spans during prefill, but producer {cap.name} "
                    "does not announce kv_progress (it can serve mode whole only)")
        if str(mode) not in cap.modes:
            return f"mode: producer {cap.name} cannot stream mode {mode} (it offers " \
                   f"{', '.join(cap.modes)})"
    return None
