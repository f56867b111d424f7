"""What an OpenAI client reads from /v1/completions and /v1/chat/completions, streamed and not,
when the decoder's tokens end mid-character (a byte-level BPE tokenizer): the routes of
pdgpu/serve/http.py over a stand-in frontend that hands out chosen tokens."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("fastapi")
pytest.importorskip("tokenizers")
from fastapi.testclient import TestClient  # noqa: E402
from test_pdgpu_detok import outputs, settled  # noqa: E402

from pdgpu.serve.frontend import Event  # noqa: E402
from pdgpu.serve.http import Service, build_app  # noqa: E402
from pdgpu.serve.metrics import ServeMetrics  # noqa: E402
from pdgpu.serve.openai_api import Limits  # noqa: E402
from pdref.models import load_model  # noqa: E402

TEMPLATE = "{% for m in messages %}{{ m.content }}{% endfor %}"


class Tokens:
    """A frontend that answers every request with `ids`, in events of `per_event` tokens."""

    def __init__(self, ids: list[int], per_event: int = 1) -> None:
        self.ids, self.per_event = ids, per_event
        self.closing, self.decoder = False, None
        self.submitted: list = []

    def submit(self, tokens, max_tokens, stop=(), sink=None, **options):
        self.submitted.append((tokens, max_tokens, stop, options))
        chunks = [self.ids[i:i + self.per_event] for i in range(0, len(self.ids), self.per_event)]
        for i, chunk in enumerate(chunks):
            sink(Event(tuple(chunk), "ok" if i == len(chunks) - 1 else None))
        return object()

    def finish(self, handle) -> None:
        pass

    def cancel(self, handle) -> None:
        pass


def client(texts, frontend: Tokens) -> TestClient:
    texts.chat_template = TEMPLATE
    limits = Limits("m", texts.tokenizer.get_vocab_size(), 64, load_model("tiny"))
    return TestClient(build_app(Service(frontend, texts, limits, ServeMetrics())))


def events(response) -> list[dict]:
    lines = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def piece(chat: bool, choice: dict) -> str:
    return choice["delta"]["content"] if chat else choice["text"]


@settings(max_examples=25)
@given(outputs(), st.booleans())
def test_both_endpoints_give_the_decode_streamed_and_whole(case, chat):
    """Every event's text is the decode of the tokens so far less only a last U+FFFD; the
    joined stream and the unstreamed text are the tokenizer's decode of the output ids."""
    texts, ids = case
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {"model": "m", "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}]} \
        if chat else {"model": "m", "max_tokens": 64, "prompt": "hi"}
    with client(texts, Tokens(ids)) as http:
        whole = http.post(path, json=body).json()["choices"][0]
        stream = events(http.post(path, json={**body, "stream": True}))
    assert (whole["message"]["content"] if chat else whole["text"]) == texts.decode(ids)
    assert whole["token_ids"] == ids
    text, seen = "", []
    for event in stream:
        choice = event["choices"][0]
        text += piece(chat, choice)
        seen += choice["token_ids"]
        if choice["token_ids"]:  # an event with a token: the text so far is settled
            assert text == settled(texts, seen)
    assert text == texts.decode(ids) and seen == ids


def test_chat_content_parts_are_their_texts_joined_and_other_parts_refused():
    """Content as OpenAI's list of text parts (as `vllm bench` sends it) renders as the texts
    joined by newlines; an image part is a 400 naming `messages`."""
    from test_pdgpu_detok import byte_level
    frontend = Tokens([5])
    body = {"model": "m", "max_tokens": 2}
    parts = [{"type": "text", "text": "héllo"}, {"type": "text", "text": "wörld"}]
    with client(byte_level(0, 300), frontend) as http:
        assert http.post("/v1/chat/completions", json={**body, "messages": [
            {"role": "user", "content": parts}]}).status_code == 200
        assert http.post("/v1/chat/completions", json={**body, "messages": [
            {"role": "user", "content": "héllo\nwörld"}]}).status_code == 200
        refused = http.post("/v1/chat/completions", json={**body, "messages": [
            {"role": "user", "content": [*parts, {"type": "image_url", "image_url": {}}]}]})
    assert frontend.submitted[0][0] == frontend.submitted[1][0]
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "messages"
    assert "image_url" in refused.json()["error"]["message"]
