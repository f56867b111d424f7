"""Hardware, link and hybrid model profiles, and the cost model derived from them."""

import pytest

from pdref.models import ProfileError, load_model
from pdsim.core.costs import costs_for, sim_geometry
from pdsim.core.engines import ENGINES_DIR, list_engines, load_engine
from pdsim.core.profiles import HW_DIR, LINKS_DIR, load_hw, load_link

HW = sorted(p.stem for p in HW_DIR.glob("*.toml"))
LINKS = sorted(p.stem for p in LINKS_DIR.glob("*.toml"))


def test_shipped_profiles_are_the_promised_ones():
    """a100-pcie, h100-sxm, h200 and four links ship."""
    assert {"a100-pcie", "h100-sxm", "h200"} <= set(HW)
    assert {"pcie-gen4", "pcie-gen5", "rdma-200g", "rdma-400g"} <= set(LINKS)


@pytest.mark.parametrize("name", HW)
def test_every_hw_profile_loads_and_cites_sources(name):
    """Each hardware profile validates, names a loadable link, and cites its figures."""
    hw = load_hw(name)
    load_link(hw.link)
    text = (HW_DIR / f"{name}.toml").read_text()
    assert hw.source and "datasheet" in text.lower() and hw.arch
    assert text.count("# Datasheet:") >= 3  # peak, HBM bandwidth, HBM size: each its line
    assert hw.engine is None  # datasheet facts only: the software is an engine profile


@pytest.mark.parametrize("name", list_engines())
def test_every_engine_profile_loads_and_cites_sources(name):
    """Each engine profile validates, prices every shipped device (a roofline one has figures
    for each chip's arch), and says where its numbers come from."""
    engine = load_engine(name)
    text = (ENGINES_DIR / f"{name}.toml").read_text()
    assert engine.source and text.count("#") >= 8
    for hw in HW:
        costs = costs_for(load_model("llama-3.1-8b"), load_hw(hw), load_link("pcie-gen4"),
                          engine)
        assert costs.compute_s((0, 512)) > 0


@pytest.mark.parametrize("name", LINKS)
def test_every_link_profile_loads_and_cites_sources(name):
    """Each link profile validates and cites where its bandwidth comes from."""
    link = load_link(name)
    assert link.source and all(s.bandwidth > 0 for s in link.stages)
    assert "#" in (LINKS_DIR / f"{name}.toml").read_text()


def test_user_hw_file_with_bad_field_names_it(tmp_path):
    """A user's hw or engine TOML with a bad figure is refused with the field named."""
    text = (HW_DIR / "a100-pcie.toml").read_text().replace("hbm_bandwidth = 1.935e12",
                                                          "hbm_bandwidth = -1")
    path = tmp_path / "mine.toml"
    path.write_text(text)
    with pytest.raises(ProfileError, match="hbm_bandwidth"):
        load_hw(str(path))
    text = (ENGINES_DIR / "seed-eager.toml").read_text().replace("efficiency = 0.0544",
                                                                "efficiency = -1")
    path.write_text(text)
    with pytest.raises(ProfileError, match="efficiency"):
        load_engine(str(path))
    text = (ENGINES_DIR / "production.toml").read_text().replace("memory = 0.80",
                                                                "memory = 1.5", 1)
    path.write_text(text)
    with pytest.raises(ProfileError, match="'memory' must be in"):
        load_engine(str(path))


def test_unknown_hw_field_is_refused(tmp_path):
    """A misspelt field is refused rather than silently ignored."""
    path = tmp_path / "mine.toml"
    path.write_text((HW_DIR / "a100-pcie.toml").read_text() + "\nspan_sec = 1\n")
    with pytest.raises(ProfileError, match="span_sec"):
        load_hw(str(path))


def test_hybrid_model_carries_kv_of_attention_layers_only():
    """The hybrid model is recurrent and hands off KV of its 12 attention layers only."""
    spec = load_model("qwen3-next-80b-a3b")
    geo = sim_geometry(spec)
    assert spec.recurrent and geo.recurrent and geo.layers == 12
    assert geo.bytes_per_token == 24_576


def test_a100_copy_terms_fit_the_two_brief_points():
    """Whole copies of 939,524,096 B and 4 GiB take BRIEF's 55.61 ms and 253.60 ms (±1%)."""
    c = costs_for(load_model("qwen3-0.6b"), load_hw("a100-pcie"), load_link("pcie-gen4"),
                  load_engine("seed-eager"))
    assert c.copy_s(939_524_096) == pytest.approx(0.05561, rel=0.01)
    assert c.copy_s(4 * 2**30) == pytest.approx(0.25360, rel=0.01)


def test_faster_hardware_computes_faster():
    """Under every shipped engine, h100-sxm and h200 prefill faster than a100-pcie and h200
    gathers faster than h100."""
    spec = load_model("qwen3-0.6b")
    for engine in map(load_engine, list_engines()):
        a100, h100, h200 = (costs_for(spec, load_hw(n), load_link("pcie-gen5"), engine)
                            for n in ("a100-pcie", "h100-sxm", "h200"))
        chunk = (0, 256)
        assert h100.compute_s(chunk) < a100.compute_s(chunk), engine.name
        assert h200.gather_byte_s < h100.gather_byte_s, engine.name


def test_unknown_copier_is_refused_naming_the_field(tmp_path):
    """`copier` is serial or pipelined; anything else is refused with the field named."""
    text = (ENGINES_DIR / "seed-eager.toml").read_text().replace('copier = "serial"',
                                                                'copier = "parallel"')
    path = tmp_path / "mine.toml"
    path.write_text(text)
    with pytest.raises(ProfileError, match="'copier' must be one of 'serial', 'pipelined'"):
        load_engine(str(path))
