"""Multi-turn chat sessions over `pdgpu serve --http`, the prefix cache on and off side by side
(issue 35 item 5).

`--sessions` conversations of `--turns` requests each share a `--system-prompt`; turn k's
prompt is the system prompt, every earlier turn's user tokens and answer, and its own user
tokens (`--turn-tokens A:B`), sent as token ids to /v1/completions (streamed, greedy,
`--output-tokens` each, `ignore_eos`); the next turn goes its think time (exponential, mean
`--think`) after the answer's last token; sessions start at `--rate` (Poisson). The lengths,
think times and starts are pdsim's `SessionSpec` for the same options and `--seed`
(pdsim/core/sessions.py), so `pdsim run --sessions ...` plays this very workload; the token
ids are drawn here from the same seed.

Each `--cache` setting (off: `--no-prefix-cache`; on: `--prefix-cache`; default: neither
flag, which is on) gets its own server (`pdgpu serve --http 127.0.0.1:0`, a port of its
own) and the same sessions, in the order given. Per setting:
TTFT p50/p99 (send to first token), output tokens/s (from the first session's start to the
last token), bytes handed off (the KV its spans carried: the trace's `issue` events), the
decoder's hit rate (its reserves' prefixes over the prompt tokens, from the trace), the
prefix cache's hit rate (/metrics: vllm:prefix_cache_hits / vllm:prefix_cache_queries, in
tokens: prompt tokens the producers did not compute), the usages' cached_tokens summed, and
the server's leaked pages; and whether every answer equals the first setting's (greedy: a
cache hit must not change a token).

    python bench/multiturn.py                               # small, 8 sessions x 3 turns, off,on
    python bench/multiturn.py --sessions 32 --turns 4 --system-prompt 1024 \\
        --turn-tokens 64:256 --output-tokens 128 --think 2 --rate 2 --json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import attrs
import httpx

from pdgpu.serve.report import percentile
from pdsim.arg_types import int_range
from pdsim.core.sessions import SessionSpec, SessionWorkload
from pdsim.core.workload_rules import WorkloadError
from pdsim.fit.host_load import HostLoadMonitor, host_load_measurable

# `pdgpu serve` flags of each cache setting: "on" is the producers' and the decoder's prefix
# caches at their default budgets; "default" is no cache flag at all (on since issue 35).
CACHE_FLAGS: dict[str, tuple[str, ...]] = {"off": ("--no-prefix-cache",),
                                           "on": ("--prefix-cache",), "default": ()}
HITS, QUERIES = "vllm:prefix_cache_hits", "vllm:prefix_cache_queries"
NAMES = ("requests", "ok", "errors", "ttft_p50_s", "ttft_p99_s", "tokens_per_s",
         "bytes_handed_off", "decoder_hit_rate", "prefix_cache_hit_rate", "cached_tokens",
         "leaked_pages")


@attrs.frozen
class Turn:
    req: str
    user: tuple[int, ...]  # the turn's new user tokens
    output: int  # answer tokens asked
    think_s: float  # wait after the previous turn's answer (the first turn: 0)
    prompt: int  # its prompt's length (pdsim's RequestSpec.prompt)


@attrs.frozen
class Session:
    start: float  # seconds after the run's start
    turns: tuple[Turn, ...]


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="small", help="pdgpu serve's --model (preset or folder)")
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--system-prompt", type=int, default=256, help="shared leading tokens")
    p.add_argument("--turn-tokens", type=int_range, default=(32, 96), help="user tokens A:B")
    p.add_argument("--output-tokens", type=int, default=16, help="answer tokens per turn")
    p.add_argument("--think", type=float, default=2.0, help="mean think time, seconds")
    p.add_argument("--rate", type=float, default=0.5, help="session starts per second")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--producers", type=int, default=1)
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--cache", default="off,on",
                   help=f"comma-separated settings, each served in turn ({', '.join(CACHE_FLAGS)})")
    p.add_argument("--trace-dir", type=Path, help="keep each setting's trace here (<cache>.jsonl)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    _check(p, args)
    return args


def _check(p, args) -> None:
    """Each option within its rule: one line naming it, exit 2."""
    try:
        spec(args).check()
    except WorkloadError as e:
        p.error(str(e))
    for name in ("output_tokens", "producers", "chunk"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.trace_dir is not None and not args.trace_dir.is_dir():
        p.error(f"--trace-dir: {args.trace_dir} is not an existing folder")
    settings = args.cache.split(",")
    unknown = [s for s in settings if s not in CACHE_FLAGS]
    if unknown or len(set(settings)) != len(settings):
        p.error(f"--cache must be distinct settings of {', '.join(CACHE_FLAGS)}, got "
                f"{args.cache!r}")
    args.cache = settings


def spec(args) -> SessionSpec:
    out = (args.output_tokens, args.output_tokens)
    return SessionSpec(args.sessions, args.turns, args.system_prompt, args.turn_tokens, out,
                       args.think, args.rate, 0.0, args.seed)


def build_sessions(session_spec: SessionSpec, vocab: int) -> tuple[tuple[int, ...], list]:
    """The system prompt's token ids and the sessions: pdsim's lengths, think times and
    starts for `session_spec`, token ids drawn uniformly from the vocabulary."""
    work = SessionWorkload(session_spec)
    rng = random.Random(session_spec.seed)
    system = tuple(rng.randrange(vocab) for _ in range(session_spec.system))
    thinks = {turn.req: think for think, turn in work.followups.values()}
    by_session: dict[str, list] = {}
    for request in work.all_turns():
        by_session.setdefault(request.session, []).append(request)
    sessions = []
    for requests in by_session.values():
        turns, history = [], session_spec.system
        for r in requests:  # each prompt: the one before, its answer, new user tokens
            user = tuple(rng.randrange(vocab) for _ in range(r.prompt - history))
            turns.append(Turn(r.req, user, r.output_tokens, thinks.get(r.req, 0.0), r.prompt))
            history = r.prompt + r.output_tokens
        sessions.append(Session(requests[0].arrival, tuple(turns)))
    return system, sessions


# -- the client ----------------------------------------------------------------------------

async def _turn(client, url: str, model: str, prompt: list[int], turn: Turn) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": turn.output, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    result = {"req": turn.req, "prompt": len(prompt), "sent": time.perf_counter(),
              "first": None, "end": None, "tokens": [], "usage": None, "error": None}
    try:
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                result["error"] = f"{r.status_code}: {(await r.aread())[:200]!r}"
            async for line in r.aiter_lines():
                _event(result, line)
    except httpx.HTTPError as e:
        result["error"] = f"{type(e).__name__}: {e}"
    if result["error"] is None and len(result["tokens"]) != turn.output:
        result["error"] = f"{len(result['tokens'])} tokens, asked {turn.output}"
    return result


def _event(result: dict, line: str) -> None:
    """One server-sent event of a streamed completion, into `result`."""
    if not line.startswith("data: {"):
        return
    event = json.loads(line[6:])
    if "error" in event:
        result["error"] = str(event["error"].get("message"))
    if event.get("usage"):
        result["usage"] = event["usage"]
    ids = [t for choice in event.get("choices", ()) for t in choice.get("token_ids", ())]
    if ids:
        now = time.perf_counter()
        result["first"] = result["first"] or now
        result["end"] = now
        result["tokens"] += ids


async def _session(client, url, model, system, session: Session, t0: float, out: list):
    await asyncio.sleep(max(0.0, t0 + session.start - time.perf_counter()))
    history = list(system)
    for turn in session.turns:
        await asyncio.sleep(turn.think_s)
        prompt = history + list(turn.user)
        result = await _turn(client, url, model, prompt, turn)
        out.append(result)
        if result["error"] is not None:
            return  # the next turn needs this answer
        history = prompt + result["tokens"]


async def drive(url: str, model: str, system, sessions: list[Session]) -> tuple[list, float]:
    """Every session against the server at `url`; each turn's result and the start time."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    out: list[dict] = []
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        t0 = time.perf_counter() + 0.2  # every task scheduled before the first start
        await asyncio.gather(*(_session(client, f"{url}/v1/completions", model, system, s,
                                        t0, out) for s in sessions))
    return out, t0


# -- the server ----------------------------------------------------------------------------

class Server:
    """`pdgpu serve --http 127.0.0.1:0` as a subprocess; its port from its stderr."""

    def __init__(self, args, setting: str, longest: int, trace: Path) -> None:
        cmd = [sys.executable, "-m", "pdgpu", "serve", "--http", "127.0.0.1:0", "--model",
               args.model, "--producers", str(args.producers), "--chunk", str(args.chunk),
               "--http-max-prompt", str(longest), "--http-queue", str(4 * args.sessions),
               "--trace", str(trace), "--json", "--no-progress", *CACHE_FLAGS[setting]]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True)
        self.port, self.stderr = None, []
        found = threading.Event()
        self.reader = threading.Thread(target=self._read, args=(found,), daemon=True)
        self.reader.start()
        found.wait(300)
        if self.port is None:
            self.proc.wait(60)
            raise SystemExit(f"multiturn: pdgpu serve did not start (exit "
                             f"{self.proc.returncode}): {''.join(self.stderr[-3:])}")
        self.url = f"http://127.0.0.1:{self.port}"
        with httpx.Client() as http:  # one client: a new one loads the CA bundle each poll
            while http.get(f"{self.url}/health").status_code != 200:
                time.sleep(0.1)

    def _read(self, found: threading.Event) -> None:
        for line in self.proc.stderr:
            self.stderr.append(line)
            match = re.search(r"http://127\.0\.0\.1:(\d+)/v1", line)
            if match and self.port is None:
                self.port = int(match.group(1))
                found.set()
        found.set()

    def counters(self) -> dict[str, float]:
        """The prefix cache's counters on /metrics (none: the server has no cache)."""
        from prometheus_client.parser import text_string_to_metric_families
        text = httpx.get(f"{self.url}/metrics").text
        return {f.name: sum(s.value for s in f.samples if s.name.endswith("_total"))
                for f in text_string_to_metric_families(text) if f.name in (HITS, QUERIES)}

    def stop(self) -> dict:
        """SIGTERM (the drain); the server's summary."""
        self.proc.send_signal(signal.SIGTERM)
        out, _ = self.proc.communicate(timeout=300)
        self.reader.join(10)
        lines = [line for line in out.splitlines() if line.startswith("{")]
        if not lines:
            raise SystemExit(f"multiturn: pdgpu serve printed no summary (exit "
                             f"{self.proc.returncode}): {''.join(self.stderr[-3:])}")
        return json.loads(lines[-1])


# -- one setting, and the report -----------------------------------------------------------

def serve_setting(args, setting: str, system, sessions: list[Session], folder: Path) -> dict:
    """One server for `setting`, every session against it; the setting's figures, each
    turn's, and the host load other work put on this machine while the sessions ran."""
    longest = max(t.prompt for s in sessions for t in s.turns)
    trace = folder / f"{setting}.jsonl"
    monitor = HostLoadMonitor().start() if host_load_measurable() else None
    try:
        server = Server(args, setting, longest, trace)
        if monitor is not None:
            monitor.root = server.proc.pid  # its tree is the run's, not "other work"
        try:
            model = httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
            start = time.time()
            results, t0 = asyncio.run(drive(server.url, model, system, sessions))
            end = time.time()
            counters = server.counters()
        finally:
            summary = server.stop()
    finally:
        if monitor is not None:
            monitor.stop()
    load = monitor.window(start, end).to_json() if monitor is not None else None
    return {"setting": setting, **summarize(results, t0, counters, summary),
            **_handoff(trace_figures(trace)), "host_load": load,
            "turns": sorted(results, key=lambda r: r["sent"])}


def trace_figures(trace: Path) -> dict:
    """The run's cache and bytes figures, read from its trace: the decoder's hit rate
    (`reserve` `prefix` over prompt tokens: pdsim's `prefix_cache_hit_rate`), the producers'
    hit tokens (`computed` `hit`), the prompt tokens they computed (`computed` without a hit,
    every layer), the KV bytes its spans carried (`issue`: pdsim's `bytes`),
    the pool and the caches' budgets (header)."""
    prompt = prefix = producer = handed = 0
    with trace.open() as f:
        header = json.loads(f.readline())
        page_tokens, layers = header["geometry"]["page_tokens"], header["geometry"]["layers"]
        computed = 0.0  # token-layers computed
        for line in f:
            e = json.loads(line)
            kind = e["kind"]
            if kind == "reserve":
                prompt, prefix = prompt + e["prompt"], prefix + e["prefix"]
            elif kind == "computed" and e.get("hit"):
                producer += len(e["hit"]) * page_tokens
            elif kind == "computed":
                computed += (e["tokens"][1] - e["tokens"][0]) * (e["layers"][1] - e["layers"][0])
            elif kind == "issue":
                handed += e["bytes"]
    return {"prefix_cache_hit_rate": prefix / prompt if prompt else 0.0,
            "producer_prefix_cache_hits": producer, "bytes": handed,
            "computed_tokens": round(computed / layers),
            "pool_pages": header["pool_pages"],
            "producer_cache_pages": header.get("prefix_cache_pages", 0),
            "decoder_cache_pages": header.get("decoder_cache_pages", 0)}


def _handoff(figures: dict) -> dict:
    return {"bytes_handed_off": figures["bytes"],
            "decoder_hit_rate": figures["prefix_cache_hit_rate"]}


def summarize(results: list[dict], t0: float, counters: dict, server: dict) -> dict:
    ok = [r for r in results if r["error"] is None]
    ttft = [r["first"] - r["sent"] for r in ok]
    wall = max((r["end"] for r in ok), default=t0) - t0
    tokens = sum(len(r["tokens"]) for r in ok)
    cached = [(r["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
              for r in ok if r["usage"]]
    queries = counters.get(QUERIES)
    return {"requests": len(results), "ok": len(ok), "errors": len(results) - len(ok),
            "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
            "tokens_per_s": tokens / wall if wall > 0 else None, "output_tokens": tokens,
            "prefix_cache_queries": queries, "prefix_cache_hits": counters.get(HITS),
            "prefix_cache_hit_rate": counters[HITS] / queries if queries else None,
            "cached_tokens": sum(cached) if cached and None not in cached else None,
            "leaked_pages": server.get("leaked_pages"), "server_ok": server.get("ok"),
            "server_failed": server.get("failed"), "wall_s": wall}


def same_answers(runs: list[dict]) -> bool:
    """Every setting's answers equal the first setting's, turn by turn."""
    answers = [{r["req"]: r["tokens"] for r in run["turns"]} for run in runs]
    return all(a == answers[0] for a in answers[1:])


def main(argv=None) -> int:
    args = _parse(argv)
    from pdgpu.serve.models import model_spec
    system, sessions = build_sessions(spec(args), model_spec(args.model, None).vocab)
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.trace_dir or Path(tmp)
        runs = [serve_setting(args, setting, system, sessions, folder) for setting in args.cache]
    options = {k: v for k, v in vars(args).items() if k not in ("cache", "trace_dir", "json")}
    report = {"options": options, "runs": runs, "same_answers": same_answers(runs)}
    _print(args, report)
    return 1 if any(r["errors"] or r["server_failed"] or r["leaked_pages"] for r in runs) \
        or not report["same_answers"] else 0


def _print(args, report: dict) -> None:
    if args.json:
        print(json.dumps(report))
        return
    print(f"{args.model}: {args.sessions} sessions x {args.turns} turns, system prompt "
          f"{args.system_prompt}, user {args.turn_tokens[0]}:{args.turn_tokens[1]}, "
          f"{args.output_tokens} out, think {args.think} s, {args.rate} sessions/s")
    print(f"{'cache':>6} " + " ".join(f"{n[:12]:>12}" for n in NAMES))
    for run in report["runs"]:
        cells = [_cell(run.get(n)) for n in NAMES]
        print(f"{run['setting']:>6} " + " ".join(f"{c:>12}" for c in cells))
    print(f"answers equal across settings: {report['same_answers']}")


def _cell(value) -> str:
    if value is None:
        return "-"
    return f"{value:.4f}" if isinstance(value, float) else str(value)


if __name__ == "__main__":
    sys.exit(main())
