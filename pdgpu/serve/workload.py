"""The requests of a serving run: drawn (`--requests`, `--prompt-range`, `--prefix`, `--seed`)
or read from `--prompts FILE.jsonl`; each checked before any process starts."""

from __future__ import annotations

import json
import random
from pathlib import Path

import attrs

from pdgpu.workload import WorkloadError


@attrs.frozen
class ServeRequest:
    req: str
    tokens: tuple[int, ...] = attrs.field(converter=tuple)
    output_tokens: int = 1

    @property
    def prompt(self) -> int:
        return len(self.tokens)


@attrs.frozen
class Workload:
    requests: tuple[ServeRequest, ...]
    prefix_tokens: tuple[int, ...]  # shared by every prompt; the caches hold it already
    arrivals: tuple[float, ...] | None  # Poisson arrival times; None: closed loop
    concurrency: int  # closed loop: requests in the system at once

    @property
    def prefix(self) -> int:
        return len(self.prefix_tokens)


def parse_range(text: str) -> tuple[int, int]:
    """`A:B` with 1 <= A <= B -> (A, B)."""
    try:
        a, b = (int(x) for x in text.split(":"))
    except ValueError:
        raise WorkloadError(f"prompt-range must be A:B (integers), got {text!r}") from None
    if not 1 <= a <= b:
        raise WorkloadError(f"prompt-range must have 1 <= A <= B, got {text!r}")
    return a, b


def draw_requests(count: int, prompt_range: tuple[int, int], prefix: int, output_tokens: int,
                  vocab: int, seed: int) -> tuple[list[ServeRequest], tuple[int, ...]]:
    """`count` prompts with lengths uniform in the range, all starting with one shared prefix."""
    if prefix > prompt_range[0]:
        raise WorkloadError(f"prefix must be <= the shortest prompt {prompt_range[0]}, "
                            f"got {prefix}")
    rng = random.Random(seed)
    shared = tuple(rng.randrange(vocab) for _ in range(prefix))
    out = []
    for i in range(count):
        length = rng.randint(*prompt_range)
        tokens = shared + tuple(rng.randrange(vocab) for _ in range(length - prefix))
        out.append(ServeRequest(f"r{i}", tokens, output_tokens))
    return out, shared


def _field(obj: dict, where: str, name: str, default=None):
    value = obj.get(name, default)
    if value is None:
        raise WorkloadError(f"{where}: field {name!r} is missing")
    return value


def _prompt_line(obj, where: str, output_tokens: int) -> ServeRequest:
    if not isinstance(obj, dict):
        raise WorkloadError(f"{where}: must be a JSON object")
    req, tokens = _field(obj, where, "req"), _field(obj, where, "tokens")
    out = _field(obj, where, "output_tokens", output_tokens)
    if not isinstance(req, str) or not req:
        raise WorkloadError(f"{where}: req must be a non-empty string")
    if not isinstance(tokens, list) or not tokens or \
            not all(type(t) is int for t in tokens):
        raise WorkloadError(f"{where}: tokens must be a non-empty list of integers")
    if type(out) is not int or out < 1:
        raise WorkloadError(f"{where}: output_tokens must be an integer >= 1, got {out!r}")
    return ServeRequest(req, tokens, out)


def read_prompts(path: str, output_tokens: int) -> list[ServeRequest]:
    """Lines `{"req", "tokens", "output_tokens"}`; the first bad line is refused."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise WorkloadError(f"prompts: cannot read {path} ({e})") from None
    out, seen = [], set()
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"prompts: {path} line {n}"
        try:
            obj = json.loads(line)
        except ValueError:
            raise WorkloadError(f"{where}: not valid JSON") from None
        request = _prompt_line(obj, where, output_tokens)
        if request.req in seen:
            raise WorkloadError(f"{where}: req {request.req!r} appears twice")
        seen.add(request.req)
        out.append(request)
    if not out:
        raise WorkloadError(f"prompts: {path} holds no request")
    return out


def shared_prefix(requests: list[ServeRequest], prefix: int) -> tuple[int, ...]:
    """The first `prefix` tokens, which every prompt must share."""
    first = requests[0].tokens[:prefix]
    for r in requests:
        if r.prompt < prefix or r.tokens[:prefix] != first:
            raise WorkloadError(f"prefix: every prompt must start with the same {prefix} "
                                f"tokens; request {r.req!r} does not")
    return first


def check_vocab(requests: list[ServeRequest], vocab: int) -> None:
    for r in requests:
        bad = [t for t in r.tokens if not 0 <= t < vocab]
        if bad:
            raise WorkloadError(f"tokens: request {r.req!r} has token {bad[0]}, outside "
                                f"[0, vocab={vocab})")


def poisson_arrivals(count: int, rate: float, seed: int) -> tuple[float, ...]:
    """Arrival times of a Poisson process of `rate` requests per second, from t = 0."""
    rng = random.Random(seed + 1)
    t, out = 0.0, []
    for _ in range(count):
        out.append(t)
        t += rng.expovariate(rate)
    return tuple(out)
