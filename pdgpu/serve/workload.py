"""The requests of a serving run: drawn (`--requests`, `--prompt-range`, `--prefix`, `--seed`)
or read from `--prompts FILE.jsonl`; each checked before any process starts."""

from __future__ import annotations

import random

import attrs

from pdgpu.sampling import GREEDY, Sampling
from pdgpu.workload import WorkloadError
from pdref import prompts
from pdref.models import ModelSpec, context_error


@attrs.frozen
class ServeRequest:
    req: str
    tokens: tuple[int, ...] = attrs.field(converter=tuple)
    output_tokens: int = 1
    sampling: Sampling = GREEDY  # how its tokens are drawn (the HTTP API's options)

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


def read_prompts(path: str, output_tokens: int) -> list[ServeRequest]:
    """The prompts file (read by pdref, as pdsim reads it); a line without output_tokens
    gets the run's."""
    try:
        lines = prompts.read_prompts(path)
    except prompts.PromptsError as e:
        raise WorkloadError(str(e)) from None
    return [ServeRequest(line.req, line.tokens, line.output_tokens or output_tokens)
            for line in lines]


def shared_prefix(requests: list[ServeRequest], prefix: int) -> tuple[int, ...]:
    """The first `prefix` tokens, which every prompt must share."""
    try:
        return prompts.shared_prefix(requests, prefix)
    except prompts.PromptsError as e:
        raise WorkloadError(str(e)) from None


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


def check_context(spec: ModelSpec, prompt_range: tuple[int, int] | None, output_tokens: int,
                  requests: list[ServeRequest] = ()) -> None:
    """Refuse a prompt + output beyond the model's max_context: the range's upper end (before
    any prompt is drawn), then every request (a prompts file's own output_tokens)."""
    if prompt_range is not None:
        problem = context_error(spec, prompt_range[1], output_tokens, "prompt-range")
        if problem:
            raise WorkloadError(problem)
    for r in requests:
        problem = context_error(spec, r.prompt, r.output_tokens, f"request {r.req!r}")
        if problem:
            raise WorkloadError(problem)
