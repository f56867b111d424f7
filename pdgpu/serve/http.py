"""The routes of `pdgpu serve --http` (FastAPI on uvicorn, in a thread of the decoder process;
why: README, "OpenAI-compatible HTTP front end").

POST /v1/completions, POST /v1/chat/completions (streamed as server-sent events, one token
per event, then `data: [DONE]`), GET /v1/models, GET /health (503 while no producer serves,
before the loop runs and while draining), GET /metrics (Prometheus text). A request's tokens
come from the decoder thread through its handle's sink, handed to this thread's event loop
with `call_soon_threadsafe`. A client that goes away (a stream cancelled by the server when
the connection closes, or a plain request whose connection closes while it waits) cancels
its request through the frontend (frontend.py).
"""

from __future__ import annotations

import asyncio
import json
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from pdgpu.serve.frontend import Closed, Event, Frontend, Full
from pdgpu.serve.openai_api import ApiError, Ask, Limits, Output, parse_chat, parse_completion
from pdgpu.serve.texts import Texts


def error_response(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


class Service:
    """What the routes serve from: the bridge, the text side, the limits, the metrics."""

    def __init__(self, frontend: Frontend, texts: Texts, limits: Limits, metrics) -> None:
        self.frontend, self.texts, self.limits, self.metrics = frontend, texts, limits, metrics
        self.created = int(time.time())

    def health(self) -> tuple[int, str]:
        decoder = self.frontend.decoder
        if self.frontend.closing:
            return 503, "draining"
        if decoder is None:
            return 503, "starting"
        if not decoder.members.ready():
            return 503, "no producer is serving"
        return 200, "ok"

    def submit(self, ask: Ask) -> tuple[object, asyncio.Queue]:
        """Queue the request; its events arrive on the returned queue (this event loop)."""
        loop, events = asyncio.get_running_loop(), asyncio.Queue()

        def sink(event: Event) -> None:  # the decoder's thread
            loop.call_soon_threadsafe(events.put_nowait, event)
        try:
            handle = self.frontend.submit(ask.tokens, ask.max_tokens, ask.stop_ids, sink,
                                          sampling=ask.sampling)
        except Full as e:
            raise ApiError(429, f"overloaded: {e}; retry later", None, "rate_limit_exceeded",
                           "queue_full") from None
        except Closed as e:
            raise ApiError(503, str(e), None, "server_error", "shutting_down") from None
        return handle, events


async def _read_json(request: Request):
    try:
        return json.loads(await request.body())
    except ValueError:
        raise ApiError(400, "the request body is not valid JSON") from None


async def _tokens(service: Service, handle, events: asyncio.Queue, out: Output):
    """(text, token) per token, until the request ends (then the text held back, with
    token None); raises ApiError if it failed."""
    while True:
        event = await events.get()
        logprobs = event.logprobs or (None,) * len(event.tokens)
        for token, logprob in zip(event.tokens, logprobs, strict=True):
            if out.stopped:
                break
            text = out.add(token, logprob)
            if out.stopped:
                service.frontend.finish(handle)  # a stop string: no more tokens needed
            yield text, token
        if event.status is not None:
            out.cached = event.cached
            if event.status != "ok" and not out.stopped:
                raise ApiError(500, f"the request ended {event.status}: {event.reason}",
                               None, "server_error", event.status)
            rest = out.finish()
            if rest:
                yield rest, None
            return


def _choice(chat: bool, text: str, ids: list[int], finish: str | None, delta: bool,
            logprobs: dict | None = None) -> dict:
    key = "delta" if delta else "message"
    body = {key: {"role": "assistant", "content": text}} if chat else {"text": text}
    return {"index": 0, **body, "logprobs": logprobs, "token_ids": ids,
            "finish_reason": finish}


class Answer:
    """One request's response: whole, or as a stream of events."""

    def __init__(self, service: Service, ask: Ask, chat: bool) -> None:
        self.service, self.ask, self.chat = service, ask, chat
        self.out = Output(ask, service.texts)
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{time.time_ns():x}"

    def _head(self, chunk: bool) -> dict:
        kind = ("chat.completion" if self.chat else "text_completion") + \
            (".chunk" if chunk and self.chat else "")
        return {"id": self.id, "object": kind, "created": int(time.time()),
                "model": self.service.limits.model}

    async def whole(self, request: Request) -> JSONResponse:
        handle, events = self.service.submit(self.ask)
        text = []

        async def collect():
            async for piece, _ in _tokens(self.service, handle, events, self.out):
                text.append(piece)
        await _unless_gone(request, collect(), lambda: self.service.frontend.cancel(handle))
        body = {**self._head(False), "usage": self.out.usage(), "choices": [_choice(
            self.chat, "".join(text), self.out.tokens, self.out.finish_reason(), False,
            self.out.logprobs_body(self.chat))]}
        return JSONResponse(body)

    def stream(self) -> StreamingResponse:
        handle, events = self.service.submit(self.ask)  # 429/503 before the stream begins
        ended: list[bool] = []  # set once the request ended (its last event was sent)

        def gone() -> None:  # the response is over: unless the request ended, cancel it
            if not ended:
                self.service.frontend.cancel(handle)
        return _Stream(self._events(handle, events, ended), gone)

    async def _events(self, handle, events, ended: list):
        try:
            async for text, token in _tokens(self.service, handle, events, self.out):
                ids = [] if token is None else [token]
                at = len(self.out.tokens) - 1
                logprobs = None if token is None else self.out.logprobs_body(self.chat, at)
                yield _sse({**self._head(True), "choices": [
                    _choice(self.chat, text, ids, None, True, logprobs)]})
            yield _sse({**self._head(True), "choices": [
                _choice(self.chat, "", [], self.out.finish_reason(), True)]})
            if self.ask.include_usage:
                yield _sse({**self._head(True), "choices": [], "usage": self.out.usage()})
            ended.append(True)
        except ApiError as e:
            ended.append(True)  # the request ended (failed or cancelled by the server)
            yield _sse(e.body())
        yield "data: [DONE]\n\n"


class _Stream(StreamingResponse):
    """A stream that calls `on_end` once the response is over, however it ended. A client
    that hangs up before the first event is pulled ends the response before its generator
    ever starts (so no `finally` inside the generator runs): the request must still be
    cancelled there, or it decodes to `max_tokens` holding its queue slot."""

    def __init__(self, content, on_end) -> None:
        super().__init__(content, media_type="text/event-stream")
        self.on_end = on_end

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_end()


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


async def _unless_gone(request: Request, work, on_gone) -> None:
    """Run `work`; if the client disconnects first, call `on_gone` and stop waiting."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if not task.done():
        on_gone()
        task.cancel()
        raise ApiError(499, "the client closed the connection")
    task.result()  # its ApiError, if any


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def build_app(service: Service) -> FastAPI:
    app = FastAPI(title="pdgpu serve", docs_url=None, redoc_url=None)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError):
        if e.status in (400, 404, 429, 503):
            service.metrics.requests.labels("rejected").inc()
        return error_response(e)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):  # no such route or method
        return error_response(ApiError(e.status_code, str(e.detail)))

    async def answer(request: Request, chat: bool):
        body = await _read_json(request)
        parse = parse_chat if chat else parse_completion
        ask = parse(body, service.limits, service.texts)
        reply = Answer(service, ask, chat)
        return reply.stream() if ask.stream else await reply.whole(request)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await answer(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await answer(request, chat=True)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": service.limits.model, "object": "model",
                                            "created": service.created, "owned_by": "pdgpu"}]}

    @app.get("/health")
    async def health():
        status, text = service.health()
        return JSONResponse({"status": text}, status_code=status)

    @app.get("/metrics")
    async def metrics():
        return Response(service.metrics.text(), media_type="text/plain; version=0.0.4")

    return app
