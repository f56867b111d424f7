"""`pdsim calibrate`: fitting the cost model back from traces' stage events."""

import attrs
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from pdref.models import load_model
from pdsim.cli import main
from pdsim.core.config import RequestSpec, SimConfig
from pdsim.core.costs import costs_for, engine_of, sim_geometry
from pdsim.core.engines import load_engine
from pdsim.core.play import simulate
from pdsim.core.profiles import link_of, load_hw
from pdsim.fit.calibrate import calibrate, profile_toml
from pdsim.views.report import write_trace

SPEC = load_model("qwen3-0.6b")
A100 = load_hw("a100-pcie")
COSTS = costs_for(SPEC, A100, link_of(A100), load_engine("seed-eager"))
RUNS = [("chunk", 256, 3000, 32), ("chunk", 384, 2000, 0), ("layer", 512, 1500, 16),
        ("whole", 256, 1000, 0)]
TERMS = ("token_s", "pair_s", "chunk_s", "span_s", "gather_byte_s", "link_byte_s",
         "link_latency_s", "contention")


def example_corners(test):
    """The test with each of CORNERS as an explicit example (run first, every run)."""
    for scale, contention, link in CORNERS:
        test = example([scale] * 6, contention, link)(test)
    return test


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
    return costs_for(SPEC, hw, link_of(hw), engine_of(hw))


def test_calibrating_sim_traces_recovers_the_profile(tmp_path):
    """A profile fitted from the simulator's own traces recovers every term within 1%."""
    got = recovered(tmp_path, write_traces(tmp_path, COSTS))
    for term in TERMS:
        assert getattr(got, term) == pytest.approx(getattr(COSTS, term), rel=0.01), term


@pytest.mark.parametrize("copier", ["serial", "pipelined"])
def test_calibration_recovers_the_copier_and_every_term(tmp_path, copier):
    """A slow unstreamed link (spans queue behind each other): calibration reads the copier
    the simulator ran with from the traces and recovers every term within 1%."""
    truth = attrs.evolve(COSTS, copier=copier, streamed=False,
                         link_stages=(("d2h", 1.2e-9), ("h2d", 1e-9)))
    cal = calibrate(write_traces(tmp_path, truth))
    assert (cal.copier, cal.copier_basis) == (copier, "traces")
    got = recovered(tmp_path, write_traces(tmp_path, truth))
    assert got.copier == copier
    for term in TERMS:
        assert getattr(got, term) == pytest.approx(getattr(truth, term), rel=0.01), term


def _export_traces(folder, costs, payloads=(2**30, 2**32)) -> list[str]:
    paths = []
    for payload in payloads:
        cfg = SimConfig(sim_geometry(SPEC), costs, "whole", 256, pool_pages=40000,
                        no_compute=True, labels=(("model", SPEC.name),))
        prompt = -(-payload // cfg.geometry.bytes_per_token)
        path = folder / f"export{payload}.jsonl"
        write_trace(path, simulate(cfg, [RequestSpec("r0", 0.0, prompt)]))
        paths.append(str(path))
    return paths


def _export_handoff(costs, mode: str) -> float:
    cfg = SimConfig(sim_geometry(SPEC), costs, mode, 256, pool_pages=40000, no_compute=True)
    result = simulate(cfg, [RequestSpec("r0", 0.0, -(-2**32 // cfg.geometry.bytes_per_token))])
    return max(e.t for e in result.events if e.kind == "land")


def test_serial_copier_from_whole_copies_only_makes_chunked_export_slower(tmp_path):
    """Calibrated from whole-copy export traces alone (the brief's kind of figures), a serial
    copier predicts chunked export slower than whole, a pipelined one not; the payload
    write (fill) is recovered too."""
    truth = attrs.evolve(COSTS, fill_byte_s=2e-12)
    paths = _export_traces(tmp_path, truth)
    profile = tmp_path / "whole-only.toml"
    fits = {}
    for copier in ("serial", "pipelined"):
        cal = calibrate(paths, copier=copier)
        assert cal.copier_basis == "given" and cal.fill_byte_s == pytest.approx(2e-12)
        profile.write_text(profile_toml(cal, A100, "whole-only"))
        hw = load_hw(str(profile))
        fits[copier] = costs_for(SPEC, hw, link_of(hw), engine_of(hw))
    whole = _export_handoff(fits["serial"], "whole")
    assert whole == pytest.approx(_export_handoff(truth, "whole"), rel=0.01)
    assert _export_handoff(fits["serial"], "chunk") > 1.05 * whole
    assert _export_handoff(fits["pipelined"], "chunk") < whole


def test_whole_copies_alone_show_no_copier(tmp_path):
    """One span at a time cannot show how spans share the copier: pipelined is assumed."""
    cal = calibrate(_export_traces(tmp_path, COSTS))
    assert (cal.copier, cal.copier_basis) == ("pipelined", "assumed")


# (streamed link, copier): a streamed link's stages are timed by the link, so its copier is
# serial; an unstreamed one is tried with either copier. Three cases, none drawn in vain.
LINKS = [(True, "serial"), (False, "serial"), (False, "pipelined")]
CORNERS = [(scale, contention, link) for link in LINKS
           for scale, contention in ((0.5, 0.5), (2.0, 0.0))]


@settings(max_examples=20, deadline=None)
@given(st.lists(st.floats(0.5, 2.0), min_size=6, max_size=6), st.floats(0.0, 0.5),
       st.sampled_from(LINKS))
@example_corners
def test_recovery_holds_for_other_profiles(tmp_path_factory, scales, contention, link):
    """Random variations of the profile are recovered within 1% too (a pipelined copier
    with an unstreamed link: a streamed stage's end is not its own bytes' time), and every
    corner (all terms low or high, each link and copier) is tried every run."""
    pipelined, copier = link
    folder = tmp_path_factory.mktemp("cal")
    truth = attrs.evolve(
        COSTS, token_s=COSTS.token_s * scales[0], pair_s=COSTS.pair_s * scales[1],
        chunk_s=COSTS.chunk_s * scales[2], span_s=COSTS.span_s * scales[3],
        gather_byte_s=COSTS.gather_byte_s * scales[4],
        link_stages=(("d2h", 6e-11 * scales[5]), ("h2d", 5e-11)),
        contention=contention, streamed=pipelined, copier=copier)
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
