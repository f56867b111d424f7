"""A producer's sender thread: its spans to the decoder, one at a time, each bounded by one
of `max_pending` slots (a slot comes back with the decoder's `ack`).

It waits for a slot, announces `issue` (with the producer's span number `sid`), gathers the
region out of the source pages (a state span: out of the life's state slot), holds it for
the paced link, and sends it with the digests taken at compute time. Injected faults
(faults.py) are asked once per span here. It says `stopped` for each cancelled life between
two spans only (never between a span's issue and its bytes, and before any later span of
the life, which it then drops unissued). The main thread (producer.py) queues spans into
`outbox` and cancelled lives into `stopping`; an error here is raised there (`error`).
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections import deque

import torch

from pdgpu.handoff import kv_groups, state_range
from pdgpu.serve.digest import BITS
from pdgpu.serve.faults import Fate
from pdref.plan import Region

DECODER = 0
POLL_S = 0.02  # the thread's waits look at `stopping` and `closing` this often
CLOSE_JOIN_S = 5.0  # most close() waits for the thread (it ends within a POLL_S once told)


class SpanSender:
    """The thread and what it shares with the main thread: `slots`, `outbox`, `stopping`,
    `sids`, `error`. `send(op, tensors=(), **body)` sends to the decoder; `staging(rank,
    specs, device)` is the transport's."""

    def __init__(self, producer) -> None:
        self.send, self.staging = producer._send, producer.transport.staging
        self.config, self.geometry, self.cache = producer.config, producer.geometry, producer.cache
        self.device, self.bugs, self.now = producer.device, producer.bugs, producer.now
        self.slots = threading.Semaphore(self.config.max_pending)
        self.outbox: queue.Queue = queue.Queue()
        self.stopping: deque[str] = deque()  # cancelled lives to say `stopped` for
        self.sids = itertools.count()
        self.error: Exception | None = None
        self.closing = threading.Event()  # close(): a span waiting for a slot or a stall ends
        self.thread = threading.Thread(target=self._send_loop, daemon=True, name="pdgpu-sender")
        self.thread.start()

    def close(self) -> None:
        """Stop the thread: it ends at its next wait (a span waiting for a slot, or a stalled
        one, gives up); CLOSE_JOIN_S at most for it to get there."""
        self.closing.set()
        self.outbox.put(None)
        self.thread.join(timeout=CLOSE_JOIN_S)

    def state_of(self, job, region: Region) -> tuple[torch.Tensor, torch.Tensor]:
        """A state span's states in the life's slot (views): conv [ns, C, K-1], recurrent
        [ns, Hv, Dk, Dv]."""
        s0, s1 = state_range(self.geometry, region.layers)
        pool, slot = self.cache.states, job.kv.inner.state_slot
        return pool.conv[s0:s1, slot], pool.recurrent[s0:s1, slot]

    def _send_loop(self) -> None:
        try:
            while True:
                self.send_stops()
                try:
                    item = self.outbox.get(timeout=POLL_S)
                except queue.Empty:
                    continue
                if item is None:
                    return
                self._send_span(*item)
        except Exception as e:  # noqa: BLE001 - reported by the main thread
            self.error = e

    def send_stops(self) -> None:
        """`stopped` for each cancelled life (called between spans only)."""
        while self.stopping:
            self.send("stopped", handle=self.stopping.popleft())

    def _send_span(self, job, region: Region) -> None:
        while not self.slots.acquire(timeout=POLL_S):  # a slot may wait for a `stopped`
            if self.closing.is_set():
                return
            self.send_stops()
        if job.cancelled:
            self.slots.release()
            return
        sid, nbytes = next(self.sids), region.span_bytes(self.geometry, job.prompt, job.prefix)
        fate = self.config.faults.span_fate(job.handle, region.layers, region.tokens)
        start = self.now()
        state = {"state": True} if region.state else {}
        self.send("issue", handle=job.handle, sid=sid, layers=region.layers,
                   tokens=region.tokens, bytes=nbytes, **state)
        if fate is Fate.STALL:  # the writer hangs until the decoder cancels the life
            while not job.stop.wait(POLL_S) and not self.closing.is_set():
                pass
            return  # nothing sent: its slot comes back when the life's `stopped` is acked
        if fate is Fate.FAIL:
            self.send("span", handle=job.handle, sid=sid, error="copy failed (injected)")
            return
        tensors = (self._gather_state if region.state else self._gather_kv)(job, region)
        if tensors:
            self.bugs.after_gather(tensors[0])  # [nl, 2, nt, KVH, D] (a state: its conv)
        if fate is Fate.CORRUPT and tensors and tensors[0].numel():
            data = tensors[0]  # one bit of one element, in transit
            data.view(BITS[data.dtype]).view(-1)[0] ^= 1
        gathered = self.now()
        self._pace(start, nbytes)
        self.send("span", tensors=tensors,
                   handle=job.handle, sid=sid, gather=[start, gathered],
                   link=[gathered, self.now()])

    def _gather_kv(self, job, region: Region) -> tuple:
        """A KV span's rows out of the source pages, group by group (handoff.kv_groups: a
        sliding layer's window only): kv [n, 2, nt, KVH, D] then its digests [n, 2, nt]."""
        groups = kv_groups(self.geometry, region.layers, region.tokens, job.prompt, job.prefix)
        specs, parts = [], []
        for (l0, l1), (a, b) in groups:
            index = job.kv.inner.slots[a:b]  # [nt]
            source = self.cache.kv[l0:l1]  # [n, 2, S, KVH, D]
            digests = job.kv.region((l0, l1), (a, b))  # [n, 2, nt]
            specs += [((*source.shape[:2], len(index), *source.shape[3:]), source.dtype),
                      (digests.shape, digests.dtype)]
            parts.append((source, index, digests))
        staged = self.staging(DECODER, specs, self.device) if specs else []
        for (source, index, digests), kv, sums in zip(parts, staged[0::2], staged[1::2],
                                                      strict=True):
            torch.index_select(source, 2, index, out=kv)  # shared memory: gathered in
            sums.copy_(digests)
        return tuple(staged)

    def _gather_state(self, job, region: Region) -> tuple:
        """A state span's states out of the life's slot: conv [ns, C, K-1], its digests,
        recurrent [ns, Hv, Dk, Dv], its digests (taken when it was queued)."""
        held = self.state_of(job, region)
        sums = job.state_sums[region.layers]
        specs = [spec for t, d in zip(held, sums, strict=True)
                 for spec in ((t.shape, t.dtype), (d.shape, d.dtype))]
        staged = self.staging(DECODER, specs, self.device)
        for into, t in zip(staged, (held[0], sums[0], held[1], sums[1]), strict=True):
            into.copy_(t)
        return tuple(staged)

    def _pace(self, start: float, nbytes: int) -> None:
        """Hold the span until `nbytes` could have crossed a `link_gbps` link."""
        if self.config.link_gbps is None:
            return
        remaining = start + nbytes / (self.config.link_gbps * 1e9) - self.now()
        if remaining > 0:
            time.sleep(remaining)

