"""`pdgpu run` and `pdgpu compare`: the engine on the command line.

Exit codes: 0 ok; 1 a protocol violation or a parity failure; 2 bad input (one line on stderr
naming the field and the rule; nothing allocated, nothing written).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from pdgpu import interrupt, serve_cli
from pdgpu.arch import arch_of
from pdgpu.audit import Disagreement
from pdgpu.checkpoint import CheckpointError, load_checkpoint
from pdgpu.cli_types import int_at_least, positive_float
from pdgpu.compare import compare_modes, compare_table
from pdgpu.engine import Engine, EngineError, RunResult
from pdgpu.handoff import handoff_geometry, unshipped_state
from pdgpu.model import build_model
from pdgpu.serve.models import model_spec
from pdgpu.workload import DEBUG_BREAKS, EngineConfig, Request, WorkloadError, setup_check
from pdref.check import check_lines
from pdref.cli_format import DefaultsFormatter, format_metrics
from pdref.events import event_to_json, header_to_json
from pdref.models import ModelSpec, ProfileError, context_error, list_models
from pdref.trace import TraceWriter, dumps
from pdref.violations import Violation

METRIC_ORDER = ("mode", "prompt", "prefix", "chunk", "max_pending", "bytes", "spans",
                "prefill_s", "handoff_s", "tail_s", "peak_staging_bytes", "first_token")


class BadInput(Exception):
    """Bad command-line input: one line, exit 2."""


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are BadInput (one line, exit 2); help shows every default."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", DefaultsFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        raise BadInput(message)


def _workload_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny", help=f"preset ({', '.join(list_models())}), "
                   "profile .toml, or HF checkpoint folder")
    p.add_argument("--prompt", type=int_at_least(1),
                   help="prompt tokens (default: 256 random ids, or as many as --tokens gives)")
    p.add_argument("--prefix", type=int_at_least(0), default=0,
                   help="tokens the decoder already holds")
    p.add_argument("--chunk", type=int_at_least(1), default=64, help="prefill chunk tokens")
    p.add_argument("--max-pending", type=int_at_least(1), default=2, help="spans in flight at most")
    p.add_argument("--page-tokens", type=int_at_least(1), default=16, help="tokens per KV page")
    p.add_argument("--seed", type=int_at_least(0), default=0, help="weights and random prompt seed")
    p.add_argument("--device", default=None, help="producer device (default cuda if any)")
    p.add_argument("--decoder-device", default=None,
                   help="decoder device (default: cuda:1 with two GPUs, else cpu)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                   help="override the model's dtype (default: the model's own)")
    p.add_argument("--tokens", help="prompt token ids, comma separated")
    p.add_argument("--tokens-file", help="file of prompt token ids (whitespace or commas)")
    p.add_argument("--pool-pages", type=int_at_least(1),
                   help="decoder pool pages (default: just enough for one request)")
    p.add_argument("--link-gbps", type=positive_float,
                   help="pace each direction of the link (d2h, h2d) to this many GB/s, "
                        "1e9 bytes/s (default: unpaced)")
    p.add_argument("--fail-span", type=int_at_least(0),
                   help="make the copy of this span id fail (default: none fails)")
    p.add_argument("--retries", type=int_at_least(0), default=2, help="retries after a failed copy")
    p.add_argument("--requests", type=int_at_least(1), default=1,
                   help="serve the prompt this many times back to back (metrics: the last one)")
    p.add_argument("--threads", type=int_at_least(1),
                   help="torch compute threads (default: one core fewer than the machine)")
    p.add_argument("--no-warmup", dest="warmup", action="store_false",
                   help="no warm-up before t = 0: the first request runs on cold buffers")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _summary(sub, name: str, text: str) -> argparse.ArgumentParser:
    """A subcommand whose own --help opens with the line `pdgpu --help` lists it by."""
    return sub.add_parser(name, help=text, description=text[0].upper() + text[1:] + ".")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="pdgpu", description="KV handoff engine, checked live by pdref")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    run = _summary(sub, "run", "run one workload in one mode")
    _workload_args(run)
    run.add_argument("--mode", choices=("whole", "chunk", "layer"), default="chunk",
                     help="handoff: whole = one copy after prefill, chunk = a copy per prefill "
                          "chunk, layer = a copy per layer")
    run.add_argument("--trace", help="write the run's JSONL trace here (specs/contract.md)")
    run.add_argument("--debug", choices=tuple(DEBUG_BREAKS), help="break the protocol on purpose")
    run.add_argument("--no-compute", action="store_true",
                     help="export only: a known payload instead of prefill, checked at the decoder")
    run.add_argument("--payload", type=int_at_least(1),
                     help="with --no-compute: payload bytes (sets the prompt length)")
    run.add_argument("--output-tokens", type=int_at_least(1), default=1,
                     help="tokens per request, decoded after admission from what crossed "
                          "(greedy; listed as `tokens`)")
    cmp = _summary(sub, "compare", "run every mode on one prompt: parity and ratios")
    _workload_args(cmp)
    cmp.add_argument("--trace-dir", help="write one trace per mode into this folder")
    serve_cli.add_parsers(sub)
    return parser


def _payload_tokens(args, spec: ModelSpec) -> tuple[int, ...] | None:
    """Export only: the prompt a payload of --payload bytes needs (token ids are not used)."""
    payload = getattr(args, "payload", None)
    if payload is not None and not args.no_compute:
        raise BadInput("payload: needs --no-compute (a payload replaces the prefill)")
    if payload is not None and (args.prompt is not None or args.tokens or args.tokens_file):
        raise BadInput("payload: sets the prompt length; give it without --prompt or --tokens")
    if payload is None:
        return None
    if handoff_geometry(spec, args.page_tokens).kinds is not None:
        raise BadInput("payload: sizes a dense model's prompt (every layer, every token); a "
                       "model with layer kinds hands off less: give it --prompt")
    per_token = spec.geometry(args.page_tokens).bytes_per_token
    return (0,) * (-(-payload // per_token))


def _tokens(args, spec: ModelSpec) -> tuple[int, ...]:
    payload = _payload_tokens(args, spec)
    if payload is not None:
        return payload
    text = args.tokens
    if args.tokens is not None and args.tokens_file is not None:
        raise BadInput("tokens: give --tokens or --tokens-file, not both")
    if args.tokens_file is not None:
        try:
            text = Path(args.tokens_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise BadInput(f"tokens-file: cannot read {args.tokens_file} ({e})") from None
    if text is None:
        prompt = 256 if args.prompt is None else args.prompt
        gen = torch.Generator().manual_seed(args.seed)
        return tuple(torch.randint(0, spec.vocab, (prompt,), generator=gen).tolist())
    try:
        tokens = tuple(int(t) for t in text.replace(",", " ").split())
    except ValueError:
        raise BadInput("tokens: must be integers separated by commas or spaces") from None
    if args.prompt is not None and args.prompt != len(tokens):
        raise BadInput(f"prompt: {args.prompt} does not match the {len(tokens)} tokens given")
    return tokens


def _devices(args) -> tuple[str, str]:
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.decoder_device is not None:
        return device, args.decoder_device
    if device.startswith("cuda") and torch.cuda.device_count() > 1:
        return device, "cuda:1"
    return device, "cpu"


def _spec(args) -> ModelSpec:
    """The model's spec from a preset, a profile or a checkpoint's headers (nothing allocated)."""
    return model_spec(args.model, args.dtype)


def _config(args, mode: str, device: str, decoder: str) -> EngineConfig:
    return EngineConfig(
        mode=mode, chunk=args.chunk, max_pending=args.max_pending, page_tokens=args.page_tokens,
        pool_pages=args.pool_pages, device=device, decoder_device=decoder,
        link_gbps=args.link_gbps, fail_span=args.fail_span, retries=args.retries,
        debug=getattr(args, "debug", None), keep_kv=args.command == "compare",
        threads=args.threads, warmup=args.warmup, no_compute=getattr(args, "no_compute", False),
        output_tokens=getattr(args, "output_tokens", 1))


def _requests(args, tokens) -> list[Request]:
    return [Request(f"r{i}", tokens, args.prefix) for i in range(args.requests)]


def _check_out_path(path: str | None, what: str, is_dir: bool = False) -> None:
    if path is None:
        return
    folder = Path(path).resolve() if is_dir else Path(path).resolve().parent
    if is_dir:  # made when the traces are written; its nearest existing ancestor must be a folder
        folder = next(p for p in (folder, *folder.parents) if p.exists())
    if not folder.is_dir():
        raise BadInput(f"{what}: {folder} is not an existing folder")


def write_trace(result: RunResult, path: str | Path) -> None:
    """Check the whole trace (stage events included) with pdref, then write it atomically."""
    lines = [dumps(header_to_json(result.header)).encode()]
    lines += [dumps(event_to_json(e)).encode() for e in result.events]
    verdict = check_lines(lines, str(path))
    if not verdict.ok:
        raise Violation(verdict.code, f"trace line {verdict.line}: {verdict.message}")
    with TraceWriter(path, result.header) as writer:
        for event in result.events:
            writer.write(event)


def _print_metrics(metrics: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(metrics, default=str))
        return
    keys = list(METRIC_ORDER) + sorted(k for k in metrics if k not in METRIC_ORDER)
    print(format_metrics(metrics, keys, width=20))


def _prepare(args):
    """Check everything before allocating, then build the model: (model, tokens, devices)."""
    device, decoder = _devices(args)
    spec = _spec(args)
    tokens = _tokens(args, spec)
    _check_context(args, spec, len(tokens))
    for mode in _modes(args, spec):
        setup_check(spec, _config(args, mode, device, decoder), _requests(args, tokens))
    try:
        arch_of(spec)
    except ValueError as e:
        raise BadInput(str(e)) from None
    if Path(args.model).is_dir():
        return load_checkpoint(args.model, device, args.dtype), tokens, device, decoder
    return build_model(spec, device=device, seed=args.seed), tokens, device, decoder


def _check_context(args, spec: ModelSpec, prompt: int) -> None:
    """A run makes one token (the first) after the prompt; an export-only payload has no
    positions, so no context limit applies to it."""
    out = getattr(args, "output_tokens", 1)
    problem = None if getattr(args, "no_compute", False) else context_error(spec, prompt, out)
    if problem:
        raise BadInput(problem)


def _modes(args, spec: ModelSpec) -> list[str]:
    """The modes to run: layer mode too unless the model's state cannot cross (CFG-1)."""
    if args.command == "run":
        return [args.mode]
    return ["whole", "chunk"] if unshipped_state(spec) else ["whole", "chunk", "layer"]


def cmd_run(args) -> int:
    _check_out_path(args.trace, "trace")
    model, tokens, device, decoder = _prepare(args)
    engine = Engine(model, _config(args, args.mode, device, decoder))
    result = engine.run(_requests(args, tokens))
    if args.trace:
        write_trace(result, args.trace)
    if args.output_tokens > 1:
        result.metrics["tokens"] = [list(o.tokens) for o in result.outcomes]
    _print_metrics(result.metrics, args.json)
    return 0


def cmd_compare(args) -> int:
    _check_out_path(args.trace_dir, "trace-dir", is_dir=True)
    model, tokens, device, decoder = _prepare(args)
    modes = _modes(args, model.spec)
    configs = {m: _config(args, m, device, decoder) for m in modes}
    report = compare_modes(model, configs, _requests(args, tokens))
    if args.trace_dir:
        Path(args.trace_dir).mkdir(parents=True, exist_ok=True)
        for mode, result in report.results.items():
            write_trace(result, Path(args.trace_dir) / f"{mode}.jsonl")
    print(json.dumps(report.summary(), default=str) if args.json else compare_table(report))
    return 0 if report.parity_ok else 1


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        if args.command in serve_cli.COMMANDS:
            return serve_cli.run_command(args)
        return cmd_run(args) if args.command == "run" else cmd_compare(args)
    except (BadInput, WorkloadError, ProfileError, CheckpointError) as e:
        print(f"pdgpu: error: {e}", file=sys.stderr)
        return 2
    except Violation as e:
        print(f"pdgpu: violation: {e.code} {e.message}", file=sys.stderr)
        return 1
    except (EngineError, Disagreement) as e:  # Disagreement: the audit and the mirror differ
        print(f"pdgpu: engine error: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # e.g. the trace cannot be written: nothing half-written stays
        print(f"pdgpu: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:  # run / compare (serve has its own): one line, 130 or 143
        print(f"pdgpu: {interrupt.describe(e)}", file=sys.stderr)
        return interrupt.exit_code(e)
