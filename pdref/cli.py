"""`pdref check TRACE...`: verify traces against the specification (specs/contract.md)."""

from __future__ import annotations

import argparse
import json
import sys

from pdref.check import check_file

EXIT_OK, EXIT_VIOLATION, EXIT_USAGE = 0, 1, 2
EXIT_CODES = """exit status (the worst over all files):
  0  every trace is legal
  1  a trace breaks a rule: FILE:LINE: CODE sentence. A file that opens but is not a
     trace (not JSON, bad UTF-8, empty, no header) is a TRACE-1 violation, so also 1
  2  bad usage, or a file that cannot be opened at all (missing, a folder, no permission)"""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdref", description=__doc__, epilog=EXIT_CODES,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("check", help="check trace files against the protocol",
                           description="Check trace files against the protocol.",
                           epilog=EXIT_CODES,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    check.add_argument("traces", nargs="+", metavar="TRACE", help="JSONL trace files")
    check.add_argument("--open", action="store_true",
                       help="partial trace: skip the end-of-trace part of LIFE-1")
    check.add_argument("--json", action="store_true", help="one JSON object per file")
    return parser


def _check_one(path: str, args) -> int:
    try:
        result = check_file(path, open_trace=args.open)
    except OSError as e:
        message = f"cannot read: {e.strerror or e}"
        if args.json:
            print(json.dumps({"file": path, "ok": False, "error": message}))
        else:
            print(f"{path}: {message}", file=sys.stderr)
        return EXIT_USAGE
    print(json.dumps(result.to_json()) if args.json else result.text())
    return EXIT_OK if result.ok else EXIT_VIOLATION


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    codes = [_check_one(path, args) for path in args.traces]
    return max(codes)


if __name__ == "__main__":
    sys.exit(main())
