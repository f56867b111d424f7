"""The decoder, as `pdgpu serve`'s loop runs it (pdgpu/serve/decoder.py): a continuous batch.

Between decode steps the decoder handles what reached it while the step ran (spans' lands,
first tokens, arrivals: `deliver`), admits every request pdref allows, reserves slabs for
waiting requests (`Sim.dispatch`), then runs one batched decode step for every running
request: one heap event per step at most, whatever the batch (none when the step ends
before every other pending event). A step over `batch` requests that
read `kv_tokens` KV tokens in all, `window_tokens` of them on sliding layers (each row's
min(context, window): what it holds there), takes

    decode_base_s(batch) + kv_tokens * decode_kv_token_s
                         + window_tokens * decode_window_token_s

(pdsim/core/costs.py: under a linear engine decode_s + batch * decode_row_s, its `[compute]`
terms or derived from the model and device; under a roofline engine its GEMMs' roofline at
M = batch plus the step's overheads, pdsim/core/roofline.py).
A request's first output token is its producer's (`produced`); each step gives every running
request one more and its KV one more token; it is released at its output-token count, its
slab back to the pool. The generated tokens' KV lives in the decoder's own decode cache
(pdgpu: a tensor of prompt + output tokens per request), not in the handoff pool, which
holds slabs only: the pool's occupancy does not grow while a request decodes.
Steps are recorded (DecodeRecord, decode_record.py), not emitted one by one: they are no
protocol event, and at batch 1 one per token would double a run's events. The trace writer
adds them as the contract's `decode` stages, in time order (`pdref check` checks them there).
"""

from __future__ import annotations

from collections import defaultdict

from pdref import events as ev
from pdsim.core.decode_record import DecodeRecord
from pdsim.core.decode_window import WindowedKV

__all__ = ["DecodeRecord", "Decoder"]


class Decoder:
    """One decoder: its admissions, its batch, and the messages waiting for a step's end."""

    def __init__(self, env, sim) -> None:
        self.env, self.sim = env, sim
        costs = sim.cfg.costs
        self.kv_s = costs.decode_kv_token_s
        self.base_of = costs.decode_base_s  # a step's time less its KV read, by batch
        self.bases: dict[int, float] = {}  # batch -> base_of(batch) (a run's batches repeat)
        self.gap_s = costs.decode_gap_s  # the loop's own time between two steps
        self.land_byte_s, self.admit_byte_s = costs.land_byte_s, costs.admit_byte_s
        self.admit_bytes = sim.cfg.geometry.bytes_per_token  # KV bytes a prompt token copies
        self.record = DecodeRecord()
        self.first_token: dict[str, float] = {}  # req -> its latest life's `produced` time
        self.admitted: set[str] = set()
        self.running = 0  # requests in the batch
        self.kv_tokens = 0  # KV tokens they hold: prompt + tokens decoded so far, each
        # (v3) the batch's KV on sliding layers (None: none priced)
        self.win_s = costs.decode_window_token_s
        self.windowed = WindowedKV(costs.window) if self.win_s and costs.window else None
        self.next_step = 0  # index of the next decode step
        self.finishing: dict[int, list] = defaultdict(list)  # step index -> jobs ending there
        self.stepping = False  # busy: a decode step, or handling what reached it, runs now
        self.step_running = False  # a decode step runs now
        self.waking = False  # the loop runs again at this instant
        self.debt = 0.0  # handling work done at this boundary, not yet paid in time
        self.inbox: list = []  # (callback, args) that reached the decoder during a step
        self.last_req = ""  # the req a decode stage names (its req need not be live)

    # -- the loop's boundaries ------------------------------------------------------------------

    def deliver(self, callback, *args) -> None:
        """A message reaches the decoder: handled now, or when the running step ends."""
        if self.stepping:
            self.inbox.append((callback, args))
        else:
            callback(*args)

    def produced(self, job) -> None:
        """The request's first token (its producer's), as the decoder receives it."""
        now = self.env.now
        self.sim.emit(ev.Produced(now, job.req, 0))
        self.first_token[job.req] = now
        self.try_admit(job)

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
        job.owner.free_source(job)
        caches = self.sim.caches
        if caches is not None:  # its producer's pages let go, its slab's whole pages kept
            caches.reused(job.owner.name, job)
            caches.publish_decoder(job)
        if self.admit_byte_s:  # its context KV copied into its decode cache
            self.charge(self.admit_byte_s * self.admit_bytes * job.request.prompt)
        steps = max(self.sim.output_tokens(job.request) - 1, 0)  # the first came at produced
        self.record.tokens[job.req] = (self.first_token.get(job.req, now), self.next_step,
                                       steps)
        if not steps:
            self._release(job)
            return
        job.decode_last = self.next_step + steps - 1
        self.finishing[job.decode_last].append(job)
        self.running += 1
        self.kv_tokens += job.request.prompt
        if self.windowed is not None:
            self.windowed.hold(job.request.prompt, self.next_step)
        self.last_req = job.req
        self._wake()

    def charge(self, seconds: float) -> None:
        """Handling work of the decoder (writing a landed span, copying an admitted context):
        it is busy that much longer before its next step."""
        self.debt += seconds
        self._wake()

    def _wake(self) -> None:
        """An idle decoder runs its loop at this instant, after the instant's other events
        (pdgpu's idle loop handles every message waiting before it decodes)."""
        if not self.stepping and not self.waking:
            self.waking = True
            self.env.at(self.env.now, self._run)

    # -- one decode step --------------------------------------------------------------------------

    def _run(self) -> None:
        """The loop: pay the handling work, then run steps while requests are running. Work
        that ends before any other pending event ends at once, here (nothing can happen
        meanwhile: no heap round trip)."""
        env = self.env
        settled = False  # a step ended here and what reached the decoder since was handled
        while True:
            self.waking = False
            if self.debt > 0:
                if not self._pay_debt():
                    return
                continue
            if not self.running:
                self.stepping = False
                return
            if settled and self.sim.cores is None:
                self._quiet_steps()
            batch, end = self._begin_step()
            if self.sim.cores is not None:  # shared host cores: its end depends on others
                self.sim.cores.start(end - env.now, self._end_step, batch)
                return
            if not env.take(end):
                env.at(end, self._end_step, batch)
                return
            self._step_done(batch)
            settled = True

    def _quiet_steps(self) -> None:
        """Run, in one tight loop, the steps that change nothing but the batch's KV: each
        ends (its gap too) before every pending event and no request finishes in it. The
        loop above would run each the same way (same times, same records) and find nothing
        to handle between them: nothing reached the decoder, and the queue's head could not
        be reserved after the last step (the pool has not changed since)."""
        env, record, finishing = self.env, self.record, self.finishing
        next_t = env.next_time()
        kv_s, gap = self.kv_s, self.gap_s
        batch, kv, step, now, label = (self.running, self.kv_tokens, self.next_step, env.now,
                                       self.last_req)
        starts, ends = record.step_start, record.step_end
        first = step
        stop = min(finishing, default=float("inf"))  # the next step a request finishes in
        win = self.windowed  # (a row's context reaching the window ends the run too)
        windowed, widening, win_s = (0, 0, 0.0) if win is None else (win.tokens, win.widening,
                                                                     self.win_s)
        if win is not None and win.filling:
            stop = min(stop, min(win.filling))
        base = self._base(batch)
        add_start, add_end = starts.append, ends.append
        while step < stop:
            end = now + base + kv * kv_s + windowed * win_s
            until = end + gap  # the loop's gap is paid after the step (+ 0.0: end itself)
            if until >= next_t:
                break
            add_start(now)
            add_end(end)
            kv += batch
            windowed += widening
            step += 1
            now = until
        done = step - first
        if done:
            record.add_run(done, batch, self.kv_tokens, label)
            env.now, self.kv_tokens, self.next_step = now, kv, step
            if win is not None:
                win.tokens = windowed
            env.steps += done * (2 if gap > 0 else 1)  # a step's end, and its gap's

    def _pay_debt(self) -> bool:
        """Busy with the handling work owed (what arrives meanwhile waits); True when it
        ended here, False when its end is on the heap."""
        until, self.debt = self.env.now + self.debt, 0.0
        self.stepping = True
        if not self.env.take(until):
            self.env.at(until, self._handled)
            return False
        self._between()
        return True

    def _begin_step(self) -> tuple[int, float]:
        """Start a step of every running request; (its batch, its end)."""
        record, now, batch, kv = self.record, self.env.now, self.running, self.kv_tokens
        record.step_start.append(now)
        record.add_run(1, batch, kv, self.last_req)
        self.stepping = self.step_running = True
        self.next_step += 1
        end = now + self._base(batch) + kv * self.kv_s
        if self.windowed is not None:
            end += self.windowed.tokens * self.win_s
        return batch, end

    def _base(self, batch: int) -> float:
        """A step of `batch` rows less its KV read (Costs.decode_base_s), once per batch."""
        base = self.bases.get(batch)
        if base is None:
            base = self.bases[batch] = self.base_of(batch)
        return base

    def _handled(self) -> None:
        self._between()
        self._run()

    def _end_step(self, batch: int) -> None:
        self._step_done(batch)
        self._run()

    def _step_done(self, batch: int) -> None:
        """A step ended: every request of it has one more token, the finished ones are
        released; the loop's own time between steps is owed; then what arrived meanwhile."""
        self.step_running = False
        self.record.step_end.append(self.env.now)
        self.kv_tokens += batch
        if self.windowed is not None:
            self.windowed.step_done(self.next_step - 1)
        done = self.finishing.pop(self.next_step - 1, None)
        if done:
            first = self.record.tokens
            for job in done:
                self.running -= 1
                context = job.request.prompt + self.next_step - first[job.req][1]
                self.kv_tokens -= context
                if self.windowed is not None:
                    self.windowed.let_go(context, first[job.req][1], job.request.prompt)
                self._release(job)
        self.debt += self.gap_s
        self._between()

    def _between(self) -> None:
        """Between steps: handle what reached the decoder meanwhile, reserve slabs."""
        self.stepping, self.waking = False, True  # the caller runs the loop on itself
        if self.inbox:
            inbox, self.inbox = self.inbox, []
            for callback, args in inbox:
                callback(*args)
        if self.sim.queue:
            self.sim.dispatch()

    def drop(self, job) -> None:
        """A running request was cancelled (faults): it leaves the batch now."""
        last = job.decode_last
        if last is None or job not in self.finishing.get(last, ()):
            return
        self.finishing[last].remove(job)
        first = self.record.tokens[job.req][1]
        in_step = self.step_running and first < self.next_step  # the running step has it
        done = self.next_step - first - (1 if in_step else 0)  # its steps that ended
        # the running step still adds one token per request of its batch at its end
        self.kv_tokens -= job.request.prompt + done + (1 if in_step else 0)
        if self.windowed is not None:  # the running step's end widens only the rows left
            self.windowed.let_go(job.request.prompt + done, first, job.request.prompt)
        self.running -= 1

    def _release(self, job) -> None:
        if job.ended:  # cancelled while it decoded: its abort ended the life
            return
        job.ended = True
        self.sim.emit(ev.Release(self.env.now, job.req))
        if self.sim.caches is not None:
            self.sim.caches.released(job)
        self.sim.released(job)
