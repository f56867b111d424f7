"""`pdgpu serve --http` (issue 25) driven by the official openai client against live servers on
127.0.0.1: a checkpoint with a tokenizer and chat template the test builds (most tests share
it), and the `tiny` preset (token ids only; the drain on SIGTERM)."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
tokenizers = pytest.importorskip("tokenizers")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from serve_helpers import reference, trace_ok, write_sensitive_checkpoint  # noqa: E402

CHUNK = 16
SENTENCES = ["the quick brown fox jumps over the lazy dog",
             "a decoder admits a request once every span landed",
             "pages go back when the writer is fenced"]
TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|> {{ m.content }} {% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def write_tokenizer(folder: Path, vocab: int) -> None:
    """A WordLevel tokenizer over exactly `vocab` words (every id the model can produce
    decodes) and a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    words = ["[UNK]", "<|user|>", "<|assistant|>", "<|system|>"]
    for word in " ".join(SENTENCES).split():
        if word not in words:
            words.append(word)
    words += [f"w{i}" for i in range(vocab - len(words))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))


class Server:
    """`pdgpu serve --http 127.0.0.1:0 ...` as a subprocess; the port from its first line."""

    def __init__(self, tmp: Path, model: str, *args: str) -> None:
        self.model, self.trace, self.results = model, tmp / "trace.jsonl", tmp / "results.jsonl"
        self.model_id = Path(model).name  # a preset's name, or the checkpoint folder's
        self.signalled = False
        cmd = [sys.executable, "-m", "pdgpu", "serve", "--http", "127.0.0.1:0", "--model",
               model, "--producers", "1", "--chunk", str(CHUNK), "--json", "--trace",
               str(self.trace), "--results", str(self.results), *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.lines: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._read_err, daemon=True).start()
        self.port = self._port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.wait_healthy()

    def _read_err(self) -> None:
        for line in self.proc.stderr:
            self.lines.put(line)
        self.lines.put(None)

    def _port(self) -> int:
        while (line := self.lines.get()) is not None:
            found = re.search(r"http://127\.0\.0\.1:(\d+)/v1", line)
            if found:
                return int(found.group(1))
        raise AssertionError(f"the server ended before listening: {self.proc.wait(timeout=60)}")

    def wait_healthy(self) -> None:
        with httpx.Client() as http:  # one client: a new one loads the CA bundle (33 ms of
            while http.get(f"{self.url}/health").status_code != 200:  # CPU) at each poll
                assert self.proc.poll() is None, "the server exited while starting"
                time.sleep(0.1)

    def wait_health(self, status: int, every_s: float) -> None:
        """Until /health answers `status` (polled every `every_s`, through one client)."""
        with httpx.Client() as http:
            while http.get(f"{self.url}/health").status_code != status:
                time.sleep(every_s)

    def client(self):
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0)

    def metrics(self) -> dict:
        """name{labels} -> value of every sample."""
        text = httpx.get(f"{self.url}/metrics").text
        return {s.name + json.dumps(s.labels, sort_keys=True): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    def terminate(self) -> None:
        """SIGTERM once (a second one stops at once, exit 130)."""
        self.signalled = True
        self.proc.send_signal(signal.SIGTERM)

    def stop(self) -> tuple[int, dict]:
        """SIGTERM (a drain); exit code and the printed summary."""
        if self.proc.poll() is None and not self.signalled:
            self.terminate()
        try:
            out, _ = self.proc.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise
        last = [line for line in out.splitlines() if line.startswith("{")]
        return self.proc.returncode, json.loads(last[-1]) if last else {}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("http")
    folder = write_sensitive_checkpoint(tmp / "ckpt")
    write_tokenizer(folder, vocab=256)
    srv = Server(tmp, str(folder), "--http-queue", "4", "--http-max-prompt", "64")
    yield srv
    code, values = srv.stop()
    assert code == 143 and values["leaked_pages"] == 0, (code, values)  # SIGTERM: 143
    trace_ok(srv.trace.read_bytes().splitlines())


def token_ids(choice) -> list[int]:
    return choice.model_extra["token_ids"]


PROMPTS = [[3, 17, 40, 41, 99, 250, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21],
           list(range(30, 70)), [5, 6]]


def test_completion_tokens_equal_generate(server):
    """Unstreamed completions (several prompts at once) give `pdgpu generate`'s tokens."""
    client = server.client()
    for prompt in PROMPTS:
        got = client.completions.create(model=server.model_id, prompt=prompt, max_tokens=9)
        assert token_ids(got.choices[0]) == reference(server.model, prompt, 9, CHUNK, 0)
        assert got.usage.completion_tokens == 9 and got.usage.prompt_tokens == len(prompt)
        assert got.choices[0].finish_reason == "length"


def test_streamed_completion_one_token_per_event(server):
    """A streamed completion sends one token per event, equal to `pdgpu generate`'s."""
    stream = server.client().completions.create(model=server.model_id, prompt=PROMPTS[1],
                                                max_tokens=7, stream=True,
                                                stream_options={"include_usage": True})
    events = list(stream)
    tokens = [token_ids(e.choices[0]) for e in events if e.choices and token_ids(e.choices[0])]
    assert all(len(t) == 1 for t in tokens)
    assert [t[0] for t in tokens] == reference(server.model, PROMPTS[1], 7, CHUNK, 0)
    assert events[-1].usage.completion_tokens == 7


SAMPLED = [{"temperature": 0.8, "seed": 11},
           {"temperature": 1.2, "top_p": 0.9, "top_k": 20, "seed": 12},
           {"temperature": 0.7, "min_p": 0.05, "presence_penalty": 0.5, "frequency_penalty": 0.3,
            "repetition_penalty": 1.2, "seed": 13}]


def completion_ids(server, prompt, max_tokens: int, **options) -> list[int]:
    got = server.client().completions.create(model=server.model_id, prompt=prompt,
                                             max_tokens=max_tokens, extra_body=options)
    return token_ids(got.choices[0])


def test_seeded_samples_equal_generate_alone_and_in_a_batch(server):
    """A sampled request with a seed gives `pdgpu generate`'s tokens for the same options,
    alone and while others (greedy and sampled) decode beside it; the draws are not greedy."""
    from pdgpu.sampling import Sampling
    want = [reference(server.model, PROMPTS[i], 10, CHUNK, 0, sampling=Sampling(**o))
            for i, o in enumerate(SAMPLED)]
    greedy = [reference(server.model, PROMPTS[i], 10, CHUNK, 0) for i in range(len(SAMPLED))]
    assert want != greedy
    alone = [completion_ids(server, PROMPTS[i], 10, **o) for i, o in enumerate(SAMPLED)]
    assert alone == want
    jobs = [(PROMPTS[i], o) for i, o in enumerate(SAMPLED)] + [(PROMPTS[0], {})]
    together: dict[int, list[int]] = {}
    threads = [threading.Thread(target=lambda i=i, p=p, o=o: together.__setitem__(
        i, completion_ids(server, p, 10, **o))) for i, (p, o) in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert [together[i] for i in range(len(SAMPLED))] == want
    assert together[len(SAMPLED)] == greedy[0]


def test_min_tokens_bans_the_stop_tokens_and_ignore_eos(server):
    """min_tokens keeps a stop token from being drawn before it (tokens as generate's with
    that token as its eos); ignore_eos with the tokenizer's own eos still runs to max_tokens."""
    from pdgpu.sampling import Sampling
    greedy = reference(server.model, PROMPTS[0], 8, CHUNK, 0)
    stop = greedy[1]
    want = reference(server.model, PROMPTS[0], 8, CHUNK, 0, eos=stop,
                     sampling=Sampling(min_tokens=4))
    got = completion_ids(server, PROMPTS[0], 8, stop=[stop], min_tokens=4, ignore_eos=True)
    assert got == want and stop not in got[:4]


def model_logprobs(model_arg: str, tokens: list[int]) -> torch.Tensor:
    """log-softmax of the model's logits after each prefix of `tokens` (one prefill of the
    whole sequence, in CHUNK chunks) -> [len(tokens), V]."""
    from pdgpu.serve.models import load_served_model
    from pdgpu.source_cache import SourceCache
    model = load_served_model(model_arg, 0, None, "cpu")
    geometry = model.spec.geometry(16)
    cache = SourceCache(geometry, geometry.pages_for(len(tokens)), "cpu", torch.float32)
    kv, ids = cache.open(len(tokens)), torch.tensor(tokens)
    with torch.no_grad():
        hidden = torch.cat([model.prefill_chunk(ids[a:a + CHUNK], a, kv)
                            for a in range(0, len(tokens), CHUNK)])  # [n, E]
        return torch.log_softmax(model.logits(hidden).float(), dim=-1)


def test_logprobs_are_the_models_for_each_token_in_both_shapes(server):
    """Completions' `logprobs` N and chat's `top_logprobs` N (streamed): each token's
    log-probability and the N most likely are the model's after that token's prefix."""
    prompt = PROMPTS[1]
    got = server.client().completions.create(model=server.model_id, prompt=prompt,
                                             max_tokens=6, logprobs=3).choices[0]
    ids = token_ids(got)
    logp = model_logprobs(server.model, prompt + ids)[len(prompt) - 1:-1]  # [6, V]
    assert got.logprobs.token_logprobs == pytest.approx(
        [logp[k, t].item() for k, t in enumerate(ids)], abs=1e-3)
    for k, top in enumerate(got.logprobs.top_logprobs):
        assert list(top.values()) == pytest.approx(logp[k].topk(3).values.tolist(), abs=1e-3)
    assert got.logprobs.tokens == [server_texts(server).decode([t]) for t in ids]
    chunks = list(server.client().chat.completions.create(
        model=server.model_id, max_tokens=4, stream=True, logprobs=True, top_logprobs=2,
        messages=[{"role": "user", "content": "the lazy dog"}]))
    events = [c.choices[0] for c in chunks if token_ids(c.choices[0])]
    assert all(len(e.logprobs.content) == 1 and len(e.logprobs.content[0].top_logprobs) == 2
               for e in events)
    greedy = [e.logprobs.content[0] for e in events]
    assert all(c.logprob == pytest.approx(c.top_logprobs[0].logprob) for c in greedy)


def server_texts(server):
    from pdgpu.serve.texts import Texts
    return Texts.for_model(server.model)


def itl_count(server) -> float:
    return server.metrics()["pdgpu_itl_seconds_count{}"]


def test_a_stop_string_ends_decoding_and_frees_pages_at_once(server):
    """A request a stop string ends stops taking decode steps right after (its tokens after
    the stop counted by /metrics' ITL), and its pages are back as the response ends."""
    prompt = SENTENCES[0]
    whole = server.client().completions.create(model=server.model_id, prompt=prompt,
                                               max_tokens=40)
    words = whole.choices[0].text.split()
    before = itl_count(server)
    cut = server.client().completions.create(model=server.model_id, prompt=prompt,
                                             max_tokens=40, stop=[words[2]])
    assert cut.choices[0].finish_reason == "stop"
    deadline = time.monotonic() + 5
    while server.metrics()["pdgpu_pool_pages_in_use{}"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.metrics()["pdgpu_pool_pages_in_use{}"] == 0
    decoded = itl_count(server) - before + 1
    assert decoded <= 3 + 3, decoded  # the stop at token 3, then at most a few in flight


def test_text_prompt_and_stop_string(server):
    """A text prompt is tokenized; a stop string ends the text before it, finish 'stop'."""
    client = server.client()
    prompt = SENTENCES[0]
    whole = client.completions.create(model=server.model_id, prompt=prompt, max_tokens=6)
    words = whole.choices[0].text.split()
    assert len(words) == 6
    cut = client.completions.create(model=server.model_id, prompt=prompt, max_tokens=6,
                                    stop=[words[2]])
    assert cut.choices[0].finish_reason == "stop"
    text = whole.choices[0].text
    assert cut.choices[0].text == text[:text.find(words[2])]  # a substring, as OpenAI's stop


def test_stop_token_ids(server):
    """`stop` as token ids ends the request at that token (counted, not shown)."""
    prompt = PROMPTS[0]
    want = reference(server.model, prompt, 8, CHUNK, 0)
    got = server.client().completions.create(model=server.model_id, prompt=prompt,
                                             max_tokens=8, extra_body={"stop": [want[3]]})
    ids = token_ids(got.choices[0])
    assert ids == want[:want.index(want[3]) + 1]
    assert got.choices[0].finish_reason == "stop"


def test_chat_completion_uses_the_template(server):
    """Chat renders the template; its tokens equal generate's on the rendered prompt."""
    got = server.client().chat.completions.create(
        model=server.model_id, max_tokens=5,
        messages=[{"role": "user", "content": "the lazy dog"}])
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(Path(server.model) / "tokenizer.json"))
    prompt = tok.encode("<|user|> the lazy dog <|assistant|>", add_special_tokens=False).ids
    assert token_ids(got.choices[0]) == reference(server.model, prompt, 5, CHUNK, 0)
    assert got.choices[0].message.role == "assistant"
    chunks = list(server.client().chat.completions.create(
        model=server.model_id, max_tokens=5, stream=True,
        messages=[{"role": "user", "content": "the lazy dog"}]))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == \
        got.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_a_prompt_and_output_past_max_context_is_400_in_one_plain_sentence():
    """max_tokens past the model's context: 400 naming `max_tokens` once, then the sums."""
    from pdgpu.serve.openai_api import ApiError, Limits, parse_completion
    from pdgpu.serve.texts import Texts
    from pdref.models import load_model
    limits = Limits("tiny", 256, 64, load_model("tiny"))
    body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 100000}
    with pytest.raises(ApiError) as e:
        parse_completion(body, limits, Texts.for_model("tiny"))
    assert e.value.status == 400 and e.value.param == "max_tokens"
    assert e.value.message.startswith("max_tokens: prompt 3 + output 100000 = 100003 tokens "
                                      "exceed max_context"), e.value.message


def test_chat_without_a_template_is_400(tmp_path):
    """A folder whose tokenizer_config.json has no chat_template refuses chat with a 400
    naming `messages`; with the template the same body renders."""
    from pdgpu.serve.openai_api import ApiError, Limits, parse_chat
    from pdgpu.serve.texts import Texts
    from pdref.models import load_model
    write_tokenizer(tmp_path, vocab=256)
    limits = Limits("m", 256, 64, load_model("tiny"))
    body = {"model": "m", "messages": [{"role": "user", "content": "dog"}]}
    assert len(parse_chat(body, limits, Texts.for_model(str(tmp_path))).tokens) == 3
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ApiError) as e:
        parse_chat(body, limits, Texts.for_model(str(tmp_path)))
    assert e.value.status == 400 and e.value.param == "messages"
    assert "chat template" in e.value.message


def test_client_disconnect_cancels_and_frees_pages(server):
    """A client that hangs up mid-stream cancels its request; its pages all come back (the
    prefix cache's idle pages, on by default, are not in use)."""
    before = server.metrics()
    key = 'pdgpu_requests_total{"outcome": "cancelled"}'
    with httpx.stream("POST", f"{server.url}/v1/completions", timeout=60, json={
            "model": server.model_id, "prompt": PROMPTS[1], "max_tokens": 3000,
            "stream": True}) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
    while server.metrics()[key] < before[key] + 1:
        time.sleep(0.05)
    while (m := server.metrics())['pdgpu_pool_pages_in_use{}'] or m['pdgpu_spans_in_flight{}']:
        time.sleep(0.05)


def test_hang_up_before_the_first_token_cancels_the_request(tmp_path):
    """A stream whose response ends before its first event was pulled (the client is gone
    when the server sends the headers, so the body generator never starts): its request is
    cancelled all the same, or it would decode to max_tokens holding its queue slot."""
    import asyncio

    from pdgpu.serve.frontend import Frontend
    from pdgpu.serve.http import Answer, Service
    from pdgpu.serve.openai_api import Limits, parse_completion
    from pdgpu.serve.texts import Texts
    from pdref.models import load_model
    frontend = Frontend(bound=4, drain_s=1.0)
    texts = Texts.for_model("tiny")
    limits = Limits("tiny", 256, 64, load_model("tiny"))
    ask = parse_completion({"model": "tiny", "prompt": [1, 2], "max_tokens": 9, "stream": True},
                           limits, texts)

    async def hung_up(message):
        raise OSError("the client hung up")

    async def never():
        await asyncio.Event().wait()

    async def respond():
        response = Answer(Service(frontend, texts, limits, None), ask, False).stream()
        with pytest.raises(OSError):
            await response({"type": "http", "asgi": {"spec_version": "2.3"}}, never, hung_up)
    asyncio.run(respond())
    handle = frontend.inbox.get_nowait()
    assert handle.cancelled


def test_plain_request_whose_client_gives_up_is_cancelled(server):
    """An unstreamed request whose client closes the connection while it waits (a read
    timeout) is cancelled; its pages come back."""
    before = server.metrics()
    key = 'pdgpu_requests_total{"outcome": "cancelled"}'
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", timeout=httpx.Timeout(60, read=0.3), json={
            "model": server.model_id, "prompt": PROMPTS[0], "max_tokens": 3000})
    while server.metrics()[key] < before[key] + 1:
        time.sleep(0.05)
    while server.metrics()['pdgpu_pool_pages_in_use{}']:
        time.sleep(0.05)


def test_overload_gets_429(server):
    """Beyond the queue bound (4) a request gets 429; the ones in flight are unharmed."""
    streams = [httpx.stream("POST", f"{server.url}/v1/completions", timeout=60, json={
        "model": server.model_id, "prompt": PROMPTS[2], "max_tokens": 3000, "stream": True})
        for _ in range(4)]
    lines = []  # kept open: a closed line iterator closes its connection (a disconnect)
    try:
        for s in streams:
            lines.append(s.__enter__().iter_lines())
            while not next(lines[-1]).startswith("data:"):
                pass
        with pytest.raises(openai.RateLimitError) as e:
            server.client().completions.create(model=server.model_id, prompt=[1], max_tokens=1)
        assert e.value.status_code == 429 and e.value.code == "queue_full"
    finally:
        for s in streams:
            s.__exit__(None, None, None)


@pytest.mark.parametrize("fields, param", [
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_k": 1.5}, "top_k"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"seed": "7"}, "seed"),
    ({"min_tokens": 5}, "min_tokens"),  # more than max_tokens
    ({"ignore_eos": "yes"}, "ignore_eos"),
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": True}, "logprobs"),
    ({"logit_bias": {"5": 10}}, "logit_bias"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": "8"}, "max_tokens"),
    ({"max_tokens": 5000}, "max_tokens"),
    ({"prompt": [1, 999]}, "prompt"),
    ({"prompt": list(range(65))}, "prompt"),
    ({"n": 2}, "n"),
])
def test_bad_requests_get_400_naming_the_field(server, fields, param):
    """Each bad field is refused with 400 and an OpenAI error body naming it."""
    body = {"model": server.model_id, "prompt": [1, 2, 3], "max_tokens": 4, **fields}
    r = httpx.post(f"{server.url}/v1/completions", json=body)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert set(error) == {"message", "type", "param", "code"}


def test_unknown_model_is_404_through_the_client(server):
    """The openai client sees an unknown model as NotFoundError naming `model`."""
    with pytest.raises(openai.NotFoundError) as e:
        server.client().completions.create(model="gpt-4", prompt=[1, 2], max_tokens=2)
    assert e.value.param == "model"


def test_models_health_and_metrics(server):
    """/v1/models lists the model, /health is 200, /metrics parses with prometheus' parser."""
    assert [m.id for m in server.client().models.list()] == [server.model_id]
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    server.client().completions.create(model=server.model_id, prompt=[4, 5], max_tokens=3)
    m = server.metrics()
    assert m['pdgpu_requests_total{"outcome": "ok"}'] >= 1
    assert m['pdgpu_ttft_seconds_count{}'] >= 1 and m['pdgpu_itl_seconds_count{}'] >= 2
    assert m['pdgpu_handoff_seconds_count{}'] >= 1
    assert m['pdgpu_producers_serving{}'] == 1 and m['pdgpu_producer_deaths_total{}'] == 0
    assert m['pdgpu_live_check_violations_total{}'] == 0
    assert m['pdgpu_requests_total{"outcome": "rejected"}'] >= 0


def test_preset_token_ids_only_and_sigterm_drains(tmp_path):
    """`tiny` (no tokenizer) refuses text with 400; SIGTERM lets the stream in flight finish,
    refuses new requests (503), and the trace closes legal with no page leaked."""
    srv = Server(tmp_path, "tiny", "--http-max-prompt", "32")
    try:
        client = srv.client()
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="tiny", prompt="hello", max_tokens=2)
        assert e.value.param == "prompt" and "tokenizer" in e.value.message
        stream = client.completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=300,
                                           stream=True)
        first = next(iter(stream))
        srv.terminate()
        srv.wait_health(503, 0.02)
        with pytest.raises(openai.APIStatusError) as e:
            client.completions.create(model="tiny", prompt=[1], max_tokens=1)
        assert e.value.status_code == 503
        rest = [c.choices[0] for c in stream if c.choices]
        assert len(token_ids(first.choices[0])) + sum(len(token_ids(c)) for c in rest) == 300
        assert rest[-1].finish_reason == "length"
    finally:
        code, values = srv.stop()
    assert code == 143 and values["ok"] == 1 and values["leaked_pages"] == 0
    trace_ok(srv.trace.read_bytes().splitlines())


@pytest.mark.parametrize("argv, words", [
    (["--http", "localhost"], "HOST:PORT"),
    (["--http", "127.0.0.1:0", "--prompts", "p.jsonl"], "--prompts"),
    (["--http", "127.0.0.1:0", "--rate", "2"], "--rate"),
    (["--http", "127.0.0.1:0", "--prefix", "16"], "--prefix"),
])
def test_http_option_refusals(capsys, argv, words):
    """A bad address or a batch-mode option with --http: one line naming it, exit 2."""
    from pdgpu.cli import main
    assert main(["serve", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and words in err


def test_http_without_its_packages_is_refused(capsys, monkeypatch):
    """Without the `http` extra installed, --http is one line saying what to install."""
    import importlib.util

    from pdgpu.cli import main
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "fastapi" else real(name, *a))
    assert main(["serve", "--http", "127.0.0.1:0"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "fastapi" in err and "pdhandoff[http]" in err


def test_port_in_use_is_refused_before_any_producer(capsys):
    """A port another socket listens on: one line, exit 2, nothing started."""
    import socket

    from pdgpu.cli import main
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        assert main(["serve", "--http", f"127.0.0.1:{port}"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "cannot listen" in err


@pytest.mark.parametrize("stop", ["stop", "ld st", "語 h", "absent"])
def test_streamed_text_is_the_decoded_text_cut_at_the_stop(stop):
    """Pieces given token by token (multi-byte characters split over tokens) join to the
    whole decode cut before the first stop string; tokens after it are not output."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from pdgpu.serve.openai_api import Ask, Output
    from pdgpu.serve.texts import Texts
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(), decoders.ByteLevel()
    tok.train_from_iterator(["héllo wörld ñandú 日本語", "hello world"], trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    texts = Texts(tok)
    ids = texts.encode("日本語 héllo wörld stop here", special=False)
    out = Output(Ask(tuple(ids), 100, False, False, frozenset(), (stop,)), texts)
    whole = texts.decode(ids)
    assert "".join(out.add(i) for i in ids) + out.finish() == whole.split(stop)[0]
    assert out.stopped == (stop in whole)


@pytest.mark.slow
def test_health_is_503_once_no_producer_serves(tmp_path):
    """Its only producer killed (no restarts): /health turns 503, the death is counted in
    /metrics, a new request fails with an error body, the drain still closes a legal trace."""
    srv = Server(tmp_path, "tiny", "--http-max-prompt", "32", "--kill-producer", "0@3",
                 "--heartbeat-timeout", "1")
    try:
        srv.wait_health(503, 0.05)
        assert httpx.get(f"{srv.url}/health").json() == {"status": "no producer is serving"}
        while srv.metrics()['pdgpu_producer_deaths_total{}'] < 1:
            time.sleep(0.05)
        r = httpx.post(f"{srv.url}/v1/completions",
                       json={"model": "tiny", "prompt": [1, 2], "max_tokens": 2})
        assert r.status_code == 500 and "no producer left" in r.json()["error"]["message"]
    finally:
        code, values = srv.stop()
    assert code == 143 and values["failed"] == 1 and values["leaked_pages"] == 0
    trace_ok(srv.trace.read_bytes().splitlines())
