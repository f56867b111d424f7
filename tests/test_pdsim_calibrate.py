"""`pdsim calibrate`: fitting the cost model back from traces' stage events."""

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdref.models import load_model
from pdsim.calibrate import calibrate, profile_toml
from pdsim.cli import main
from pdsim.config import RequestSpec, SimConfig
from pdsim.costs import costs_for, sim_geometry
from pdsim.profiles import link_of, load_hw
from pdsim.report import write_trace
from pdsim.sim import simulate

SPEC = load_model("qwen3-0.6b")
A100 = load_hw("a100-pcie")
COSTS = costs_for(SPEC, A100, link_of(A100))
RUNS = [("chunk", 256, 3000, 32), ("chunk", 384, 2000, 0), ("layer", 512, 1500, 16),
        ("whole", 256, 1000, 0)]
TERMS = ("token_s", "pair_s", "chunk_s", "span_s", "gather_byte_s", "link_byte_s",
         "link_latency_s", "contention")


def write_traces(folder, costs) -> list[str]:
    paths = []
    for i, (mode, chunk, prompt, prefix) in enumerate(RUNS):
        cfg = SimConfig(sim_geometry(SPEC), costs, mode, chunk, pool_pages=1024,
                        labels=(("model", SPEC.name),))
        path = folder / f"t{i}.jsonl"
        write_trace(path, simulate(cfg, [RequestSpec("r0", 0.0, prompt, prefix)]))
        paths.append(str(path))
    return paths


def recovered(folder, paths):
    profile = folder / "cal.toml"
    profile.write_text(profile_toml(calibrate(paths), A100, "cal"))
    hw = load_hw(str(profile))
    return costs_for(SPEC, hw, link_of(hw))


def test_calibrating_sim_traces_recovers_the_profile(tmp_path):
    """A profile fitted from the simulator's own traces recovers every term within 1%."""
    got = recovered(tmp_path, write_traces(tmp_path, COSTS))
    for term in TERMS:
        assert getattr(got, term) == pytest.approx(getattr(COSTS, term), rel=0.01), term


@settings(max_examples=8, deadline=None)
@given(st.lists(st.floats(0.5, 2.0), min_size=6, max_size=6), st.floats(0.0, 0.5),
       st.booleans())
def test_recovery_holds_for_other_profiles(tmp_path_factory, scales, contention, pipelined):
    """Random variations of the profile are recovered within 1% too."""
    folder = tmp_path_factory.mktemp("cal")
    truth = attrs.evolve(
        COSTS, token_s=COSTS.token_s * scales[0], pair_s=COSTS.pair_s * scales[1],
        chunk_s=COSTS.chunk_s * scales[2], span_s=COSTS.span_s * scales[3],
        gather_byte_s=COSTS.gather_byte_s * scales[4],
        link_stages=(("d2h", 6e-11 * scales[5]), ("h2d", 5e-11)),
        contention=contention, streamed=pipelined)
    got = recovered(folder, write_traces(folder, truth))
    for term in TERMS:  # contention is a ratio: 1e-12 of it is float noise, not a term
        tol = 1e-9 if term == "contention" else 1e-12
        assert getattr(got, term) == pytest.approx(getattr(truth, term), rel=0.01, abs=tol)


def test_calibrate_cli_profile_is_accepted_by_run(tmp_path, capsys):
    """calibrate writes a profile that `pdsim run --hw PROFILE.toml` accepts."""
    paths = write_traces(tmp_path, COSTS)
    out = tmp_path / "mine.toml"
    assert main(["calibrate", *paths, "-o", str(out)]) == 0
    assert "rms residual" in capsys.readouterr().out
    assert main(["run", "--hw", str(out), "--json"]) == 0
    assert '"hw": "mine"' in capsys.readouterr().out


def test_calibrate_refuses_a_bad_trace(tmp_path, capsys):
    """A malformed trace: exit 2, one line naming it, no profile written."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"kind": "header"}\n')
    out = tmp_path / "p.toml"
    assert main(["calibrate", str(bad), "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "TRACE-1" in err
    assert not out.exists()
