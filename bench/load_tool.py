"""`pdgpu serve --http` under NVIDIA's aiperf, a load tool nobody here wrote (issue 39 item 5).

Run through bench/load_tool.sh (it installs aiperf into its own environment). Makes a
checkpoint whose tokenizer is a byte-level BPE trained here (multi-byte text: replies often
end inside a character), serves it, and drives it with aiperf's fixed-length streamed chat
workload (`--isl` tokens in, `--osl` out, `ignore_eos` and `min_tokens` fixing the length) at
each `--concurrency`; prints one row per concurrency and exits 1 if any request failed.

    bash bench/load_tool.sh     # 512 in, 32 out, 48 requests, concurrency 4 and 8
    bash bench/load_tool.sh --requests 16 --concurrency 4
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import attrs
import httpx
import torch

from pdgpu.checkpoint import save_checkpoint
from pdgpu.model import build_model
from pdref.models import load_model

CORPUS = ["the quick brown fox jumps over the lazy dog while the decoder admits a request",
          "héllo wörld, ñandú and crème brûlée; 日本語のテキストと絵文字 🙂🙃 mixed in",
          "pages go back when the writer is fenced, and spans land in the slab in order"]
TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--aiperf", required=True, help="the aiperf executable")
    p.add_argument("--isl", type=int, default=512)
    p.add_argument("--osl", type=int, default=32)
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--concurrency", type=int, nargs="+", default=[4, 8])
    p.add_argument("--producers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--out", default="out/load_tool", help="aiperf's artifacts go here")
    return p.parse_args(argv)


def make_checkpoint(folder: Path, vocab: int) -> Path:
    """A tiny Qwen3 whose vocabulary is a trained byte-level BPE's, and that tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(), decoders.ByteLevel()
    tok.train_from_iterator(CORPUS * 50, trainers.BpeTrainer(
        vocab_size=vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>", "<|user|>", "<|assistant|>", "<|system|>"]))
    spec = attrs.evolve(load_model("tiny"), vocab=tok.get_vocab_size())
    model = build_model(spec, seed=3)
    with torch.no_grad():  # weights large enough that the output varies with the context
        for name, param in model.named_parameters():
            if not name.endswith("norm.weight"):
                param.mul_(8)
    save_checkpoint(model, folder)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": TEMPLATE, "eos_token": "<|endoftext|>",
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 4096}))
    return folder


class Server:
    """`pdgpu serve --http 127.0.0.1:0` as a subprocess; its port from its stderr."""

    def __init__(self, folder: Path, args) -> None:
        cmd = [sys.executable, "-m", "pdgpu", "serve", "--http", "127.0.0.1:0", "--model",
               str(folder), "--producers", str(args.producers), "--chunk", "128",
               "--http-max-prompt", str(args.isl + 64), "--http-queue", "64", "--json"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True)
        found = threading.Event()
        self.port = None

        def read():
            for line in self.proc.stderr:
                match = re.search(r"http://127\.0\.0\.1:(\d+)/v1", line)
                if match and self.port is None:
                    self.port = int(match.group(1))
                    found.set()
            found.set()
        threading.Thread(target=read, daemon=True).start()
        found.wait(300)
        if self.port is None:
            raise SystemExit(f"load_tool: the server did not start ({self.proc.poll()})")
        self.url = f"http://127.0.0.1:{self.port}"
        with httpx.Client() as http:  # one client: a new one loads the CA bundle each poll
            while http.get(f"{self.url}/health").status_code != 200:
                time.sleep(0.2)

    def stop(self) -> dict:
        self.proc.terminate()
        out, _ = self.proc.communicate(timeout=120)
        lines = [line for line in out.splitlines() if line.startswith("{")]
        return json.loads(lines[-1]) if lines else {}


def run_aiperf(args, server: Server, model: str, folder: Path, concurrency: int) -> dict:
    """One aiperf profile; its exported summary."""
    artifacts = Path(args.out) / f"c{concurrency}"
    cmd = [args.aiperf, "profile", "-m", model, "--url", server.url, "--endpoint-type", "chat",
           "--streaming", "--tokenizer", str(folder), "--synthetic-input-tokens-mean",
           str(args.isl), "--synthetic-input-tokens-stddev", "0", "--output-tokens-mean",
           str(args.osl), "--output-tokens-stddev", "0", "--extra-inputs", "ignore_eos:true",
           "--extra-inputs", f"min_tokens:{args.osl}", "--concurrency", str(concurrency),
           "--request-count", str(args.requests), "--random-seed", "123", "--ui-type", "none",
           "--use-server-token-count", "--artifact-dir", str(artifacts)]
    subprocess.run(cmd, check=True)
    exports = sorted(artifacts.rglob("profile_export_aiperf.json"))
    if not exports:
        raise SystemExit(f"load_tool: aiperf wrote no profile_export_aiperf.json under "
                         f"{artifacts}")
    return json.loads(exports[-1].read_text())


def _metric(summary: dict, name: str, stat: str = "avg"):
    value = summary.get(name)
    return value.get(stat) if isinstance(value, dict) else value


def main(argv=None) -> int:
    args = _parse(argv)
    failed = 0
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = make_checkpoint(Path(tmp) / "bpe-tiny", args.vocab)
        server = Server(folder, args)
        try:
            for concurrency in args.concurrency:
                s = run_aiperf(args, server, folder.name, folder, concurrency)
                done = int(_metric(s, "completed_request_count") or 0)
                errors = sum(int(e.get("count", 1)) for e in s.get("error_summary") or []) + \
                    args.requests - done
                failed += errors
                rows.append((concurrency, done, errors,
                             _metric(s, "output_token_throughput"),
                             _metric(s, "time_to_first_token", "p50"),
                             _metric(s, "inter_token_latency", "p50"),
                             _metric(s, "output_sequence_length", "avg")))
        finally:
            summary = server.stop()
    print(f"\n{'concurrency':>11}{'completed':>10}{'errors':>8}{'out tok/s':>11}"
          f"{'TTFT p50 ms':>13}{'ITL p50 ms':>12}{'OSL avg':>9}")
    for row in rows:
        print("".join(f"{v:>{w}}" if not isinstance(v, float) else f"{v:>{w}.1f}"
                      for v, w in zip(row, (11, 10, 8, 11, 13, 12, 9), strict=True)))
    print(f"server: {summary.get('ok')} ok, {summary.get('failed')} failed, "
          f"{summary.get('leaked_pages')} leaked pages")
    return 1 if failed or summary.get("failed") else 0


if __name__ == "__main__":
    raise SystemExit(main())
