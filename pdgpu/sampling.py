"""Sampling a request's next token from its logits: the OpenAI / vLLM options, applied to a
whole decode batch in one vectorized pass (no per-row loop over the vocabulary, no host sync).

Per row, in vLLM's order: penalties on the raw logits (repetition on tokens of the prompt and
the output: a positive logit divided by it, a negative one multiplied; frequency: minus it
times the token's count in the output; presence: minus it once the token is in the output),
the stop tokens banned while the output is shorter than `min_tokens`; then greedy (temperature
0: the argmax, exactly the engine's greedy token when nothing else is set) or: logits divided
by the temperature, softmax, `min_p` (tokens below min_p x the top probability dropped),
`top_k` (the k most likely kept, ties at the k-th kept too), `top_p` (the most likely tokens
whose mass reaches top_p kept, renormalized after min_p and top_k), and one draw by inverse
CDF over the kept probabilities in vocabulary order.

The draw's uniform number is a hash of (seed, position) computed on the host: a request's
token at output position p depends only on its own logits, options, seed and p, never on the
batch it shares or on what was drawn before, so the producer's first token (p = 0), the
decoder's later ones and `pdgpu generate` agree. A request without a seed gets a random one.
"""

from __future__ import annotations

import hashlib
import math
import secrets

import attrs

SEED_RANGE = (-(2 ** 63), 2 ** 64)  # vLLM's: a signed or an unsigned 64-bit integer
MAX_LOGPROBS = 20  # OpenAI's most top_logprobs


@attrs.frozen
class Sampling:
    """One request's options (OpenAI / vLLM names and meanings)."""

    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: every token (vLLM's -1 is taken as 0)
    min_p: float = 0.0
    seed: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0  # the stop tokens are banned before this many output tokens
    ignore_eos: bool = False  # the end-of-sequence token does not end the request
    logprobs: int | None = None  # each token's log-probability and this many alternatives

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def filtered(self) -> bool:
        """top_k or top_p restrict the tokens (a sort of each row's probabilities)."""
        return not self.greedy and (self.top_k > 0 or self.top_p < 1)

    @property
    def penalized(self) -> bool:
        return (self.presence_penalty, self.frequency_penalty, self.repetition_penalty) != \
            (0.0, 0.0, 1.0)


GREEDY = Sampling()

# field -> (lowest, highest, lowest included, highest included), as vLLM checks them
RANGES = {"temperature": (0.0, math.inf, True, False), "top_p": (0.0, 1.0, False, True),
          "min_p": (0.0, 1.0, True, True), "presence_penalty": (-2.0, 2.0, True, True),
          "frequency_penalty": (-2.0, 2.0, True, True),
          "repetition_penalty": (0.0, math.inf, False, False)}


def problem(field: str, value) -> str | None:
    """Why `value` is not a valid `field` (a Sampling field), or None."""
    if field in RANGES:
        low, high, low_in, high_in = RANGES[field]
        if isinstance(value, bool) or not isinstance(value, int | float) or \
                not math.isfinite(value):
            return f"must be a finite number, got {value!r}"
        if value < low or (value == low and not low_in) or value > high or \
                (value == high and not high_in):
            return f"must be in {_interval(low, high, low_in, high_in)}, got {value!r}"
        return None
    if field == "ignore_eos":
        return None if isinstance(value, bool) else f"must be true or false, got {value!r}"
    if isinstance(value, bool) or not isinstance(value, int):
        return f"must be an integer, got {value!r}"
    lowest = {"top_k": -1, "min_tokens": 0, "seed": SEED_RANGE[0], "logprobs": 0}[field]
    if field == "logprobs" and value > MAX_LOGPROBS:
        return f"must be <= {MAX_LOGPROBS}, got {value!r}"
    if value < lowest or (field == "seed" and value >= SEED_RANGE[1]):
        return f"must be >= {lowest}" + (" and < 2**64" if field == "seed" else "") + \
               f", got {value!r}"
    return None


def _interval(low: float, high: float, low_in: bool, high_in: bool) -> str:
    return f"{'[' if low_in else '('}{low:g}, {high:g}{']' if high_in else ')'}"


def random_seed() -> int:
    """The seed of a request that gave none."""
    return secrets.randbits(63)


def uniform(seed: int, position: int) -> float:
    """A number in [0, 1) from (seed, position), on 32 bits (a float64 product with the total
    mass stays below it: the draw never runs past the last kept token)."""
    key = (seed % 2 ** 64).to_bytes(8, "little") + position.to_bytes(8, "little")
    return int.from_bytes(hashlib.blake2b(key, digest_size=4).digest(), "little") / 2 ** 32


class SamplingError(ValueError):
    """An option out of its range: `field` names it (the OpenAI error's `param`)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field, self.message = field, message


def checked(max_tokens: int | None = None, limit: str = "max_tokens", **fields) -> Sampling:
    """A Sampling from the fields given (each checked; vLLM's top_k -1, every token, is 0);
    min_tokens may not exceed `max_tokens` (the option named `limit`)."""
    for field, value in fields.items():
        found = problem(field, value)
        if found:
            raise SamplingError(field, found)
    if fields.get("top_k") == -1:
        fields["top_k"] = 0
    if max_tokens is not None and fields.get("min_tokens", 0) > max_tokens:
        raise SamplingError("min_tokens", f"must be <= {limit} ({max_tokens}), got "
                            f"{fields['min_tokens']}")
    return Sampling(**fields)
