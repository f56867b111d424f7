"""The decoder side: admits a request once `Monitor.can_admit` says every layer landed, decodes
its output tokens, then releases its slab back to the pool."""

from __future__ import annotations

from pdref import events as ev


class Decoder:
    """One decoder pool shared by every producer."""

    def __init__(self, env, sim) -> None:
        self.env, self.sim = env, sim
        self.admitted: set[str] = set()

    def try_admit(self, job) -> None:
        """Admit when the spec allows it: produced, every span landed, nothing in flight."""
        if not job.produced or job.spans_landed < job.spans_total or job.req in self.admitted:
            return
        if not self.sim.monitor.can_admit(job.req):
            return
        self.admitted.add(job.req)
        now = self.env.now
        # The producer frees its source KV once nothing reads it any more.
        self.sim.emit(ev.Reuse(now, job.req, (0, job.request.prompt)))
        self.sim.emit(ev.Admit(now, job.req))
        decode = self.sim.cfg.output_tokens * self.sim.cfg.costs.decode_token_s
        self.env.after(decode, self._release, job)

    def _release(self, job) -> None:
        if job.ended:  # cancelled while it decoded: its abort ended the life
            return
        job.ended = True
        self.sim.emit(ev.Release(self.env.now, job.req))
        self.sim.dispatch()
