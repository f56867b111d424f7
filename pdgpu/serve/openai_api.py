"""The OpenAI request and response shapes of `pdgpu serve --http`, without the web framework:
a request body is checked into an `Ask` or refused with an `ApiError` naming the field
(OpenAI's error body: {"error": {"message", "type", "param", "code"}}); `Output` turns a
request's tokens into text, ending it at a stop token or stop string as the OpenAI API does
(the stop text itself is not returned; its tokens count in `usage`).

Served: greedy decoding (`temperature` absent or 0: exactly `pdgpu generate`'s tokens) or
sampling with `temperature`, `top_p`, `top_k`, `min_p`, `seed`, the presence, frequency and
repetition penalties, `min_tokens` and `ignore_eos` (vLLM's meanings; pdgpu/sampling.py; a
request without a seed gets a random one). What would change the output and is not served
(n or best_of > 1, echo, a logit bias, tools, a response format) is refused naming
the field; other unknown fields are ignored, as OpenAI's servers do. Each choice also carries
`token_ids` (the output's ids: what `pdgpu generate` prints; a model without a tokenizer has
no other exact text). `logprobs` (completions: N; chat: true, with `top_logprobs` N <= 20):
each token's log-probability under the model (its raw logits, vLLM's default) and the N most
likely tokens', in OpenAI's shapes.
"""

from __future__ import annotations

import attrs

from pdgpu.sampling import GREEDY, Sampling, SamplingError, checked, problem, random_seed
from pdgpu.serve.detok import Detokenizer
from pdgpu.serve.texts import TextError, Texts
from pdref.models import context_error

DEFAULT_MAX_TOKENS = 16  # OpenAI's for /v1/completions


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = \
            status, message, param, kind, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


def bad(param: str | None, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}" if param else message, param)


@attrs.frozen
class Limits:
    model: str  # the one model id served
    vocab: int
    max_prompt: int  # --http-max-prompt
    spec: object  # the ModelSpec: max_context


@attrs.frozen
class Ask:
    tokens: tuple[int, ...]
    max_tokens: int
    stream: bool
    include_usage: bool
    stop_ids: frozenset[int]
    stop_texts: tuple[str, ...]
    sampling: Sampling = GREEDY


# -- checks -----------------------------------------------------------------------------------

def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
                   "frequency_penalty", "repetition_penalty", "min_tokens", "ignore_eos")
# fields that would change the output, and the values that leave it as served (null: absent)
UNSERVED = {"n": (None, 1), "best_of": (None, 1), "echo": (None, False),
            "logit_bias": (None, {}),
            "tools": (None, []), "tool_choice": (None, "none"),
            "response_format": (None, {"type": "text"}), "use_beam_search": (None, False),
            "include_stop_str_in_output": (None, False)}


def _refuse_unserved(body: dict) -> None:
    for field, values in UNSERVED.items():
        value = body.get(field)
        if not any(value == v and type(value) is type(v) for v in values):
            raise bad(field, f"only {values[1]!r} is served, got {value!r}")


def _logprobs(body: dict, chat: bool) -> int | None:
    """How many alternatives each token's log-probability comes with, or None: not asked
    (completions: `logprobs` N; chat: `logprobs` true and `top_logprobs` N)."""
    if not chat:
        return body.get("logprobs")
    asked, top = body.get("logprobs"), body.get("top_logprobs")
    if asked not in (None, True, False) or not isinstance(asked, bool | None):
        raise bad("logprobs", f"must be true or false, got {asked!r}")
    if top is not None and not asked:
        raise bad("top_logprobs", "needs logprobs: true")
    wrong = top is not None and problem("logprobs", top)
    if wrong:
        raise bad("top_logprobs", wrong)
    return (top or 0) if asked else None


def _sampling(body: dict, max_tokens: int, limit: str, chat: bool) -> Sampling:
    """The request's sampling options (null: absent; no seed: a random one)."""
    given = {f: body[f] for f in SAMPLING_FIELDS if body.get(f) is not None}
    given.setdefault("seed", random_seed())
    if _logprobs(body, chat) is not None:
        given["logprobs"] = _logprobs(body, chat)
    try:
        return checked(max_tokens, limit, **given)
    except SamplingError as e:
        raise bad(e.field, e.message) from None


def check_model(body: dict, limits: Limits) -> None:
    model = body.get("model")
    if not isinstance(model, str):
        raise bad("model", f"required: the model id ({limits.model!r})")
    if model != limits.model:
        raise ApiError(404, f"model: {model!r} is not served here (this server serves "
                       f"{limits.model!r})", "model", code="model_not_found")


def _token_ids(value, param: str, vocab: int) -> tuple[int, ...]:
    if not value or not all(_is_int(t) for t in value):
        raise bad(param, "token ids must be a non-empty list of integers")
    outside = [t for t in value if not 0 <= t < vocab]
    if outside:
        raise bad(param, f"token {outside[0]} is outside [0, vocab={vocab})")
    return tuple(value)


def _prompt(value, texts: Texts, vocab: int) -> tuple[int, ...]:
    """Text or token ids; a list of one prompt is that prompt (one choice per request)."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
        value = value[0]
    if isinstance(value, str):
        if not value:
            raise bad("prompt", "must not be empty")
        try:
            return _token_ids(texts.encode(value), "prompt", vocab)
        except TextError as e:
            raise bad("prompt", str(e)) from None
    if isinstance(value, list):
        return _token_ids(value, "prompt", vocab)
    raise bad("prompt", "required: a text or a list of token ids (one prompt per request)")


def _stops(body: dict, texts: Texts, vocab: int) -> tuple[frozenset[int], tuple[str, ...]]:
    """`stop`: a string, a list of strings or a list of token ids; `stop_token_ids` too."""
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else (stop or [])
    if not isinstance(stop, list) or not (all(isinstance(s, str) and s for s in stop)
                                          or all(_is_int(s) for s in stop)):
        raise bad("stop", "must be a string, a list of strings or a list of token ids")
    extra = body.get("stop_token_ids") or []
    ids = set(_token_ids(extra, "stop_token_ids", vocab)) if extra else set()
    if stop and _is_int(stop[0]):
        return frozenset(ids | set(_token_ids(stop, "stop", vocab))), ()
    if stop and not texts.has_tokenizer:
        raise bad("stop", "this model has no tokenizer: give stop token ids")
    return frozenset(ids), tuple(stop)


def _max_tokens(body: dict, field: str, prompt: int, limits: Limits, default: int) -> int:
    value = body.get(field)
    value = default if value is None else value
    if not _is_int(value) or value < 1:
        raise bad(field, f"must be an integer >= 1, got {value!r}")
    problem = context_error(limits.spec, prompt, value, field)  # "FIELD: prompt P + output ..."
    if problem:
        raise ApiError(400, problem, field)
    return value


def _ask(body: dict, tokens: tuple[int, ...], texts: Texts, limits: Limits, param: str,
         max_tokens: int, limit: str) -> Ask:
    if len(tokens) > limits.max_prompt:
        raise bad(param, f"{len(tokens)} prompt tokens exceed this server's limit of "
                  f"{limits.max_prompt} (--http-max-prompt)")
    stream = body.get("stream") or False
    options = body.get("stream_options") or {}
    if not isinstance(stream, bool) or not isinstance(options, dict):
        raise bad("stream", "stream must be true or false, stream_options an object")
    sampling = _sampling(body, max_tokens, limit, param == "messages")
    stop_ids, stop_texts = _stops(body, texts, limits.vocab)
    if texts.eos_id is not None and not sampling.ignore_eos:
        stop_ids |= {texts.eos_id}  # the tokenizer's end of sequence ends a request
    return Ask(tokens, max_tokens, stream, bool(options.get("include_usage")), stop_ids,
               stop_texts, sampling)


def parse_completion(body, limits: Limits, texts: Texts) -> Ask:
    if not isinstance(body, dict):
        raise bad(None, "the request body must be a JSON object")
    check_model(body, limits)
    _refuse_unserved(body)
    tokens = _prompt(body.get("prompt"), texts, limits.vocab)
    limit = _max_tokens(body, "max_tokens", len(tokens), limits, DEFAULT_MAX_TOKENS)
    return _ask(body, tokens, texts, limits, "prompt", limit, "max_tokens")


def _text_message(message: dict) -> dict:
    """A message whose content is a list of parts (OpenAI's, as `vllm bench` sends them) with
    its text parts joined by newlines, as vLLM renders them for a text-only model."""
    content = message.get("content")
    if not isinstance(content, list):
        return message
    if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
               for p in content):
        kinds = sorted({str(p.get("type")) if isinstance(p, dict) else type(p).__name__
                        for p in content} - {"text"})
        raise bad("messages", f"only text content parts are served, got {', '.join(kinds)}")
    return {**message, "content": "\n".join(p["text"] for p in content)}


def parse_chat(body, limits: Limits, texts: Texts) -> Ask:
    if not isinstance(body, dict):
        raise bad(None, "the request body must be a JSON object")
    check_model(body, limits)
    _refuse_unserved(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
        raise bad("messages", "required: a non-empty list of {\"role\", \"content\"}")
    try:
        tokens = _token_ids(texts.chat_prompt([_text_message(m) for m in messages]),
                            "messages", limits.vocab)
    except TextError as e:
        raise bad("messages", str(e)) from None
    field = "max_completion_tokens" if body.get("max_completion_tokens") else "max_tokens"
    room = (limits.spec.max_context or len(tokens) + DEFAULT_MAX_TOKENS) - len(tokens)
    limit = _max_tokens(body, field, len(tokens), limits, max(1, room))
    return _ask(body, tokens, texts, limits, "messages", limit, field)


# -- output -----------------------------------------------------------------------------------

class Output:
    """A request's tokens as text, ended by a stop token or string; `add` gives the text
    that is final so far (held back while it may still change: an unfinished character
    (detok.py), or the start of a stop string, as vLLM holds the longest stop's length - 1)."""

    def __init__(self, ask: Ask, texts: Texts) -> None:
        self.ask = ask
        self.detok = Detokenizer(texts)
        self.texts = texts
        self.tokens: list[int] = []
        self.logprobs: list = []  # per token, when asked: (logprob, ((token, logprob), ...))
        self.offsets: list[int] = []  # per token: the text's length before it
        self.shown = 0  # characters of the text given out
        self.text = ""
        self.stopped = False  # by a stop token or string
        self.hold = max((len(s) for s in ask.stop_texts), default=1) - 1
        self.cached = 0  # prompt tokens found in the prefix cache, told at the request's end

    def add(self, token: int, logprob=None) -> str:
        if self.stopped:  # tokens the decoder made before it heard of the stop: not output
            return ""
        self.tokens.append(token)
        self.offsets.append(len(self.text))
        if logprob is not None:
            self.logprobs.append(logprob)
        if token in self.ask.stop_ids:  # its text is not output (OpenAI, vLLM)
            self.stopped = True
            return self._end()
        self._grow(self.detok.add(token))
        return self._flush() if self.stopped else self._upto(len(self.text) - self.hold)

    def _grow(self, piece: str) -> None:
        """Text added; cut where the first stop string it completes begins (none before
        min_tokens output tokens, as vLLM)."""
        self.text += piece
        if len(self.tokens) <= self.ask.sampling.min_tokens:
            return
        found = [self.text.find(stop, max(0, self.shown - len(stop)))
                 for stop in self.ask.stop_texts]
        if any(at >= 0 for at in found):  # the earliest: the text holds no stop string
            self.text, self.stopped = self.text[:min(at for at in found if at >= 0)], True

    def _upto(self, end: int) -> str:
        out = self.text[self.shown:max(self.shown, end)]
        self.shown += len(out)
        return out

    def _flush(self) -> str:
        return self._upto(len(self.text))

    def _end(self) -> str:
        """The output ended: the characters held back too (a stop string may end in one)."""
        self._grow(self.detok.flush())
        return self._flush()

    def finish(self) -> str:
        """The request ended: the text held back for a stop string that never came, and an
        unfinished character as the tokenizer decodes it."""
        return "" if self.stopped else self._end()

    def logprobs_body(self, chat: bool, start: int = 0, end: int | None = None) -> dict | None:
        """The OpenAI `logprobs` of tokens [start, end), or None when not asked."""
        if self.ask.sampling.logprobs is None or start == len(self.tokens):
            return None
        end = len(self.tokens) if end is None else end
        rows = list(zip(self.tokens[start:end], self.logprobs[start:end], strict=True))
        text = self.texts.decode
        if chat:
            def one(token: int, logprob: float) -> dict:
                piece = text([token])
                return {"token": piece, "logprob": logprob, "bytes": list(piece.encode())}
            return {"content": [{**one(t, lp), "top_logprobs": [one(i, v) for i, v in top]}
                                for t, (lp, top) in rows]}
        return {"tokens": [text([t]) for t, _ in rows],
                "token_logprobs": [lp for _, (lp, _) in rows],
                "top_logprobs": [{text([i]): v for i, v in top} for _, (_, top) in rows],
                "text_offset": self.offsets[start:end]}

    def finish_reason(self) -> str:
        return "stop" if self.stopped or len(self.tokens) < self.ask.max_tokens else "length"

    def usage(self) -> dict:
        n = len(self.tokens)
        return {"prompt_tokens": len(self.ask.tokens), "completion_tokens": n,
                "total_tokens": len(self.ask.tokens) + n,
                "prompt_tokens_details": {"cached_tokens": self.cached}}
