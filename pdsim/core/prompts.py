"""`--prompts FILE.jsonl`: the requests of a serving run in `pdgpu serve`'s format, one JSON
object a line, `{"req": "...", "tokens": [ids...], "output_tokens": n}` (output_tokens
optional: the run's `--output-tokens`). Checked as the engine checks it: the first bad line
is refused, naming the file, the line and the field; blank lines are skipped."""

from __future__ import annotations

import json
from pathlib import Path


class PromptsError(ValueError):
    """A prompts file that cannot be read or breaks a rule; the message names the field."""


def read_prompts(path: str) -> list[dict]:
    """Rows `{"req", "prompt", "tokens", "output_tokens" (None: the run's)}`, in file order."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise PromptsError(f"--prompts: cannot read {path} ({e})") from None
    rows, seen = [], set()
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"--prompts: {path} line {n}"
        try:
            obj = json.loads(line)
        except ValueError:
            raise PromptsError(f"{where}: not valid JSON") from None
        row = _row(obj, where)
        if row["req"] in seen:
            raise PromptsError(f"{where}: req {row['req']!r} appears twice")
        seen.add(row["req"])
        rows.append(row)
    if not rows:
        raise PromptsError(f"--prompts: {path} holds no request")
    return rows


def _row(obj, where: str) -> dict:
    if not isinstance(obj, dict):
        raise PromptsError(f"{where}: must be a JSON object")
    req, tokens, out = obj.get("req"), obj.get("tokens"), obj.get("output_tokens")
    if not isinstance(req, str) or not req:
        raise PromptsError(f"{where}: req must be a non-empty string")
    if not isinstance(tokens, list) or not tokens or not all(type(t) is int for t in tokens):
        raise PromptsError(f"{where}: tokens must be a non-empty list of integers")
    if out is not None and (type(out) is not int or out < 1):
        raise PromptsError(f"{where}: output_tokens must be an integer >= 1, got {out!r}")
    return {"req": req, "prompt": len(tokens), "tokens": tokens, "output_tokens": out}


def check_shared_prefix(rows: list[dict], prefix: int) -> None:
    """Every prompt starts with the same `prefix` tokens (the caches hold them already)."""
    first = rows[0]["tokens"][:prefix]
    for row in rows:
        if row["prompt"] < prefix or row["tokens"][:prefix] != first:
            raise PromptsError(f"--prefix: every prompt must start with the same {prefix} "
                               f"tokens; request {row['req']!r} does not")
