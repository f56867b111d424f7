"""What the engine is asked to do, and the checks made before anything is allocated."""

from __future__ import annotations

import attrs
import torch

from pdgpu.faults import DEBUG_BREAKS
from pdgpu.handoff import handoff_geometry, pieces, staged, unshipped_state
from pdref.events import Mode
from pdref.models import ModelSpec
from pdref.plan import PlanError, plan_spans, validate_workload


class WorkloadError(ValueError):
    """Bad input: the message names the field and the rule it breaks (CLI exit 2)."""


@attrs.frozen
class EngineConfig:
    mode: Mode = attrs.field(converter=Mode)
    chunk: int = 256
    max_pending: int = 2
    page_tokens: int = 16
    pool_pages: int | None = None  # None: just enough for the largest request
    device: str = "cpu"
    decoder_device: str = "cpu"
    link_gbps: float | None = None  # pace d2h and h2d (each direction) to this many GB/s
    fail_span: int | None = None  # the copy of this span id fails (fault injection)
    retries: int = 2
    debug: str | None = None  # a protocol-breaking switch of engine.DEBUG_BREAKS
    keep_kv: bool = False  # keep a copy of each request's decoder KV (parity checks)
    threads: int | None = None  # torch compute threads; None: one core left for the copier
    warmup: bool = True  # before t = 0: touch every copy-path buffer, prefill one chunk
    no_compute: bool = False  # export only: a known payload instead of prefill (pdgpu.payload)
    output_tokens: int = 1  # tokens per request, decoded after admission from what crossed


@attrs.frozen
class Request:
    req: str
    tokens: tuple[int, ...] = attrs.field(converter=tuple)
    prefix: int = 0

    @property
    def prompt(self) -> int:
        return len(self.tokens)


@attrs.frozen
class Plan:
    """Sizes of everything the run allocates, fixed before it starts."""

    source_pages: int
    pool_pages: int
    ring_slots: int
    span_elems: int


def _check_config(config: EngineConfig) -> None:
    rules = (
        (config.chunk >= 1, f"chunk must be >= 1, got {config.chunk}"),
        (config.max_pending >= 1, f"max_pending must be >= 1, got {config.max_pending}"),
        (config.page_tokens >= 1, f"page_tokens must be >= 1, got {config.page_tokens}"),
        (config.retries >= 0, f"retries must be >= 0, got {config.retries}"),
        (config.output_tokens >= 1, f"output_tokens must be >= 1, got {config.output_tokens}"),
        (config.output_tokens == 1 or not config.no_compute,
         "output_tokens must be 1 with no_compute: nothing is computed to decode from"),
        (config.threads is None or config.threads >= 1,
         f"threads must be >= 1, got {config.threads}"),
        (config.link_gbps is None or config.link_gbps > 0,
         f"link_gbps must be > 0, got {config.link_gbps}"),
        (config.fail_span is None or config.fail_span >= 0,
         f"fail_span must be >= 0, got {config.fail_span}"),
    )
    for ok, message in rules:
        if not ok:
            raise WorkloadError(message)


def _check_device(name: str, field: str) -> torch.device:
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise WorkloadError(f"{field} must be cpu or cuda[:N], got {name!r}") from None
    if device.type not in ("cpu", "cuda"):
        raise WorkloadError(f"{field} must be cpu or cuda[:N], got {name!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise WorkloadError(f"{field} is {name!r} but CUDA is not available here")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise WorkloadError(f"{field} is {name!r} but there are only "
                            f"{torch.cuda.device_count()} CUDA devices")
    return device


def _check_devices(config: EngineConfig) -> None:
    producer = _check_device(config.device, "device")
    decoder = _check_device(config.decoder_device, "decoder_device")
    if decoder.type == "cuda" and producer.type != "cuda":
        raise WorkloadError("decoder_device may be cuda only when device is cuda too")


def _check_request(spec: ModelSpec, config: EngineConfig, request: Request) -> None:
    try:
        validate_workload(request.prompt, request.prefix, config.chunk, config.page_tokens)
    except PlanError as e:
        raise WorkloadError(f"request {request.req!r}: {e}") from None
    bad = [t for t in request.tokens if not 0 <= t < spec.vocab]
    if bad:
        raise WorkloadError(f"tokens must be in [0, vocab={spec.vocab}), got {bad[0]}")


def _span_sizes(spec: ModelSpec, config: EngineConfig, request: Request) -> tuple[int, int]:
    """(spans of the request's plan, elements of the staging buffer its largest span needs:
    its pieces laid out as the copier stages them, handoff.py)."""
    geometry = handoff_geometry(spec, config.page_tokens)
    spans = plan_spans(config.mode, geometry, request.prompt, request.prefix, config.chunk)
    per_token_layer = 2 * spec.kv_heads * spec.head_dim
    cell = geometry.bytes_per_token_layer
    largest = max((staged(pieces(geometry, r, request.prompt, request.prefix, (0, 0)), cell)[1]
                   for r in spans), default=0)
    return len(spans), max(-(-largest // geometry.dtype_bytes), per_token_layer)


def setup_check(spec: ModelSpec, config: EngineConfig, requests: list[Request]) -> Plan:
    """Refuse a bad workload with one clear line; else the sizes of every buffer."""
    _check_config(config)
    if config.mode is Mode.LAYER and unshipped_state(spec):
        raise WorkloadError("mode layer is refused for a recurrent model whose state no span "
                            "carries (CFG-1): layer streaming would carry attention KV only")
    if config.debug is not None and config.debug not in DEBUG_BREAKS:
        raise WorkloadError(f"debug must be one of {', '.join(tuple(DEBUG_BREAKS))}")
    _check_devices(config)
    if not requests:
        raise WorkloadError("requests: at least one request is needed")
    for request in requests:
        _check_request(spec, config, request)
    return _plan(spec, config, requests)


def _plan(spec: ModelSpec, config: EngineConfig, requests: list[Request]) -> Plan:
    pt = config.page_tokens
    needed = max(-(-(r.prompt - r.prefix) // pt) for r in requests)
    pool_pages = config.pool_pages if config.pool_pages is not None else max(needed, 1)
    if pool_pages < needed:
        raise WorkloadError(f"pool_pages: {pool_pages} pages cannot hold a request's suffix "
                            f"(needs {needed} pages of {pt} tokens)")
    sizes = [_span_sizes(spec, config, r) for r in requests]
    slots = min(config.max_pending, max(max(n for n, _ in sizes), 1))
    source_pages = max(-(-r.prompt // pt) for r in requests)
    return Plan(source_pages, pool_pages, slots, max(e for _, e in sizes))


