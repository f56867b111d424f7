"""The options of `pdgpu serve` and `pdgpu generate` (specs/contract.md 'Serving runs' names)."""

from __future__ import annotations

import argparse

from pdgpu.cli_types import int_at_least as _int
from pdgpu.cli_types import positive_float as _positive
from pdgpu.decode_graph import GRAPH_MODES
from pdgpu.sampling import problem
from pdgpu.serve.config import DEBUG_BUGS
from pdref.events import Mode
from pdref.models import list_models


def add_parsers(sub) -> None:
    serve = _summary(sub, "serve", "a decoder and N producer processes serving requests")
    _model_args(serve)
    _serve_args(serve)
    gen = _summary(sub, "generate", "single-process reference, greedy or sampled (no handoff)")
    _model_args(gen)
    prompt = gen.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--tokens", help="prompt token ids, comma separated")
    prompt.add_argument("--prompts", help='JSONL: {"req", "tokens", "output_tokens"} per line, '
                        "generated one after another")
    gen.add_argument("--prefix-cache", action=argparse.BooleanOptionalAction, default=None,
                     help="with --prompts: through one producer's prefix cache (the tokens "
                     "do not change; it prints the prompt tokens computed). Default: on with "
                     "--prompts, off where it cannot apply (--tokens, --prefix); "
                     "--no-prefix-cache: off")
    gen.add_argument("--prefix-cache-pages", type=_int(1), metavar="N",
                     help="the cache's budget in pages (default: four of the longest prompt's, "
                     "room for a few conversations' prefixes; a hybrid's state snapshot counts "
                     "as the pages its bytes fill)")
    gen.add_argument("--output-tokens", type=_int(1), default=8, help="tokens to generate")
    gen.add_argument("--prefix", type=_int(0), default=0,
                     help="prefill the first P tokens as their own chunks (like a prefix cache)")
    gen.add_argument("--json", action="store_true", help='print {"output": [...], ...}')
    gen.add_argument("--eos-token", type=_int(0), help="stop after this token (default: none)")
    _sampling_args(gen)


SAMPLING_HELP = {
    "temperature": "0: greedy (default); > 0: sample", "top_p": "keep the most likely tokens "
    "whose mass reaches P (default 1)", "top_k": "keep the K most likely (0 or -1: all)",
    "min_p": "drop tokens below P x the top probability (default 0)",
    "seed": "the draw's seed (default 0; the served API draws one when a request has none)",
    "presence_penalty": "in [-2, 2], vLLM's", "frequency_penalty": "in [-2, 2], vLLM's",
    "repetition_penalty": "> 0, vLLM's (1: none)",
    "min_tokens": "ban the stop tokens before this many output tokens"}


def _sampling_args(p) -> None:
    """The sampling options, named and checked as the HTTP API's (pdgpu/sampling.py)."""
    group = p.add_argument_group("sampling (as the OpenAI API's fields; sampling.py)")
    for field, text in SAMPLING_HELP.items():
        flag = "--sample-seed" if field == "seed" else f"--{field.replace('_', '-')}"
        convert = int if field in ("top_k", "seed", "min_tokens") else float
        group.add_argument(flag, dest=f"sample_{field}", type=_sampling_type(field, convert),
                           help=text)
    group.add_argument("--ignore-eos", action="store_true",
                       help="--eos-token does not end the output")


def _sampling_type(field: str, convert):
    def parse(text: str):
        try:
            value = convert(text)
        except ValueError:
            kind = "an integer" if convert is int else "a number"
            raise argparse.ArgumentTypeError(f"must be {kind}, got {text!r}") from None
        found = problem(field, value)
        if found:
            raise argparse.ArgumentTypeError(found)
        return value
    return parse


def _summary(sub, name: str, text: str):
    """A subcommand whose own --help opens with the line `pdgpu --help` lists it by."""
    return sub.add_parser(name, help=text, description=text[0].upper() + text[1:] + ".")


def _model_args(p) -> None:
    p.add_argument("--model", default="tiny", help=f"preset ({', '.join(list_models())}), "
                   "profile .toml, or HF checkpoint folder")
    p.add_argument("--seed", type=_int(0), default=0, help="weights and drawn-prompt seed")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                   help="override the model's dtype (default: the model's own)")
    p.add_argument("--chunk", type=_int(1), default=64, help="prefill chunk tokens")
    p.add_argument("--page-tokens", type=_int(1), default=16, help="tokens per KV page")
    p.add_argument("--threads", type=_int(1), default=1, help="torch threads per process")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (serve: the "
                   "producers', or with --role this process's; cuda between processes: NCCL)")
    p.add_argument("--cuda-graphs", choices=GRAPH_MODES, default="auto",
                   help="replay the decode step as CUDA graphs: auto (default: where the "
                   "decoder is on CUDA), on (refused on CPU), off (eager)")


def _serve_args(p) -> None:
    p.add_argument("--mode", choices=tuple(map(str, Mode)), default="chunk", help="handoff mode")
    p.add_argument("--max-pending", type=_int(1), default=2, help="spans in flight per producer")
    p.add_argument("--pool-pages", type=_int(1), help="decoder handoff pool pages (default: "
                   "the slabs of the workload's largest concurrent requests)")
    p.add_argument("--link-gbps", type=_positive, help="pace each span to this many GB/s "
                   "(default: unpaced)")
    p.add_argument("--decoder-device", help="the decoder's device in a local run (default: "
                   "--device; NCCL needs the decoder on another GPU than the producers)")
    p.add_argument("--producers", type=_int(1), default=1, help="producer processes")
    p.add_argument("--requests", type=_int(1), default=4, help="requests to draw")
    load = p.add_mutually_exclusive_group()
    load.add_argument("--rate", type=_positive, help="Poisson arrivals per second")
    load.add_argument("--concurrency", type=_int(1),
                      help="closed loop: requests in the system at once (default: all)")
    p.add_argument("--prompt-range", default="64:128", help="drawn prompt lengths A:B")
    p.add_argument("--output-tokens", type=_int(1), default=8, help="tokens per request")
    p.add_argument("--eos-token", type=_int(0),
                   help="a request also ends after this token (default: none)")
    p.add_argument("--prefix", type=_int(0), default=0, help="shared prompt prefix tokens")
    p.add_argument("--prefix-cache", action=argparse.BooleanOptionalAction, default=None,
                   help="each producer caches whole pages of the prompts it computed and skips "
                   "computing them for a later request with the same leading tokens, and the "
                   "decoder keeps whole pages of its pool that need not cross again; tokens "
                   "are unchanged. Default: on where it applies, off (said in the summary and "
                   "the trace header) with --prefix and in layer mode for a model with linear "
                   "layers, where --prefix-cache is refused; --no-prefix-cache: off")
    p.add_argument("--prefix-cache-pages", type=_int(1), metavar="N", help="each producer's "
                   "cache budget in pages of its source cache (default: four of the longest "
                   "prompt's pages, beside the room for two requests in flight: a few "
                   "conversations' or system prompts' prefixes; a hybrid's state snapshot "
                   "counts as the pages its bytes fill)")
    p.add_argument("--decoder-cache-pages", type=_int(1), metavar="N", help="the decoder's "
                   "cache budget in pages of its pool (default: the pool's pages: idle cached "
                   "pages go back to the pool when a request needs room, so the cache takes "
                   "no memory a request would get)")
    p.add_argument("--prompts", help='JSONL: {"req", "tokens", "output_tokens"} per line')
    p.add_argument("--results", help="write one JSON line per request here")
    p.add_argument("--trace", help="write the run's version-2 trace here")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    p.add_argument("--verify", action=argparse.BooleanOptionalAction, default=True,
                   help="check each landed span against compute-time checksums (default: on; "
                   "--no-verify: off)")
    p.add_argument("--kv-lane", choices=("shm", "gloo", "nixl"), default="shm", type=_kv_lane,
                   help="how KV crosses between processes on one machine: shm (shared "
                   "memory; page-locked on one GPU) or gloo (TCP); two GPUs: NCCL either way; "
                   "nixl: NVIDIA NIXL on any devices (the optional extra nixl)")
    tries = p.add_mutually_exclusive_group()
    tries.add_argument("--max-attempts", type=_int(1), help="lives per request before it is "
                       "failed (a cancel is not retried; default 3)")
    tries.add_argument("--retries", type=_int(0), help="retries after a failed life "
                       "(= --max-attempts minus 1)")
    p.add_argument("--debug", choices=tuple(DEBUG_BUGS), help="a hand-made copy bug")
    p.add_argument("--no-kv-progress", dest="kv_progress", action="store_false",
                   help="producers announce no kv_progress (they can serve whole mode only)")
    p.add_argument("--no-progress", dest="progress", action="store_false", default=None,
                   help="no progress bar or lines (default: a bar on a terminal, else a "
                   "line every --progress-every seconds)")
    p.add_argument("--progress-every", type=_positive, default=10.0, metavar="S",
                   help="seconds between progress lines when stderr is not a terminal")
    p.add_argument("--init-method", help="tcp://HOST:PORT of the rendezvous (default: "
                   "a free port here)")
    p.add_argument("--role", choices=("decoder", "producer"),
                   help="run one role of a multi-machine run (with --rank, --world-size)")
    p.add_argument("--rank", type=_int(0), help="this role's rank (decoder: 0)")
    p.add_argument("--world-size", type=_int(2), help="decoder + producers")
    p.add_argument("--connect-timeout", type=_positive, default=60.0,
                   help="seconds to wait for every rank")
    _http_args(p)
    _fault_args(p)


def _http_args(p) -> None:
    """`--http`: requests over an OpenAI-compatible API instead of a workload (http_run.py)."""
    g = p.add_argument_group("HTTP front end (pip install 'pdhandoff[http]')")
    g.add_argument("--http", metavar="HOST:PORT", help="serve POST /v1/completions, "
                   "/v1/chat/completions, GET /v1/models, /health, /metrics until SIGINT or "
                   "SIGTERM (port 0: a free one; default: off, the batch mode)")
    g.add_argument("--http-queue", type=_int(1), default=64, help="requests in the system at "
                   "once (queued or served); beyond it: 429")
    g.add_argument("--http-max-prompt", type=_int(1), default=1024,
                   help="longest prompt in tokens (sizes the pool and caches); beyond: 400")
    g.add_argument("--http-drain", type=_positive, default=30.0, help="seconds requests in "
                   "flight may take to finish after SIGINT/SIGTERM before they are cancelled")


def _kv_lane(value: str) -> str:
    """`nixl` without the NIXL package is refused here, in one line (exit 2)."""
    if value == "nixl":
        from pdgpu.serve.transport_nixl import nixl_missing
        why = nixl_missing()
        if why is not None:
            raise argparse.ArgumentTypeError(why)
    return value


def _fault_args(p) -> None:
    """The fault options every shell shares (specs/contract.md, 'Faults'); checked in
    pdgpu.serve_cli so a bad value is one line naming it."""
    g = p.add_argument_group("faults (seeded by --seed; pdgpu/serve/faults.py)")
    g.add_argument("--span-timeout", type=float, help="a span not landed this many seconds "
                   "after its issue fails (default: no deadline)")
    g.add_argument("--fail-rate", type=float, default=0.0, help="chance a span's copy fails")
    g.add_argument("--stall-rate", type=float, default=0.0, help="chance a span's writer "
                   "hangs until its deadline (needs --span-timeout)")
    g.add_argument("--corrupt-rate", type=float, default=0.0, help="chance a span's bytes "
                   "are altered in transit (refused with --no-verify: --verify fails the span)")
    g.add_argument("--cancel-rate", type=float, default=0.0, help="chance a request is "
                   "cancelled, after a drawn number of its steps (any phase)")
    g.add_argument("--kill-producer", action="append", default=[], metavar="I@SECONDS",
                   help="SIGKILL producer index I (from 0: rank I+1, named pI+1 in the logs "
                   "and trace) SECONDS after t = 0 (repeatable; default: none)")
    g.add_argument("--restart-producers", action="store_true",
                   help="respawn a dead producer; it rejoins with a new handshake")
    g.add_argument("--heartbeat-timeout", type=float, default=5.0,
                   help="seconds of silence after which a producer is declared dead")
