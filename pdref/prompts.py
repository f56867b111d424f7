"""The prompts file of a serving run (specs/contract.md, "Serving runs"): one JSON object a
line, `{"req": "...", "tokens": [ids...], "output_tokens": n}`, `output_tokens` optional
(the run's `--output-tokens`). Both shells read it here, so they refuse the same files with
the same words: the first bad line, naming the file, the line and the field. Blank lines are
skipped. Token ids against a model's vocabulary are the engine's to check."""

from __future__ import annotations

import json
from pathlib import Path

import attrs


class PromptsError(ValueError):
    """A prompts file that cannot be read or breaks a rule; the message names the field."""


@attrs.frozen
class PromptLine:
    req: str
    tokens: tuple[int, ...]
    output_tokens: int | None  # None: the run's --output-tokens

    @property
    def prompt(self) -> int:
        return len(self.tokens)


def read_prompts(path: str | Path) -> list[PromptLine]:
    """Every request of the file, in file order."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise PromptsError(f"--prompts: cannot read {path} ({e})") from None
    out, seen = [], set()
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"--prompts: {path} line {n}"
        try:
            obj = json.loads(line)
        except ValueError:
            raise PromptsError(f"{where}: not valid JSON") from None
        request = _line(obj, where)
        if request.req in seen:
            raise PromptsError(f"{where}: req {request.req!r} appears twice")
        seen.add(request.req)
        out.append(request)
    if not out:
        raise PromptsError(f"--prompts: {path} holds no request")
    return out


def _line(obj, where: str) -> PromptLine:
    if not isinstance(obj, dict):
        raise PromptsError(f"{where}: must be a JSON object")
    req, tokens, out = obj.get("req"), obj.get("tokens"), obj.get("output_tokens")
    if not isinstance(req, str) or not req:
        raise PromptsError(f"{where}: req must be a non-empty string")
    if not isinstance(tokens, list) or not tokens or not all(type(t) is int for t in tokens):
        raise PromptsError(f"{where}: tokens must be a non-empty list of integers")
    if out is not None and (type(out) is not int or out < 1):
        raise PromptsError(f"{where}: output_tokens must be an integer >= 1, got {out!r}")
    return PromptLine(req, tuple(tokens), out)


def shared_prefix(lines, prefix: int) -> tuple[int, ...]:
    """The first `prefix` tokens, which every prompt must share (the caches hold them)."""
    first = tuple(lines[0].tokens[:prefix])
    for line in lines:
        if line.prompt < prefix or tuple(line.tokens[:prefix]) != first:
            raise PromptsError(f"--prefix: every prompt must start with the same {prefix} "
                               f"tokens; request {line.req!r} does not")
    return first
