"""`pdsim run|sweep|explain|timeline|calibrate|validate|demo`: the simulator's command line.

Bad input is one line on stderr naming the field and the rule, exit 2, and nothing written.
"""

from __future__ import annotations

import json
import os
import sys

from pdref.models import ProfileError
from pdref.plan import PlanError
from pdsim.engine_runs import EngineRunError
from pdsim.env import gc_paused
from pdsim.faults import add_fault_options, fault_spec
from pdsim.metrics import single_metrics, workload_metrics
from pdsim.options import Parser, UsageError, add_run_options, run_setup
from pdsim.report import format_metrics, write_trace
from pdsim.results import write_results
from pdsim.sim import simulate

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2
INPUT_ERRORS = (UsageError, ProfileError, PlanError, ValueError, OSError)


def cmd_run(args) -> int:
    cfg, requests = run_setup(args)
    faults = fault_spec(args, cfg.producers)
    with gc_paused():  # the run's objects live until the end: nothing for the GC to find
        result = simulate(cfg, requests, faults)
        single = len(requests) == 1 and faults is None
        metrics = single_metrics(result) if single else workload_metrics(result)
        if args.trace:
            write_trace(args.trace, result)
        if args.results:
            write_results(args.results, result)
    print(json.dumps(metrics) if args.json else format_metrics(metrics))
    return EXIT_OK


def _commands():
    from pdsim import calibrate, demo, explain, sweep, timeline, validate

    return {
        "run": ("simulate one run or workload; print metrics", _run_args, cmd_run),
        "sweep": ("grid over chunk sizes, prompts, modes, bounds, bandwidths",
                  sweep.add_args, sweep.command),
        "explain": ("dependency graph and critical path of one run",
                    explain.add_args, explain.command),
        "timeline": ("Gantt PNG and Perfetto trace of one run",
                     timeline.add_args, timeline.command),
        "calibrate": ("fit a hw profile from traces' stage events",
                      calibrate.add_args, calibrate.command),
        "validate": ("run the engine over a grid, calibrate on part, predict the rest",
                     validate.add_args, validate.command),
        "demo": ("the main job: engine, calibration, prediction, sweeps, checks, report",
                 demo.add_args, demo.command),
    }


def _run_args(p) -> None:
    add_run_options(p)
    p.add_argument("--trace", default=None,
                   help="write the run's JSONL trace here (specs/contract.md)")
    p.add_argument("--json", action="store_true", help="print metrics as one JSON object")
    p.add_argument("--results", default=None,
                   help="write one JSON line per request here: status (ok, cancelled, "
                        "failed), ttft_s, e2e_s, attempts")
    add_fault_options(p)


def _parser(commands) -> Parser:
    parser = Parser(prog="pdsim", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    for name, (text, add_args, _) in commands.items():
        add_args(sub.add_parser(name, help=text, description=text))
    return parser


def main(argv: list[str] | None = None) -> int:
    commands = _commands()
    try:
        args = _parser(commands).parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
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
