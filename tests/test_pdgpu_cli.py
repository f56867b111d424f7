"""pdgpu command line: run/compare outputs, traces pdref accepts, bad input as one line + exit 2."""

from __future__ import annotations

import json
import sys

import pytest

from pdgpu.cli import main
from pdref.check import check_file

SMALL_RUN = ["--prompt", "80", "--chunk", "16"]


def test_run_writes_a_trace_pdref_accepts_and_prints_json(tmp_path, capsys):
    """`pdgpu run --trace --json`: exit 0, one JSON object, a trace that checks ok."""
    trace = tmp_path / "t.jsonl"
    assert main(["run", *SMALL_RUN, "--mode", "layer", "--trace", str(trace), "--json"]) == 0
    metrics = json.loads(capsys.readouterr().out)
    assert metrics["mode"] == "layer" and metrics["spans"] == 2
    result = check_file(trace)
    assert result.ok, result.text()
    header = json.loads(trace.read_text().splitlines()[0])
    assert header["chunk"] == 16 and header["source"] == "pdgpu"


def test_run_text_output_names_design_metrics(capsys):
    """Plain output lists contract.md's metric names, one per line."""
    assert main(["run", *SMALL_RUN, "--link-gbps", "5"]) == 0
    out = capsys.readouterr().out
    for name in ("bytes", "spans", "prefill_s", "handoff_s", "tail_s", "peak_staging_bytes",
                 "first_token", "link_gbps"):
        assert f" {name}: " in out


def test_explicit_tokens_and_tokens_file_agree(tmp_path, capsys):
    """--tokens and --tokens-file with the same ids give the same first token."""
    ids = ",".join(str(i * 7 % 256) for i in range(40))
    path = tmp_path / "ids.txt"
    path.write_text(ids.replace(",", " \n"))
    assert main(["run", "--tokens", ids, "--chunk", "16", "--json"]) == 0
    a = json.loads(capsys.readouterr().out)
    assert main(["run", "--tokens-file", str(path), "--chunk", "16", "--json"]) == 0
    b = json.loads(capsys.readouterr().out)
    assert a["prompt"] == 40 and a["first_token"] == b["first_token"]


def test_compare_reports_parity_and_ratios(tmp_path, capsys):
    """`pdgpu compare --json`: every mode at parity with whole; one trace per mode written."""
    args = ["compare", *SMALL_RUN, "--prefix", "16", "--json", "--trace-dir", str(tmp_path)]
    assert main(args) == 0
    summary = json.loads(capsys.readouterr().out)
    assert set(summary) == {"whole", "chunk", "layer"}
    assert all(s["parity"] == {"kv_equal": True, "token_equal": True} for s in summary.values())
    assert summary["whole"]["vs_whole"]["handoff_s_ratio"] == 1.0
    assert all(check_file(tmp_path / f"{m}.jsonl").ok for m in summary)


def test_compare_table_and_fail_span_recovery(capsys):
    """The text table shows parity ok even when the first copy of a run fails and retries."""
    assert main(["compare", *SMALL_RUN, "--fail-span", "0"]) == 0
    out = capsys.readouterr().out
    assert "parity: ok" in out and "kv==whole" in out


def test_debug_break_exits_1_with_the_code(tmp_path, capsys):
    """A protocol-breaking debug switch stops the run: exit 1, the code, no trace written."""
    trace = tmp_path / "t.jsonl"
    assert main(["run", *SMALL_RUN, "--debug", "issue-early", "--trace", str(trace)]) == 1
    assert "COPY-1" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


BAD = [
    (["--prompt", "0"], "--prompt: must be >= 1"),
    (["--chunk", "0"], "--chunk: must be >= 1"),
    (["--prefix", "8"], "prefix must be a multiple of page_tokens"),
    (["--prefix", "96"], "prefix must be in [0, prompt=80]"),
    (["--max-pending", "0"], "--max-pending: must be >= 1"),
    (["--model", "no-such-model"], "unknown profile"),
    (["--pool-pages", "2"], "pool_pages"),
    (["--tokens", "1,x,3"], "tokens"),
    (["--tokens", "1,2,999"], "vocab"),
    (["--link-gbps", "-1"], "link-gbps"),
    (["--link-gbps", "inf"], "--link-gbps: must be a finite number > 0"),
    (["--link-gbps", "nan"], "--link-gbps: must be a finite number > 0"),
    (["--link-gbps", "fast"], "--link-gbps: must be a number, got 'fast'"),
    (["--chunk", "1.5"], "--chunk: must be an integer, got '1.5'"),
    (["--mode", "sideways"], "mode"),
    (["--device", "tpu"], "device"),
    (["--model", "qwen3-next-80b-a3b", "--mode", "layer"], "CFG-1"),
]


@pytest.mark.parametrize("extra,needle", BAD, ids=[b[1] for b in BAD])
def test_bad_input_is_one_line_exit_2_nothing_written(tmp_path, capsys, extra, needle):
    """Each bad input: exit 2, one stderr line naming the field/rule, no trace file."""
    trace = tmp_path / "t.jsonl"
    args = ["run", "--prompt", "80", "--chunk", "16", "--trace", str(trace)]
    if "--tokens" in extra:
        args = ["run", "--chunk", "16", "--trace", str(trace)]
    code = main(args + extra)
    err = capsys.readouterr().err
    assert code == 2
    assert needle in err and err.count("\n") == 1
    assert "Traceback" not in err
    assert not trace.exists()


def test_missing_trace_folder_is_bad_input(tmp_path, capsys):
    """A trace path in a folder that does not exist is refused before running."""
    assert main(["run", *SMALL_RUN, "--trace", str(tmp_path / "no" / "t.jsonl")]) == 2
    assert "trace" in capsys.readouterr().err


def test_checkpoint_folder_runs_like_the_preset_it_was_saved_from(tmp_path, capsys):
    """--model DIR (HF layout) gives the same first token as the seeded preset it came from."""
    from pdgpu.checkpoint import save_checkpoint
    from pdgpu.model import build_model
    from pdref.models import load_model

    save_checkpoint(build_model(load_model("tiny"), seed=7), tmp_path / "ckpt")
    args = ["--tokens", ",".join(str(i * 11 % 256) for i in range(80)), "--chunk", "16", "--json"]
    assert main(["run", "--model", str(tmp_path / "ckpt"), *args]) == 0
    from_dir = json.loads(capsys.readouterr().out)
    assert main(["run", "--model", "tiny", "--seed", "7", *args]) == 0
    assert json.loads(capsys.readouterr().out)["first_token"] == from_dir["first_token"]


def test_bad_checkpoint_folder_is_one_line_exit_2(tmp_path, capsys):
    """A folder without weights is refused with one line and exit 2."""
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    assert main(["run", "--model", str(folder), *SMALL_RUN]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_no_warmup_flag_gives_cold_numbers_and_the_same_results(tmp_path, capsys):
    """`--no-warmup` on run and compare: no warm-up time, same first token, traces check ok."""
    trace = tmp_path / "cold.jsonl"
    assert main(["run", *SMALL_RUN, "--json", "--no-warmup", "--trace", str(trace)]) == 0
    cold = json.loads(capsys.readouterr().out)
    assert main(["run", *SMALL_RUN, "--json"]) == 0
    warm = json.loads(capsys.readouterr().out)
    assert cold["warmup_s"] is None and warm["warmup_s"] > 0
    assert cold["first_token"] == warm["first_token"]
    assert check_file(trace).ok
    assert main(["compare", *SMALL_RUN, "--no-warmup", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert all(s["metrics"]["warmup_s"] is None for s in summary.values())
    assert all(s["parity"] == {"kv_equal": True, "token_equal": True} for s in summary.values())


def test_compare_makes_a_missing_trace_dir(tmp_path):
    """`--trace-dir` that does not exist yet is created, and every mode's trace lands in it."""
    folder = tmp_path / "new" / "traces"
    assert main(["compare", *SMALL_RUN, "--trace-dir", str(folder)]) == 0
    assert sorted(p.name for p in folder.iterdir()) == ["chunk.jsonl", "layer.jsonl",
                                                        "whole.jsonl"]


def test_trace_dir_under_a_file_is_refused(tmp_path, capsys):
    """A `--trace-dir` below a plain file is one clear line and exit 2."""
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert main(["compare", *SMALL_RUN, "--trace-dir", str(blocker / "traces")]) == 2
    assert "trace-dir" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["-1", "0"])
def test_chunk_below_one_is_one_rule_one_message(capsys, value):
    """--chunk -1 and --chunk 0 break the same rule and say so the same way."""
    assert main(["run", "--prompt", "32", "--chunk", value]) == 2
    assert f"--chunk: must be >= 1, got {value}" in capsys.readouterr().err


def test_tokens_and_tokens_file_together_are_refused(tmp_path, capsys):
    """--tokens-file no longer silently wins over --tokens."""
    path = tmp_path / "ids.txt"
    path.write_text("1 2 3")
    assert main(["run", "--tokens", "4,5,6", "--tokens-file", str(path)]) == 2
    assert "not both" in capsys.readouterr().err


class _InterruptedImport:
    """A meta-path finder that raises KeyboardInterrupt for one module, as a Ctrl-C would."""

    def __init__(self, name: str) -> None:
        self.name = name

    def find_spec(self, name, path=None, target=None):
        if name == self.name:
            raise KeyboardInterrupt
        return None


def test_ctrl_c_while_the_command_loads_is_one_line_exit_130(monkeypatch, capsys):
    """A Ctrl-C while `pdgpu` imports its modules (torch) ends with one line and exit 130,
    not a traceback."""
    from pdgpu.__main__ import run

    monkeypatch.delitem(sys.modules, "pdgpu.cli")
    monkeypatch.setattr(sys, "meta_path", [_InterruptedImport("pdgpu.cli"), *sys.meta_path])
    assert run() == 130
    assert capsys.readouterr().err.strip() == "pdgpu: interrupted (Ctrl-C) while starting"
