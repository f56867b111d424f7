"""The engine's warm-up before t = 0 (a part of Engine: it reads the engine's `config`,
`model`, `geometry`, `source`, `pool` and `copier`): one throwaway chunk of prefill and the
head, and one copy through every staging slot into the decoder pool, on the run's devices
and threads; then the source pages go back and both caches are zeroed. Nothing of it is
traced or checked.
"""

from __future__ import annotations

import time
from functools import partial

import torch

from pdgpu.copy_job import CopyJob
from pdgpu.handoff import pieces
from pdgpu.prefill import Prefill
from pdgpu.source_cache import RequestKV
from pdgpu.workload import Request
from pdref.plan import Region, plan_spans


class WarmUp:
    """The warm-up's methods of Engine (engine.py)."""

    def _warm_up(self, requests: list[Request]) -> float:
        """Before t = 0: prefill one chunk (and the head) of the request with the largest
        span into its source pages, copy that span once through every staging slot into the
        decoder pool, give the pages back and zero both caches. Seconds it took."""
        start = time.perf_counter()
        request = max(requests, key=self._largest_region_elems)
        src = self.source.open(request.prompt)
        tokens = torch.tensor(request.tokens[:self.config.chunk], dtype=torch.int64,
                              device=self.config.device)
        if len(tokens) and not self.config.no_compute:
            throwaway = Prefill(self.model, tokens, 0, self.config.chunk, src)
            throwaway.chunk((0, len(tokens)))
            self.model.logits(throwaway.last)
        ready = self.copier.mark_ready()
        region = max(self._plan_spans(request), key=partial(self._region_elems, request),
                     default=None)
        if region is not None:
            self._warm_copies(request, region, src, ready)
        self.source.close(src)  # before t = 0 and any event: nothing reads these pages
        self.source.kv.zero_()  # on the compute stream, before the first request's prefill
        self.copier.mark_ready().wait()
        return time.perf_counter() - start

    def _warm_copies(self, request: Request, region: Region, src: RequestKV, ready) -> None:
        """Copy `region` through every staging slot into the decoder pool (and a state slot
        of it), then zero the pool: the copy path touched once before t = 0."""
        pages = tuple(range(self.geometry.pages_for(request.prompt - request.prefix)))
        slab = self.pool.slab(pages, request.prefix, request.prompt)
        states = self.pool.states
        slot = None if states is None else states.take()
        parts = pieces(self.geometry, region, request.prompt, request.prefix,
                       (src.state_slot, slot))
        self.copier.warm_up([CopyJob(-1 - i, "warm-up", region.layers, region.tokens,
                                     src.slots, slab, ready, pieces=parts)
                             for i in range(self.copier.config.slots)])
        if states is not None:
            states.give_back(slot)

    def _region_elems(self, request: Request, region: Region) -> int:
        g = self.geometry
        return region.span_bytes(g, request.prompt, request.prefix) // g.dtype_bytes

    def _largest_region_elems(self, request: Request) -> int:
        return max(map(partial(self._region_elems, request), self._plan_spans(request)),
                   default=0)

    def _plan_spans(self, request: Request) -> list[Region]:
        return plan_spans(self.config.mode, self.geometry, request.prompt, request.prefix,
                          self.config.chunk)
