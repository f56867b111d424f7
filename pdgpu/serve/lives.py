"""The decoder's record of requests and of their lives (one try each), with the spans each
life's writer may still send.

A life's spans are keyed by the producer's own span number (`sid`, in its `issue` and
`span` messages). A span the decoder told pdref about has its pdref id; a *ghost* (None) was
announced after the life failed or ended, so pdref never saw it and its bytes are dropped.
`unfenced` holds the pdref ids of spans that failed or were cancelled and whose writer may
still be busy: each gets its `fence` when its late bytes arrive (dropped) or when the
producer says it stopped the life, or when the producer is declared dead.
"""

from __future__ import annotations

import enum

import attrs

from pdgpu.decode_kv import SequenceKV
from pdgpu.prefix_index import KeyChain
from pdgpu.serve.workload import ServeRequest


class Status(enum.StrEnum):
    WAITING = "waiting"  # not arrived, queued, or queued again for a retry
    PREFILL = "prefill"  # a live life: slab reserved, prefill and copies under way
    RUNNING = "running"  # admitted into the decode batch
    OK = "ok"
    CANCELLED = "cancelled"
    FAILED = "failed"

    @property
    def final(self) -> bool:
        return self in (Status.OK, Status.CANCELLED, Status.FAILED)


@attrs.define(eq=False)
class Life:
    handle: str  # "req#attempt": names the life in every message
    req: str
    producer: int  # rank
    suffix: int  # prompt - prefix tokens this life's producer prefills
    prefix: int = 0  # the tokens its reserve covers already (the fixed prefix, or a cache hit)
    failed: str | None = None  # the first failure; the life is never admitted
    ended: bool = False  # aborted in pdref (failed after its writer stopped, or cancelled)
    stopped: bool = False  # the producer confirmed it sends nothing more for this life
    cancel_sent: bool = False
    token: int | None = None  # the first output token, once produced
    logprob: tuple | None = None  # its log-probabilities, when the request asks (sampler.py)
    produced_t: float | None = None
    producer_hit: int = 0  # leading prompt tokens its producer took from its prefix cache
    spans: dict[int, int | None] = attrs.Factory(dict)  # sid -> pdref span id (None: ghost)
    unfenced: set[int] = attrs.Factory(set)  # pdref span ids whose writer may still write

    @property
    def produced(self) -> bool:
        return self.token is not None

    @property
    def prefilling(self) -> bool:
        """Still on its producer's queue of prefill work (for least-loaded placement)."""
        return not (self.produced or self.failed or self.ended)


@attrs.define(eq=False)
class Tracked:
    """One request across its lives."""

    request: ServeRequest
    arrival: float | None = None
    attempts: int = 0
    status: Status = Status.WAITING
    reason: str | None = None  # why it was cancelled or failed
    life: Life | None = None  # its current life, until it is aborted or released
    output: list[int] = attrs.Factory(list)
    logprobs: list = attrs.Factory(list)  # per output token, when the request asks
    token_t: list[float] = attrs.Factory(list)
    done_t: float | None = None
    seq: SequenceKV | None = None
    slot: int = 0  # its row in the decoder's sampler (penalties), while running
    cancel_at: int | None = None  # cancelled once it has made this many steps
    steps: int = 0  # messages of its lives and decoded tokens so far
    stop: frozenset[int] = frozenset()  # it also ends after any of these tokens (HTTP `stop`)
    reserved_t: float | None = None  # its current life's slab reserved (run clock)
    admitted_t: float | None = None  # admitted into the decode batch (run clock)
    producer_hit: int = 0  # its producing life's `producer_hit`: prompt tokens not computed
    decoder_hit: int = 0  # its admitted life's hit in the decoder's cache: tokens not crossed
    keys: KeyChain | None = None  # its prompt's page keys (the decoder's cache), until admitted

    @property
    def req(self) -> str:
        return self.request.req
