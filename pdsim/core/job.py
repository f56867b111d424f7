"""A request's life while a producer works on it (mutable process state: its steps, spans
ready, issued and landed, the source pages and queued work it holds)."""

from __future__ import annotations

from collections import deque

import attrs

from pdsim.core.config import RequestSpec
from pdsim.core.steps import Step


@attrs.define(eq=False)
class Job:
    """A request's life while the producer works on it (mutable process state)."""

    request: RequestSpec
    steps: list[Step]
    index: int = 0
    ready: deque = attrs.Factory(deque)  # spans computed but not yet issued
    spans_total: int = 0
    spans_issued: int = 0
    spans_landed: int = 0
    produced: bool = False
    ended: bool = False  # the life was released or aborted (faults: nothing more happens)
    owner: object | None = None  # its Producer (producer.py imports this module)
    queued_work: int = 0  # suffix tokens counted in its producer's load until `produced`
    source_pages: int = 0  # source cache pages it holds on its producer until its `reuse`
    decode_last: int | None = None  # the decode step that gives its last token
    # (prefix cache) its slab's page ids, the decoder's cached pages it holds (hit and put
    # in), its producer's hit (loaded, not computed) and the pages it put in there, and the
    # first token its producer computes
    slab: tuple = ()
    decoder_pages: tuple = ()
    source_hit: list = attrs.Factory(list)
    source_held: list = attrs.Factory(list)
    compute_from: int = 0
    # request.req, kept as a field: a run reads it several times per span
    req: str = attrs.field(init=False, default=attrs.Factory(lambda job: job.request.req,
                                                             takes_self=True))

    @property
    def failed(self) -> bool:
        """A span of this life failed (faults: fault_producer.FaultJob)."""
        return False
