"""What one simulation is given: the workload's requests and the run's frozen configuration."""

from __future__ import annotations

import attrs

from pdref.events import Mode
from pdref.geometry import Geometry
from pdsim.core.costs import Costs


def _at_least(n: int):
    def check(_inst, attribute, value) -> None:
        if type(value) is not int or value < n:
            raise ValueError(f"{attribute.name} must be an integer >= {n}, got {value!r}")

    return check


def _time(_inst, attribute, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
        raise ValueError(f"{attribute.name} must be a number >= 0, got {value!r}")


SENDERS = ("blocking", "queued")


@attrs.frozen
class RequestSpec:
    """One request of a workload: when it arrives and which tokens it needs handed off."""

    req: str = attrs.field(validator=attrs.validators.min_len(1))
    arrival: float = attrs.field(validator=_time)
    prompt: int = attrs.field(validator=_at_least(1))
    prefix: int = attrs.field(default=0, validator=_at_least(0))
    # tokens it generates, the first one its producer's; None: the run's `output_tokens`
    output_tokens: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(_at_least(0)))
    # what its tokens are, for a prefix cache (contract v4): its first `system` tokens are
    # every request's (a shared system prompt), the rest its `session`'s (a conversation's
    # turns share their leading tokens; None: its own)
    session: str | None = None
    system: int = attrs.field(default=0, validator=_at_least(0))

    def __attrs_post_init__(self) -> None:
        if self.prefix > self.prompt:
            raise ValueError(f"prefix must be <= prompt={self.prompt}, got {self.prefix}")


@attrs.frozen
class SimConfig:
    """The run: geometry and cost terms, mode, chunk, bounds, pool, producers."""

    geometry: Geometry
    costs: Costs
    mode: Mode = attrs.field(converter=Mode)
    chunk: int = attrs.field(validator=_at_least(1))
    max_pending: int = attrs.field(default=2, validator=_at_least(1))
    pool_pages: int = attrs.field(default=4096, validator=_at_least(1))
    producers: int = attrs.field(default=1, validator=_at_least(1))
    no_compute: bool = False
    output_tokens: int = attrs.field(default=0, validator=_at_least(0))
    # closed loop: requests in the system at once (None: open loop, each request's arrival)
    concurrency: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(_at_least(1)))
    # a producer's source cache, in pages for prompt suffixes (None: unbounded)
    source_pages: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(_at_least(1)))
    # blocking: compute waits at max_pending spans (pdgpu run); queued: spans wait in the
    # producer's outbox and compute goes on (pdgpu serve's sender thread)
    sender: str = attrs.field(default="blocking", validator=attrs.validators.in_(SENDERS))
    # (contract v4) automatic prefix caching: the most pages the decoder's cache holds (of
    # its pool) and each producer's (of its source memory), LRU among the pages no request
    # holds; None on both: no cache (0: that side caches nothing)
    decoder_cache_pages: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(_at_least(0)))
    producer_cache_pages: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(_at_least(0)))
    stages: bool = True  # emit informational stage events (traces, explain, timeline)
    labels: tuple[tuple[str, object], ...] = ()  # extra header fields (model, hw, link, ...)

    def __attrs_post_init__(self) -> None:
        if self.mode is Mode.LAYER and self.geometry.recurrent and self.geometry.kinds is None:
            raise ValueError("mode layer is refused for a recurrent model that names no "
                             "layer kinds (CFG-1)")

    @property
    def prefix_cache(self) -> bool:
        """Whether the run caches prefixes (contract v4 traces)."""
        return self.decoder_cache_pages is not None or self.producer_cache_pages is not None

    def producer_name(self, index: int) -> str:
        return f"p{index}"

    def output_of(self, request: RequestSpec) -> int:
        """Tokens `request` generates: its own count, else the run's `output_tokens`."""
        return self.output_tokens if request.output_tokens is None else request.output_tokens
