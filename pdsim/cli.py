"""`pdsim run|sweep|explain|timeline|calibrate|validate|study|demo`: the simulator's command
line.

Bad input is one line on stderr naming the field and the rule, exit 2, and nothing written.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import sys

from pdref.models import ProfileError
from pdref.plan import PlanError
from pdsim.core.env import gc_paused
from pdsim.core.faults import add_fault_options, fault_spec
from pdsim.core.metrics import serving_summary, single_metrics, workload_metrics
from pdsim.core.play import simulate
from pdsim.core.stream import RunStream
from pdsim.fit import EngineRunError
from pdsim.options import Parser, UsageError, add_run_options, run_setup
from pdsim.views.progress import RunProgress
from pdsim.views.report import ResultsStream, format_metrics, write_results, write_trace

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2
INPUT_ERRORS = (UsageError, ProfileError, PlanError, ValueError, OSError)


def cmd_run(args) -> int:
    cfg, requests = run_setup(args)
    faults = fault_spec(args, cfg.producers)
    single = len(requests) == 1 and faults is None
    if not (single or faults or args.trace):  # a workload: only what is in flight is kept
        metrics = workload_metrics(_streamed(args, cfg, requests))
        print(json.dumps(metrics) if args.json else format_metrics(metrics))
        return EXIT_OK
    # The run's objects live until the end: nothing for the collector to find. A process
    # started for this command exits next: its objects are frozen, never scanned.
    with gc_paused(freeze=getattr(args, "process_exits", False)):
        result = simulate(cfg, requests, faults)
        metrics = single_metrics(result) if single else workload_metrics(result)
        if single and cfg.output_of(next(iter(requests))):  # one request that decodes: serving keys
            metrics.update(serving_summary(result))
        if args.trace:
            write_trace(args.trace, result)
        if args.results:
            write_results(args.results, result)
    print(json.dumps(metrics) if args.json else format_metrics(metrics))
    return EXIT_OK


def _streamed(args, cfg, requests):
    """A workload run keeping only what is in flight (stream.py), with its progress and
    its --results rows written as requests end."""
    with contextlib.ExitStack() as stack:
        results = stack.enter_context(ResultsStream(args.results)) if args.results else None
        progress = (stack.enter_context(RunProgress(len(requests))) if args.progress
                    else None)
        return simulate(cfg, requests, stream=RunStream(
            cfg, on_ok=results.write if results else None, progress=progress))


def _lazy(module: str, name: str):
    """`<module>.<name>`, imported when first called: `pdsim run` should not pay for
    networkx, tqdm or matplotlib, which other commands' modules import."""
    def call(*args):
        return getattr(importlib.import_module(module), name)(*args)

    return call


def _commands():
    commands = {
        "run": ("simulate one run or workload; print metrics", _run_args, cmd_run),
        "sweep": ("pdsim.sweep", "grid over chunk sizes, prompts, modes, bounds, bandwidths"),
        "explain": ("pdsim.views.explain", "dependency graph and critical path of one run"),
        "timeline": ("pdsim.views.timeline", "Gantt PNG and Perfetto trace of one run"),
        "calibrate": ("pdsim.fit.calibrate", "fit a hw profile from traces' stage events"),
        "validate": ("pdsim.fit.validate",
                     "run the engine over a grid, calibrate on part, predict the rest"),
        "cache": ("pdsim.cache_whatif", "what a prefix cache of each size is worth on one "
                  "workload (sessions sharing a system prompt)"),
        "study": ("pdsim.study", "chunk/layer overlap's serving gain over whole copy: "
                  "grid, plots, report"),
        "study-hybrid": ("pdsim.study_hybrid", "how much smaller a hybrid model's handoff "
                         "is, and whether chunk/layer overlap still pays: plots, report"),
        "demo": ("pdsim.demo",
                 "the main job: engine, calibration, prediction, sweeps, checks, report"),
    }
    return {name: entry if len(entry) == 3
            else (entry[1], _lazy(entry[0], "add_args"), _lazy(entry[0], "command"))
            for name, entry in commands.items()}


def _run_args(p) -> None:
    add_run_options(p)
    p.add_argument("--trace", default=None,
                   help="write the run's JSONL trace here (specs/contract.md)")
    p.add_argument("--json", action="store_true", help="print metrics as one JSON object")
    p.add_argument("--results", default=None,
                   help="write one JSON line per request here: status (ok, cancelled, "
                        "failed), ttft_s, e2e_s, attempts")
    p.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress on stderr (default: after 3 s, a bar on a terminal, "
                        "else a line every 10 s)")
    add_fault_options(p)


def _parser(commands, only: str | None = None) -> Parser:
    """The parser; with `only`, options for that subcommand alone (the others are listed by
    `pdsim --help`, but their modules are not imported)."""
    parser = Parser(prog="pdsim", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    for name, (text, add_args, _) in commands.items():
        subparser = sub.add_parser(name, help=text, description=text)
        if only is None or name == only:
            add_args(subparser)
    return parser


def _chosen(argv: list[str]) -> str:
    """The subcommand an argument list names: its first word (pdsim has no global option)."""
    return next((word for word in argv if not word.startswith("-")), "")


def main(argv: list[str] | None = None) -> int:
    commands = _commands()
    try:
        words = sys.argv[1:] if argv is None else argv
        args = _parser(commands, only=_chosen(words)).parse_args(words)
    except SystemExit as e:
        return int(e.code or 0)
    args.process_exits = argv is None  # the command line of this process, not a caller's
    try:
        return commands[args.command][2](args)
    except BrokenPipeError:  # e.g. `pdsim run | head`: the reader left, nothing to report
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except INPUT_ERRORS as e:
        print(f"pdsim {args.command}: error: {_one_line(e)}", file=sys.stderr)
        return EXIT_USAGE
    except EngineRunError as e:  # validate / demo: the engine subprocess failed
        print(f"pdsim {args.command}: engine error: {_one_line(e)}", file=sys.stderr)
        return EXIT_FAIL


def _one_line(error: Exception) -> str:
    if isinstance(error, OSError) and error.filename:
        return f"{error.filename}: {error.strerror}"
    return str(error).splitlines()[0] if str(error) else type(error).__name__


if __name__ == "__main__":
    sys.exit(main())
