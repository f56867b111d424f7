"""Lazy workloads: drawn requests in parts (the same values as one draw), gamma arrivals, and
request trace files (CSV/JSONL, the Azure LLM inference traces' columns) read as a stream."""

import json

import numpy as np
import pytest

from pdsim.cli import main
from pdsim.core import workload as wl
from pdsim.core.workload import GeneratedWorkload, WorkloadError, WorkloadSpec, workload

AZURE = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:46.6805900,374,44
2023-11-16 18:15:50.9951690,396,109
2023-11-16 18:15:51.4405780,879,15
"""


def one_draw(spec: WorkloadSpec) -> list[tuple]:
    """What the workload was before it was drawn in parts: each column in one call."""
    rng = np.random.default_rng(spec.seed)
    n = spec.requests
    prompts = rng.integers(spec.prompt_range[0], spec.prompt_range[1] + 1, size=n)
    times = np.cumsum(rng.exponential(1.0 / spec.rate, size=n))
    outputs = rng.integers(spec.output_range[0], spec.output_range[1] + 1, size=n)
    return [(f"r{i}", float(times[i]), int(prompts[i]), int(outputs[i])) for i in range(n)]


def test_drawn_in_parts_equals_one_draw(monkeypatch):
    """Drawn 64 at a time, a workload of 1,000 is the one a single draw per column gives."""
    monkeypatch.setattr(wl, "DRAW_PART", 64)
    spec = WorkloadSpec(requests=1000, prompt_range=(16, 5000), rate=7.0,
                        output_range=(0, 30), seed=11)
    got = [(r.req, r.arrival, r.prompt, r.output_tokens) for r in workload(spec, 16)]
    assert got == one_draw(spec)
    assert len(GeneratedWorkload(spec, 16)) == 1000


def test_gamma_arrivals_have_the_rate_and_the_shape():
    """--arrival-shape K: gaps with mean 1/rate and squared CV 1/K; a shape without --rate,
    or not > 0, is refused."""
    spec = WorkloadSpec(requests=20000, rate=4.0, arrival_shape=0.25, seed=2)
    t = np.array([r.arrival for r in workload(spec, 16)])
    gaps = np.diff(t)
    assert gaps.mean() == pytest.approx(0.25, rel=0.05)
    assert (gaps.std() / gaps.mean()) ** 2 == pytest.approx(4.0, rel=0.15)
    with pytest.raises(WorkloadError, match="--arrival-shape needs --rate"):
        workload(WorkloadSpec(requests=3, arrival_shape=2.0), 16)
    with pytest.raises(WorkloadError, match="--arrival-shape must be > 0"):
        workload(WorkloadSpec(requests=3, rate=1.0, arrival_shape=0.0), 16)


def test_azure_trace_columns(tmp_path):
    """TIMESTAMP becomes seconds from the first row, ContextTokens the prompt,
    GeneratedTokens the output; --requests reads the first rows."""
    path = tmp_path / "azure.csv"
    path.write_text(AZURE)
    got = list(workload(WorkloadSpec(trace_file=str(path)), 16))
    assert [(r.req, r.prompt, r.output_tokens) for r in got] == [
        ("r0", 374, 44), ("r1", 396, 109), ("r2", 879, 15)]
    assert [r.arrival for r in got] == pytest.approx([0.0, 4.314579, 4.759988])
    two = list(workload(WorkloadSpec(trace_file=str(path), requests=2), 16))
    assert two == got[:2]


def test_jsonl_trace_without_outputs(tmp_path):
    """JSON lines with arrival (s) and prompt; no output: the run's --output-tokens."""
    path = tmp_path / "w.jsonl"
    path.write_text('{"arrival": 0.5, "prompt": 40}\n\n{"arrival": 0.5, "prompt": 9}\n')
    got = list(workload(WorkloadSpec(trace_file=str(path)), 16))
    assert [(r.arrival, r.prompt, r.output_tokens) for r in got] == [(0.5, 40, None),
                                                                      (0.5, 9, None)]


@pytest.mark.parametrize("text, rule", [
    ('{"arrival": 1, "prompt": 4}\n{"arrival": 0.5, "prompt": 4}\n', ":2: arrival 0.5 is before"),
    ('{"arrival": 1, "prompt": 4.5}\n', ":1: prompt 4.5 is not an integer"),
    ('{"arrival": 1, "prompt": 0}\n', ":1: prompt must be >= 1"),
    ('{"arrival": 1, "prompt": 3, "output": -1}\n', ":1: output must be >= 0"),
    ('{"prompt": 3}\n', ":1: arrival or TIMESTAMP is missing"),
    ('{"arrival": "soon", "prompt": 3}\n', ":1: arrival 'soon' is not a time"),
    ('{"arrival": -1, "prompt": 3}\n', ":1: arrival -1 is not a time"),
    ('[1, 2]\n', ":1: not a JSON object"),
    ('', "has 0 requests"),
])
def test_bad_trace_rows_are_refused_by_line(tmp_path, text, rule):
    """Each broken rule names the file, the line and the field."""
    path = tmp_path / "w.jsonl"
    path.write_text(text)
    with pytest.raises(WorkloadError, match=rule):
        list(workload(WorkloadSpec(trace_file=str(path)), 16))


def test_cli_workload_file(tmp_path, capsys):
    """`pdsim run --workload` plays the file; with another arrival or prompt source, or a
    broken row, it is one line and exit 2, and no results file is left."""
    path = tmp_path / "azure.csv"
    path.write_text(AZURE)
    results = tmp_path / "rows.jsonl"
    argv = ["run", "--hw", "h200", "--workload", str(path), "--json"]
    assert main([*argv, "--results", str(results)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["requests"] == 3 and out["generated_tokens"] == 44 + 109 + 15
    assert len(results.read_text().splitlines()) == 3
    for extra in (["--rate", "2"], ["--prompt", "9"], ["--requests", "4"],
                  ["--concurrency", "2"]):
        assert main([*argv, *extra]) == 2
        assert capsys.readouterr().err.count("\n") == 1
    bad = tmp_path / "bad.csv"
    bad.write_text(AZURE + "2023-11-16 18:15:40.0,10,1\n")
    assert main(["run", "--hw", "h200", "--workload", str(bad), "--results",
                 str(tmp_path / "none.jsonl")]) == 2
    assert "bad.csv:5: arrival" in capsys.readouterr().err
    assert not (tmp_path / "none.jsonl").exists()
