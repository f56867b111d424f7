"""The demo's served run once through HTTP (issue 25): `pdgpu serve --http` on a free port of
127.0.0.1, a few of the served prompts streamed through it with the official openai client, and
their tokens checked against the chunk run's (which equal `pdgpu generate`'s). Then SIGTERM
drains it and its trace goes to `pdref check` with the others. pdsim never imports pdgpu: the
server runs as a subprocess. Without the `http` extra (or openai) it is skipped, saying so.
"""

from __future__ import annotations

import importlib.util
import json
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from pdsim.fit.engine_runs import EngineRunError

PACKAGES = ("fastapi", "uvicorn", "prometheus_client", "tokenizers", "openai", "httpx")
START_S = 120.0  # the server must answer /health within this (a loaded machine is slow)


def missing() -> list[str]:
    return [p for p in PACKAGES if importlib.util.find_spec(p) is None]


def http_argv(demo, out: Path) -> list[str]:
    argv = [sys.executable, "-m", "pdgpu", "serve", "--http", "127.0.0.1:0", "--model",
            demo.model, "--seed", str(demo.seed), "--producers", str(demo.producers),
            "--chunk", str(demo.chunk), "--mode", "chunk", "--json", "--trace",
            str(out / "http.jsonl"), "--http-max-prompt", str(demo.prompt_range[1])]
    return argv + (["--device", demo.device] if demo.device else [])


class _Server:
    """The subprocess, its port (from its first stderr line) and its stderr kept."""

    def __init__(self, argv: list[str]) -> None:
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True)
        self.err: list[str] = []
        self.port: int | None = None
        self.listening = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.err.append(line)
            found = re.search(r"http://127\.0\.0\.1:(\d+)/v1", line)
            if found and self.port is None:
                self.port = int(found.group(1))
                self.listening.set()
        self.listening.set()

    def wait_ready(self, httpx) -> str:
        deadline = time.monotonic() + START_S
        self.listening.wait(START_S)
        with httpx.Client() as http:  # one client: each new one loads the CA bundle (33 ms
            while (self.port is not None and self.proc.poll() is None  # of CPU the starting
                   and time.monotonic() < deadline):  # server needs, 10 times a second)
                try:
                    if http.get(f"http://127.0.0.1:{self.port}/health").status_code == 200:
                        return f"http://127.0.0.1:{self.port}/v1"
                except httpx.HTTPError:
                    pass
                time.sleep(0.1)
        self.proc.kill()
        raise EngineRunError(f"pdgpu serve --http did not become ready: {''.join(self.err)[-300:]}")

    def drain(self) -> dict:
        self.proc.send_signal(signal.SIGTERM)
        out, _ = self.proc.communicate(timeout=120)
        if self.proc.returncode != 143:  # a drain SIGTERM began: exit 143 when it went well
            raise EngineRunError(f"pdgpu serve --http exited {self.proc.returncode}: "
                              f"{''.join(self.err)[-300:]}")
        return json.loads(out.strip().splitlines()[-1])


def _streamed(client, model: str, line: dict) -> list[int]:
    stream = client.completions.create(model=model, prompt=line["tokens"], stream=True,
                                       max_tokens=line["output_tokens"])
    return [t for chunk in stream if chunk.choices
            for t in chunk.choices[0].model_extra["token_ids"]]


def run_http(demo, out: Path, lines: list[dict], chunk_run: dict, count: int = 3) -> dict:
    """`count` prompts streamed through HTTP; their tokens against the chunk run's."""
    if missing():
        return {"skipped": f"needs {', '.join(missing())} (pip install -e '.[dev]')"}
    import httpx
    import openai
    start = time.perf_counter()
    server = _Server(http_argv(demo, out))
    try:
        client = openai.OpenAI(base_url=server.wait_ready(httpx), api_key="none",
                               max_retries=0)
        model = client.models.list().data[0].id
        asked = lines[:count]
        got = {line["req"]: _streamed(client, model, line) for line in asked}
    finally:
        summary = server.drain() if server.proc.poll() is None else {}
    equal = all(got[line["req"]] == chunk_run["results"][line["req"]]["output"]
                for line in asked)
    return {"requests": [line["req"] for line in asked], "tokens_equal": equal,
            "summary": summary, "wall_s": time.perf_counter() - start,
            "ok": equal and summary.get("leaked_pages") == 0}
